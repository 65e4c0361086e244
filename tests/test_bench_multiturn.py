"""`kvtier bench multiturn` and `kvtier bench batching` on the tiny shape: each configuration, JSON, plot."""

from __future__ import annotations

import gc
import itertools
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvtier import cli
from kvtier.bench import batching, engines, multiturn
from kvtier.cli import args as cli_args
from kvtier.errors import ConfigError

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
# 3 clients of 3 rounds growing to 32 + 3 * (32 + 4) = 140 tokens: 420 tokens against 256 on the device.
SMALL = ["--shape", "tiny", "--device", "cpu", "--clients", "3", "--rounds", "3", "--context-tokens", "32"]
SMALL += [
    "--question-tokens",
    "32",
    "--output-tokens",
    "4",
    "--device-tokens",
    "256",
    "--host-tokens",
    "4096",
]
SUMMARY_FIELDS = {
    "config",
    "requests",
    "duration_s",
    "requests_per_s",
    "input_tokens",
    "output_tokens",
    "input_tokens_per_s",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "latency_p50_s",
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "miss_tokens",
    "preemptions",
    "per_round",
    "cache",
    "records",
}
ROUND_FIELDS = {"round", "requests", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s"}
ROUND_FIELDS |= {"device_hit_tokens", "host_hit_tokens", "storage_hit_tokens", "miss_tokens"}


@pytest.fixture(scope="module")
def tiny():
    return engines.build_shape("tiny", CPU, torch.float32)


def test_the_cli_choices_match_what_they_name() -> None:
    assert cli_args.MULTITURN_CONFIGS == multiturn.CONFIGS
    assert cli_args.SHAPES == engines.SHAPES
    assert cli_args.BATCHING_PARTS == batching.PARTS


def test_the_shape_is_made_in_the_dtype_asked_and_leaves_the_defaults_alone() -> None:
    model = engines.build_shape("tiny", CPU, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    assert torch.empty(1).device == CPU
    auto, *_ = engines.bench_model(None, "tiny", CPU, "auto")
    assert {p.dtype for p in auto.parameters()} == {torch.float32}
    with pytest.raises(ConfigError, match="give a model or a shape"):
        engines.bench_model("some/path", "tiny", CPU, torch.float32)


def test_the_workload_comes_from_the_seed_alone() -> None:
    w = multiturn.Workload(clients=2, rounds=3, context_tokens=5, question_tokens=4, output_tokens=2, seed=7)
    qs = w.questions(100)
    assert qs == w.questions(100)
    assert qs != multiturn.Workload(2, 3, 5, 4, 2, seed=8).questions(100)
    assert [[len(q) for q in client] for client in qs] == [[9, 4, 4], [9, 4, 4]]
    assert qs[0][0][:5] != qs[1][0][:5]  # each client its own context
    assert w.arrivals() is None
    rated = multiturn.Workload(2, 3, 5, 4, 2, request_rate=50.0, seed=7)
    assert rated.questions(100) == qs  # a rate changes no conversation
    ticks = rated.arrivals()
    assert len(ticks) == 6 and (ticks[1:] > ticks[:-1]).all() and ticks[0] > 0
    with pytest.raises(ConfigError, match="request_rate"):
        multiturn.Workload(2, 3, request_rate=0.0)
    with pytest.raises(ConfigError, match="clients"):
        multiturn.Workload(0, 3)


def test_three_configurations_through_the_cli_write_json_and_plot(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "multiturn.json", tmp_path / "multiturn.png"
    assert cli.main(["bench", "multiturn", *SMALL, "--json", str(out), "--plot", str(png)]) == 0
    shown = capsys.readouterr().out
    assert "TTFT p50 per round" in shown and "kvtier / device-only: TTFT p50" in shown
    assert "working set 3 x 140 = 420 tokens" in shown
    report = json.loads(out.read_text())
    meta = report["meta"]
    assert meta["working_set_tokens"] == 420 and meta["device_tokens"] == 256
    assert meta["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # 2 layers of K and V, 2 KV heads of 16 floats
    assert set(meta["ratios"]) == {"ttft_p50_kvtier_over_device_only", "throughput_kvtier_over_device_only"}
    by = {c["config"]: c for c in report["configs"]}
    assert list(by) == list(multiturn.CONFIGS)
    for c in by.values():
        assert set(c) == SUMMARY_FIELDS
        assert c["requests"] == 9 and c["output_tokens"] == 9 * 4
        assert len(c["per_round"]) == 3 and all(set(r) == ROUND_FIELDS for r in c["per_round"])
        assert [r["requests"] for r in c["per_round"]] == [3, 3, 3]
        assert 0 < c["ttft_p50_s"] <= c["ttft_p90_s"] <= c["ttft_p99_s"]
        assert c["input_tokens"] == 3 * (64 + 100 + 136)
        assert c["miss_tokens"] >= 9  # every request computes at least its last prompt token
        # The engine's cache saw the hits the requests report (both counted at admission).
        assert c["cache"]["host_hit_tokens"] >= c["host_hit_tokens"]
        _conversations_grow(c["records"])
    assert by["no-cache"]["device_hit_tokens"] + by["no-cache"]["host_hit_tokens"] == 0
    assert by["device-only"]["host_hit_tokens"] == 0
    kv = by["kvtier"]
    assert kv["device_hit_tokens"] + kv["host_hit_tokens"] > 0 and kv["host_hit_tokens"] > 0
    assert kv["miss_tokens"] < by["device-only"]["miss_tokens"] <= by["no-cache"]["miss_tokens"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"
    assert cli.main(["bench", "multiturn", "--from-json", str(out), "--plot", str(again)]) == 0
    assert capsys.readouterr().out.count("TTFT p50 per round") == 1
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _conversations_grow(records: list[dict]) -> None:
    """Each answer is exactly as long as asked, and each round's prompt is the last one, its answer
    and a new question; the last request ends where the conversation's length says."""
    for client in {r["client"] for r in records}:
        mine = sorted((r for r in records if r["client"] == client), key=lambda r: r["round"])
        assert [r["round"] for r in mine] == [1, 2, 3]
        assert [r["prompt_tokens"] for r in mine] == [64, 64 + 4 + 32, 64 + 2 * (4 + 32)]
        assert all(r["output_tokens"] == 4 and r["finish_reason"] == "length" for r in mine)
        assert mine[-1]["prompt_tokens"] + mine[-1]["output_tokens"] == 140


def test_poisson_rounds_go_at_their_instants_and_never_before_the_previous_round(tiny) -> None:
    w = multiturn.Workload(2, 3, question_tokens=16, output_tokens=3, request_rate=40.0, seed=3)
    setup = multiturn.EngineSetup(device_tokens=256, host_tokens=1024)
    eng = multiturn.build_engine("kvtier", tiny, None, setup)
    try:
        records, duration = multiturn.drive(eng, w, engines.vocab_size(tiny))
    finally:
        eng.close()
    ticks = w.arrivals()
    sent = sorted(r.submitted_s for r in records)
    assert all(s >= t for s, t in zip(sent, ticks, strict=True))
    assert duration >= ticks[-1]
    for client in (0, 1):
        mine = sorted((r for r in records if r.client == client), key=lambda r: r.round)
        for before, after in itertools.pairwise(mine):
            assert after.submitted_s >= before.submitted_s + before.total_s - 1e-3


def test_a_failed_step_stops_the_run_with_its_error(tiny, monkeypatch) -> None:
    """The engine finishes the requests of a failed forward with the error; the bench raises it
    instead of waiting for answers that never come."""
    w = multiturn.Workload(2, 2, question_tokens=16, output_tokens=2)
    eng = multiturn.build_engine(
        "kvtier", tiny, None, multiturn.EngineSetup(device_tokens=128, host_tokens=512)
    )

    def lost(*_args, **_kw):
        raise RuntimeError("device lost")

    monkeypatch.setattr(tiny, "forward", lost)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            multiturn.drive(eng, w, engines.vocab_size(tiny))
    finally:
        eng.close()


def test_each_engine_is_closed_and_collected_before_the_next(tiny, monkeypatch) -> None:
    """Each engine here sits in a reference cycle and the collector is off, as between its automatic
    runs: it is freed before the next is built only if the bench closes it and collects. device-only
    and no-cache get the one-page host pool, kvtier the one asked for."""
    live: weakref.WeakSet = weakref.WeakSet()
    alive_at_build: list[int] = []
    host_tokens: list[int] = []

    class Recording(multiturn.Engine):
        def __init__(self, *args, **kw) -> None:
            alive_at_build.append(len(live))
            super().__init__(*args, **kw)
            live.add(self.host_pool)
            host_tokens.append(self.summary()["host_pool_tokens"])
            self.cycle = self

    monkeypatch.setattr(multiturn, "Engine", Recording)
    w = multiturn.Workload(2, 2, question_tokens=16, output_tokens=2)
    setup = multiturn.EngineSetup(device_tokens=128, host_tokens=512)
    saved: list[list[str]] = []
    gc.collect()
    gc.disable()
    try:
        configs = multiturn.run(
            tiny,
            None,
            multiturn.CONFIGS,
            setup,
            w,
            on_config=lambda done: saved.append([c["config"] for c in done]),
        )
    finally:
        gc.enable()
    assert [c["config"] for c in configs] == list(multiturn.CONFIGS)
    assert saved == [list(multiturn.CONFIGS[:k]) for k in (1, 2, 3)]  # what a run cut short keeps
    assert alive_at_build == [0, 0, 0] and len(live) == 0
    assert host_tokens == [512, 1, 1]


def test_a_conversation_longer_than_the_device_pool_is_refused_before_any_engine(capsys) -> None:
    argv = ["bench", "multiturn", *SMALL, "--device-tokens", "128"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "140 device slots" in err and "128" in err


def test_matplotlib_is_imported_only_to_plot() -> None:
    code = "import sys, kvtier.bench.multiturn, kvtier.cli; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_batching_reports_the_ratio_and_the_rate_per_count(tmp_path: Path, capsys) -> None:
    out = tmp_path / "batching.json"
    argv = ["bench", "batching", "--shape", "tiny", "--device", "cpu", "--concurrent", "3"]
    argv += ["--prompt-tokens", "32", "--output-tokens", "6", "--running", "1,4", "--steps", "3"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "one by one" in shown and "ratio" in shown and "Decode throughput" in shown
    report = json.loads(out.read_text())
    together = report["concurrent"]
    assert together["requests"] == 3 and len(together["concurrent_finish_s"]) == 3
    assert len(together["sequential_finish_s"]) == 3 and len(together["alone_s"]) == 3
    assert together["ratio"] == pytest.approx(together["concurrent_s"] / together["sequential_s"], rel=0.01)
    assert max(together["concurrent_finish_s"]) <= together["concurrent_s"]
    rows = report["decode"]
    assert [r["running"] for r in rows] == [1, 4]
    for r in rows:
        assert r["tokens"] == r["running"] * 3  # every running request made a token at every step
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
    assert report["meta"]["max_num_seqs"] == 4


def test_batching_sizes_are_checked() -> None:
    with pytest.raises(ConfigError, match="at least 1"):
        batching.BatchingBench(running=(0,))
    with pytest.raises(ConfigError, match="unknown part"):
        batching.BatchingBench(parts=("warp",))
    bench = batching.BatchingBench(requests=2, prompt_tokens=10, output_tokens=5, running=(3,), steps=4)
    assert bench.max_num_seqs() == 3


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["multiturn", "--configs", "kvtier,lmcache"], "invalid choice(s) lmcache"),
        (["multiturn", "--request-rate", "0"], "expected a positive number, got '0'"),
        (["multiturn", "--request-rate", "inf"], "expected a positive number, got 'inf'"),
        (["multiturn", "--clients", "0"], "expected a positive integer, got 0"),
        (["multiturn", "--context-tokens", "-1"], "expected a non-negative integer"),
        (["multiturn", "--shape", "llama-70b"], "invalid choice: 'llama-70b'"),
        (
            ["multiturn", "--shape", "tiny", "--model", "smollm2-135m-instruct"],
            "not allowed with argument --shape",
        ),
        (["multiturn", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["batching", "--running", "1,0"], "expected a positive integer, got 0"),
        (["batching", "--parts", "decode,prefill"], "invalid choice(s) prefill"),
        (["batching", "--steps", "0"], "expected a positive integer"),
    ],
)
def test_a_bad_flag_is_refused_by_the_parser(argv: list[str], says: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", *argv])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: argument" in last and says in last


def test_the_flags_default_to_a_closed_loop_over_all_three_configurations() -> None:
    p = cli.build_parser()
    m = p.parse_args(["bench", "multiturn"])
    assert (m.configs, m.request_rate, m.shape, m.model, m.dtype, m.plot, m.from_json) == (
        multiturn.CONFIGS,
        None,
        None,
        None,
        "auto",
        None,
        None,
    )
    b = p.parse_args(["bench", "batching"])
    assert (b.concurrent, b.running, b.parts, b.device_tokens) == (6, (1, 8, 32, 64), batching.PARTS, None)
