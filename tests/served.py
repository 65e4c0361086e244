"""`kvtier serve` for tests: a tiny tokenizer and checkpoint, an app served in a thread, and the
server run as a process of its own.

Shared by `test_server.py`, `test_server_admission.py` and `test_storage_share.py`; import
it after `pytest.importorskip` of transformers, fastapi, uvicorn, httpx and openai.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import transformers
import uvicorn
from redis_servers import free_port
from tiny_models import tiny_llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

MODEL = "tiny-llama"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "the quick brown fox"},
    {"role": "user", "content": "jumps over the lazy dog"},
]


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained here on a few sentences, with a chat template."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "kvtier keeps prefixes in host memory"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.chat_template = TEMPLATE
    return fast


def tiny_model(tokenizer):
    """The tiny Llama over `tokenizer`'s vocabulary (256 positions), seeded: the same weights each call."""
    return tiny_llama(len(tokenizer), 256, eos_token_id=tokenizer.eos_token_id)


def save_checkpoint(path: Path) -> Path:
    """Save the tiny model and its tokenizer as a checkpoint `kvtier serve --model` loads."""
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@contextmanager
def serving(app) -> Iterator[str]:
    """`app` served by uvicorn in a thread on a free loopback port: its base URL; stopped after."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text: `name{labels}` -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Served:
    """`kvtier serve` started as a process of its own on a free loopback port; `ready()` waits for it."""

    def __init__(self, checkpoint: Path, *flags: str) -> None:
        self.base = f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "kvtier", "serve", "--model", str(checkpoint), "--device", "cpu"]
        argv += ["--device-tokens", "512", "--host-tokens", "2048", "--model-name", MODEL]
        argv += ["--port", self.base.rsplit(":", 1)[1], *flags]
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def ready(self, timeout: float = 90) -> Served:
        """Wait until `/health` answers; kill the process and fail with its output if it never does."""
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.2)
        self.proc.kill()
        out, err = self.proc.communicate()
        raise AssertionError(f"kvtier serve did not start (exit {self.proc.returncode}):\n{out}\n{err}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=60)

    def chat(self, messages=MESSAGES, max_tokens: int = 8):
        """A greedy chat completion (the whole response)."""
        return self.client().chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
        )

    def metrics(self) -> dict[str, float]:
        return samples(httpx.get(self.base + "/metrics").text)

    def stop(self, sig: int) -> tuple[int, str, str]:
        """Send `sig`; the exit code, stdout and stderr once the process has ended."""
        self.proc.send_signal(sig)
        try:
            out, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self.proc.returncode, out, err

    def kill(self) -> None:
        """SIGKILL by PID and reap, where it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


class ServedProcesses:
    """Start `Served` processes (`start(checkpoint, *flags)`, ready or not); `kill()` every one left."""

    def __init__(self) -> None:
        self.started: list[Served] = []

    def start(self, checkpoint: Path, *flags: str, ready: bool = True) -> Served:
        self.started.append(Served(checkpoint, *flags))
        return self.started[-1].ready() if ready else self.started[-1]

    def kill(self) -> None:
        for s in self.started:
            s.kill()
