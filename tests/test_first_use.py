"""What a new user meets (issue 41, item 6): the host pool sized to the machine, an unreachable store
said at start and in `/health` and `/metrics`, early refusals, and one access line per request.

`kvtier serve` runs as a process of its own over the tiny checkpoint (tests/served.py); the
refusals run the command in this process or a child, and must come before any model loads.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

for needed in ("transformers", "fastapi", "uvicorn", "openai", "httpx", "tokenizers", "prometheus_client"):
    pytest.importorskip(needed)

import httpx  # noqa: E402
from redis_servers import free_port  # noqa: E402
from served import MODEL, samples, serving, tiny_model, tiny_tokenizer  # noqa: E402

from kvtier.cli import main  # noqa: E402
from kvtier.cli.build import HOST_TOKENS_CAP, default_host_tokens  # noqa: E402
from kvtier.engine import Engine  # noqa: E402
from kvtier.server.app import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GB = 10**9


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("available", [1 * GB, 16 * GB, 512 * GB])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_the_default_host_pool_fits_the_ram_available(device: str, available: int, page: int) -> None:
    per_token, device_tokens = 46080, 16384  # SmolLM2 in float32
    tokens, why = default_host_tokens(per_token, device_tokens, device, page, available)
    assert tokens % page == 0 and tokens % 64 == 0 and tokens >= 64
    assert tokens <= HOST_TOKENS_CAP
    assert tokens * per_token <= available * (0.25 if device == "cuda" else 0.10)
    if device == "cpu":  # both pools are RAM: the host tier stays within twice the device's
        assert tokens <= 2 * device_tokens
    assert f"{available / GB:.1f} GB" in why


def test_serve_sizes_its_host_pool_says_an_unreachable_store_and_logs_each_request(checkpoint: Path) -> None:
    """Defaults but the device pool, and a Redis URL where nothing listens: the sizes chosen and one
    warning at start; `/health` and `/metrics` name the store's state; an access line per request."""
    port = free_port()
    argv = [sys.executable, "-m", "kvtier", "serve", "--model", str(checkpoint), "--device", "cpu"]
    argv += ["--device-tokens", "512", "--model-name", MODEL, "--port", str(port)]
    argv += ["--storage", "redis://127.0.0.1:1"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        health = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(base + "/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert health is not None and health.status_code == 200, proc.poll()
        assert health.json() == {"status": "ok", "storage": "unreachable"}
        got = samples(httpx.get(base + "/metrics").text)
        assert got["kvtier_storage_up"] == 0
        # greedy: at the default temperature of 1 the tiny random model may sample its EOS first
        hi = [{"role": "user", "content": "hi"}]
        body = {"model": MODEL, "messages": hi, "max_tokens": 3, "temperature": 0}
        answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200  # a store that is down is a miss, never a failure
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    sized = re.search(r"host pool sized to this machine: (\d+) tokens", out)
    assert sized, out
    assert int(sized.group(1)) <= 1024 and f"host pool {sized.group(1)} tokens" in out  # 2 x the device's
    warnings = [line for line in (out + err).splitlines() if "unreachable" in line]
    assert len(warnings) == 1 and "redis://127.0.0.1:1" in warnings[0], out + err
    access = [line for line in err.splitlines() if line.startswith("kvtier.access:")]
    chat = [line for line in access if '"POST /v1/chat/completions" 200' in line]
    assert len(chat) == 1 and re.search(r"tokens \d+\+3 ttft \d+ ms", chat[0]), access
    assert any('"GET /health" 200' in line for line in access)
    assert "Traceback" not in err


def test_the_access_log_is_off_with_the_flag_and_names_a_left_stream_499(caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.access")
    tokenizer = tiny_tokenizer()
    hi = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "messages": hi, "max_tokens": 2, "temperature": 0}  # sampling may stop at EOS
    for access_log in (False, True):
        engine = Engine(tiny_model(tokenizer), tokenizer, device_tokens=512, host_tokens=2048)
        with serving(create_app(engine, MODEL, access_log=access_log)) as base:
            assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
            lines = [r.getMessage() for r in caplog.records if r.name == "kvtier.access"]
            assert len(lines) == (1 if access_log else 0)
    assert re.search(r'"POST /v1/chat/completions" 200 tokens \d+\+2 ttft \d+ ms, \d+ ms$', lines[0])


def test_an_unwritable_store_is_refused_before_the_model_loads(tmp_path: Path, capsys) -> None:
    # A checkpoint that does not load: had the model been loaded first, that would be the error.
    (tmp_path / "config.json").write_text("{}")
    argv = ["serve", "--model", str(tmp_path), "--storage", "file:///proc/kvtier-store"]
    assert main([*argv, "--port", str(free_port())]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/proc/kvtier-store" in err[0] and str(tmp_path) not in err[0], err


def test_multiturn_plot_without_matplotlib_is_refused_before_any_work(tmp_path: Path) -> None:
    report = tmp_path / "multiturn.json"
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
        "from kvtier.cli import main\n"
        f"sys.exit(main(['bench', 'multiturn', '--device', 'cpu', '--plot', '{tmp_path / 'p.png'}', "
        f"'--json', '{report}']))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert (
        done.stderr.strip() == "kvtier bench multiturn: error: needs matplotlib (pip install 'kvtier[bench]')"
    )
    assert "building the model" not in done.stdout and not report.exists()
