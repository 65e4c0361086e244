"""`kvtier bench vllm`: the time to first token of a vLLM OpenAI server with kvtier's connector, for
prompts that are a kvtier host hit, a storage hit and a miss; and of kvtier's own server.

Everything goes through HTTP and the official `openai` client (streamed completions of token-id
prompts, greedy, a few tokens); TTFT is the time from the request to its first streamed choice.

- vLLM (a subprocess of the vLLM venv's python, `--vllm-python` or `$KVTIER_VLLM_PYTHON`), its
  own prefix cache off (`--no-enable-prefix-caching`), so a repeated prompt can only come from
  kvtier: server A, over an empty file store, answers each prompt twice: a miss (recomputed,
  its blocks saved to kvtier's host pool and written through to the store), then a host hit.
  Server B, a new process over the same store, answers each prompt once: a storage hit.
- kvtier's own server (`kvtier serve`, one process per prompt length, its device pool sized
  for one prompt): each length's prompts once (misses; each evicts the one before from the
  device), then again in the same order: host hits.

Each hit's answer is compared with the miss's of the same prompt (`identical`). The hits are
counted from each server's `/metrics` (`hits`), so a cell that was not the tier it names shows.
Prompt lengths beyond the model's context (SmolLM2: 8192) are cut to the longest that fits,
as `kvtier bench served` does (`kvtier.bench.served.fit_prefixes`).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch

import kvtier
from kvtier.bench.common import Progress, environment, quiet
from kvtier.bench.served import fit_prefixes
from kvtier.errors import BackendUnavailableError, ConfigError

PYTHON_ENV = "KVTIER_VLLM_PYTHON"
MODEL_NAME = "bench"
# The lowest token id drawn: SmolLM2's special tokens sit below it.
LOW_TOKEN = 100
# Seconds a server may take to answer /health once started (vLLM's CPU build: ~30 s eager).
START_S = 900.0
# Seconds between two timed requests: the store's background writes land outside the next one.
SETTLE_S = 1.0


@dataclass(frozen=True)
class VLLMBench:
    """What `kvtier bench vllm` runs (see the module docstring)."""

    vllm_python: str
    model: Path
    tokens: tuple[int, ...] = (1024, 2048, 4096, 8192)
    repeats: int = 3
    max_tokens: int = 8
    block_size: int = 128
    host_gb: float = 1.0
    store: Path | None = None  # default: a temporary folder
    kvtier_server: bool = True
    dtype: str = "bfloat16"  # both servers' weights and KV
    vllm_args: tuple[str, ...] = ("--enforce-eager",)


def vllm_python(given: str | None) -> str:
    """The vLLM venv's python: `given`, else `$KVTIER_VLLM_PYTHON` (`ConfigError` where neither)."""
    python = given or os.environ.get(PYTHON_ENV)
    if not python:
        raise ConfigError(f"name the python of a venv with vLLM: --vllm-python PATH or ${PYTHON_ENV}")
    if not Path(python).is_file():
        raise ConfigError(f"the vLLM python {python!r} does not exist")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process (`argv`, its output in `log`) on `port`; `ready()` waits for `/health`."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        self.base, self.log = f"http://127.0.0.1:{port}", log
        self._out = log.open("w")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env)

    def ready(self, timeout_s: float = START_S) -> Server:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        tail = self.log.read_text()[-3000:]
        raise BackendUnavailableError(f"the server did not start (see {self.log}):\n{tail}")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=600)

    def counter(self, prefix: str) -> float:
        """The sum of `/metrics` samples whose name starts with `prefix`."""
        text = httpx.get(self.base + "/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL after 60 s; reaped."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def prompt(n: int, r: int, vocab: int) -> list[int]:
    """Prompt `r` of `n` tokens: ids drawn from `[LOW_TOKEN, vocab)`, seeded by `(n, r)`; no two
    prompts share a first block."""
    rng = random.Random(n * 1000 + r)
    return [rng.randrange(LOW_TOKEN, vocab) for _ in range(n)]


def ttft(server: Server, ids: list[int], max_tokens: int) -> tuple[float, str]:
    """A streamed greedy completion of `ids`: seconds to its first choice, and its whole text."""
    client = server.client()
    start = time.perf_counter()
    first, text = None, []
    stream = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices:
            if first is None:
                first = time.perf_counter() - start
            text.append(chunk.choices[0].text or "")
    if first is None:
        raise BackendUnavailableError("the stream ended without a choice")
    return first, "".join(text)


def vllm_server(bench: VLLMBench, store: Path | None, log: Path) -> Server:
    """vLLM's OpenAI server: with kvtier's connector over the file store `store`, its own prefix
    cache off; without a connector and with its prefix cache where `store` is None."""
    config = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_gb": bench.host_gb, "storage": f"file://{store}"},
    }
    port = free_port()
    argv = [bench.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(bench.model)]
    argv += ["--served-model-name", MODEL_NAME, "--port", str(port), "--host", "127.0.0.1"]
    argv += ["--max-model-len", str(context_of(bench.model)), "--block-size", str(bench.block_size)]
    argv += ["--dtype", bench.dtype, *bench.vllm_args]
    if store is not None:
        argv += ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(config)]
    env = {**os.environ, "PYTHONPATH": _kvtier_root()}
    # vLLM's CPU build (unused on a GPU): GiB of KV; every core for the worker, with a connector
    # or without (by default a connector reserves one more core for itself).
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return Server(argv, port, log, env).ready()


def kvtier_server(bench: VLLMBench, n: int, log: Path) -> Server:
    """`kvtier serve` of the same model (on CUDA where there is one), its device pool holding one
    prompt of `n` tokens."""
    port = free_port()
    room = n + 2 * bench.max_tokens + 64
    argv = [sys.executable, "-m", "kvtier", "serve", "--model", str(bench.model), "--port", str(port)]
    argv += ["--device-tokens", str(room), "--host-tokens", str((bench.repeats + 1) * room)]
    argv += ["--model-name", MODEL_NAME, "--no-access-log", "--dtype", bench.dtype]
    env = {**os.environ, "PYTHONPATH": _kvtier_root()}
    return Server(argv, port, log, env).ready()


def _kvtier_root() -> str:
    """The folder that holds this kvtier package, first on the servers' path: they run this code."""
    return os.pathsep.join(
        p for p in (str(Path(kvtier.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p
    )


def _config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def context_of(model: Path) -> int:
    """The model's context in tokens (its config.json's `max_position_embeddings`)."""
    return int(_config(model)["max_position_embeddings"])


def _vocab(model: Path) -> int:
    return int(_config(model)["vocab_size"])


def _timed(server: Server, ids: list[int], bench: VLLMBench) -> tuple[float, str]:
    out = ttft(server, ids, bench.max_tokens)
    time.sleep(SETTLE_S)
    return out


def _warm(server: Server, bench: VLLMBench) -> Server:
    """One untimed request of a prompt no timed one shares (a server's first request is slower)."""
    ttft(server, prompt(bench.block_size + 7, 99, _vocab(bench.model)), bench.max_tokens)
    return server


def _wait_for_pages(store: Path, pages: int, timeout_s: float = 120) -> int:
    """Wait until `store` holds at least `pages` files and their count stopped growing; the count."""
    deadline, last = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        count = sum(1 for p in store.rglob("*") if p.is_file())
        if count >= pages and count == last:
            return count
        last = count
        time.sleep(1)
    return last


Samples = dict[tuple[str, int], list[float]]  # (case, prompt tokens) -> TTFTs
Answers = dict[tuple[str, int, int], str]  # (case, prompt tokens, repeat) -> text


def _phase(
    server: Server,
    bench: VLLMBench,
    n: int,
    cases: tuple[str, ...],
    samples: Samples,
    answers: Answers,
    progress: Progress,
) -> None:
    """Each repeat's prompt of `n` tokens asked once per case in `cases`, one after the other."""
    for r in range(bench.repeats):
        ids = prompt(n, r, _vocab(bench.model))
        for case in cases:
            progress(f"{server.log.stem}: {n} tokens, repeat {r + 1}, {case}")
            t, answers[(case, n, r)] = _timed(server, ids, bench)
            samples.setdefault((case, n), []).append(t)


def measure_vllm(bench: VLLMBench, lengths: list[int], store: Path, logs: Path, progress: Progress):
    """vLLM's servers one after the other: A with kvtier (each prompt a miss, then at once a host
    hit), B with kvtier over A's store (storage hits), C without kvtier, its own prefix cache on
    (a miss, then a hit of vLLM's own cache: the reference answers); samples, answers, and the
    hits the servers' `/metrics` counted."""
    samples: Samples = {}
    answers: Answers = {}
    counted = {"expected_blocks": sum((n - 1) // bench.block_size for n in lengths) * bench.repeats}
    runs = (
        ("vllm_a", store, ("miss", "host_hit"), "host_hit_blocks"),
        ("vllm_b", store, ("storage_hit",), "storage_hit_blocks"),
        ("vllm_c", None, ("no_connector_miss", "prefix_cache_hit"), None),
    )
    for name, over, cases, hits in runs:
        progress(f"{name}: starting")
        server = _warm(vllm_server(bench, over, logs / f"{name}.log"), bench)
        try:
            for n in lengths:
                _phase(server, bench, n, cases, samples, answers, progress)
            if hits is not None:
                counted[hits] = server.counter(f"vllm:kvtier_{hits}_total")
        finally:
            server.stop()
        if name == "vllm_a":
            counted["store_pages"] = _wait_for_pages(store, counted["expected_blocks"])
    return samples, answers, counted


def measure_kvtier(bench: VLLMBench, lengths: list[int], logs: Path, progress: Progress):
    """kvtier's own server per length: the misses, one more prompt (so the last miss leaves the
    device too), then the host hits; samples, answers, and the host-hit tokens `/metrics` counted."""
    samples: Samples = {}
    answers: Answers = {}
    host_tokens = 0.0
    for n in lengths:
        progress(f"kvtier serve for {n} tokens: starting")
        server = _warm(kvtier_server(bench, n, logs / f"kvtier_{n}.log"), bench)
        try:
            _phase(server, bench, n, ("miss",), samples, answers, progress)
            ttft(server, prompt(n, bench.repeats, _vocab(bench.model)), bench.max_tokens)
            _phase(server, bench, n, ("host_hit",), samples, answers, progress)
            host_tokens += server.counter('kvtier_cache_prompt_tokens_total{tier="host"}')
        finally:
            server.stop()
    return samples, answers, {"host_hit_tokens": host_tokens}


def run(bench: VLLMBench, progress: Progress = quiet) -> dict:
    """Every measurement; the report `{"meta", "rows", "answers"}` (`kvtier.bench.vllm_report`)."""
    from kvtier.bench.vllm_report import answers_of, rows_of

    load_before = list(os.getloadavg())
    context = context_of(bench.model)
    lengths = fit_prefixes(bench.tokens, context, progress, bench.model.name)
    logs = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-logs-"))
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-store-") as tmp:
        v_samples, v_answers, v_counted = measure_vllm(
            bench, lengths, bench.store or Path(tmp), logs, progress
        )
    rows = rows_of("vllm", bench.repeats, lengths, v_samples, v_answers)
    counted, answers = {"vllm": v_counted}, {"vllm": answers_of(v_answers)}
    if bench.kvtier_server:
        k_samples, k_answers, counted["kvtier"] = measure_kvtier(bench, lengths, logs, progress)
        rows += rows_of("kvtier", bench.repeats, lengths, k_samples, k_answers)
        answers["kvtier"] = answers_of(k_answers)
    meta = {
        **environment(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        **{k: str(v) if isinstance(v, Path) else v for k, v in asdict(bench).items()},
        "context": context,
        "lengths": lengths,
        "vllm": _vllm_version(bench.vllm_python),
        "counted": counted,
        "logs": str(logs),
        "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
    }
    return {"meta": meta, "rows": [asdict(r) for r in rows], "answers": answers}


def _vllm_version(python: str) -> str:
    """The vLLM build `python` imports (`vllm.__version__`)."""
    code = "import vllm; print(vllm.__version__)"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"
