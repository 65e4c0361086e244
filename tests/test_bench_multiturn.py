"""`kvtier bench multiturn` and `kvtier bench batching` on the tiny shape: each configuration, JSON, plot."""

from __future__ import annotations

import gc
import itertools
import json
import re
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from kvtier import cli
from kvtier.bench import batching, engines, multiturn, multiturn_report
from kvtier.bench.multiturn_plan import Workload
from kvtier.cli import args as cli_args
from kvtier.cli.bench_args import MULTITURN_ORDERS
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
    "itl_p50_s",
    "itl_p90_s",
    "itl_p99_s",
    "latency_p50_s",
    "warm",
    "cold",
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "miss_tokens",
    "preemptions",
    "per_round",
    "cache",
    "machine",
    "records",
}
LATENCY_FIELDS = {"requests", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s", "itl_p99_s"}
ROUND_FIELDS = LATENCY_FIELDS | {
    "round",
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "miss_tokens",
}


@pytest.fixture(scope="module")
def tiny():
    return engines.build_shape("tiny", CPU, torch.float32)


def test_the_cli_choices_match_what_they_name() -> None:
    assert cli_args.MULTITURN_CONFIGS == multiturn.CONFIGS
    assert tuple(o.value for o in multiturn.Order) == MULTITURN_ORDERS
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


def test_three_configurations_two_lengths_two_repeats_through_the_cli(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "multiturn.json", tmp_path / "multiturn.png"
    argv = ["bench", "multiturn", *SMALL, "--output-tokens", "1,4", "--repeats", "2", "--threads", "1"]
    assert cli.main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    shown = capsys.readouterr().out
    assert "kvtier / device-only, warm turns: TTFT p50" in shown and "round 1 TTFT p50 s (cold)" in shown
    assert "output 1: 3 conversations, 9 requests; working set 393 tokens" in shown
    assert "output 4: 3 conversations, 9 requests; working set 420 tokens" in shown
    report = json.loads(out.read_text())
    meta = report["meta"]
    assert (meta["repeats"], meta["order"], meta["threads"], meta["workload"]["output_tokens"]) == (
        2,
        "rotate",
        1,
        [1, 4],
    )
    assert meta["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # 2 layers of K and V, 2 KV heads of 16 floats
    assert [t["label"] for t in report["tables"]] == ["output 1", "output 4"]
    for table, n in zip(report["tables"], (1, 4), strict=True):
        assert table["working_set_tokens"] == 3 * (64 + 2 * 32 + 3 * n)
        runs = table["runs"]
        assert [r["order"] for r in runs] == [list(multiturn.CONFIGS), [*multiturn.CONFIGS[1:], "kvtier"]]
        assert set(table["ratios"]) == {
            "warm_ttft_p50_kvtier_over_device_only",
            "cold_ttft_p50_kvtier_over_device_only",
            "throughput_kvtier_over_device_only",
            "output_tokens_per_s_kvtier_over_device_only",
            "cpu_s_kvtier_over_device_only",
        }
        assert all(len(r["values"]) == 2 for r in table["ratios"].values())
        for config in multiturn.CONFIGS:
            spread = table["spread"][config]
            assert spread["requests_per_s"]["n"] == 2 and spread["warm_ttft_p50_s"]["n"] == 2
            assert (spread["itl_p50_s"] is None) == (n == 1)
        for run in runs:
            by = {c["config"]: c for c in run["configs"]}
            for c in by.values():
                _one_run(c, n)
            assert by["no-cache"]["device_hit_tokens"] + by["no-cache"]["host_hit_tokens"] == 0
            assert by["device-only"]["host_hit_tokens"] == 0
            kv = by["kvtier"]
            assert kv["host_hit_tokens"] > 0
            assert kv["miss_tokens"] < by["device-only"]["miss_tokens"] <= by["no-cache"]["miss_tokens"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"
    assert cli.main(["bench", "multiturn", "--from-json", str(out), "--plot", str(again)]) == 0
    assert capsys.readouterr().out.count("round 1 TTFT p50 s (cold)") == 2
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = tmp_path / "both.json"
    assert cli.main(["bench", "multiturn", "--from-json", str(out), str(out), "--json", str(both)]) == 0
    shown = capsys.readouterr().out
    agree = re.findall(r"(\d+) of (\d+) figures with a range overlap across the reports", shown)
    assert len(agree) == 2 and all(a == b and int(a) > 30 for a, b in agree)  # a report agrees with itself
    assert json.loads(both.read_text())["reports"] == [report, report]


def test_alternating_orders_are_compared_order_against_order(tmp_path: Path, capsys) -> None:
    out = tmp_path / "alt.json"
    argv = ["bench", "multiturn", *SMALL, "--output-tokens", "1", "--repeats", "4", "--order", "alternate"]
    assert cli.main([*argv, "--configs", "kvtier,device-only", "--json", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "each order's median (min-max); orders kvtier,device-only | device-only,kvtier" in shown
    assert "figures with a range overlap across the orders" in shown
    (table,) = json.loads(out.read_text())["tables"]
    assert [r["order"] for r in table["runs"]] == [["kvtier", "device-only"], ["device-only", "kvtier"]] * 2
    assert table["spread"]["kvtier"]["requests_per_s"]["n"] == 4


def _one_run(c: dict, n: int) -> None:
    """A configuration's run: every request, warm and cold apart, answers as long as asked, ITL gaps
    one fewer than the tokens, conversations that grow by the answer and a question each round."""
    assert set(c) == SUMMARY_FIELDS
    assert c["requests"] == 9 and c["output_tokens"] == 9 * n
    assert set(c["warm"]) == LATENCY_FIELDS and (c["warm"]["requests"], c["cold"]["requests"]) == (6, 3)
    assert len(c["per_round"]) == 3 and all(set(r) == ROUND_FIELDS for r in c["per_round"])
    assert 0 < c["warm"]["ttft_p50_s"] <= c["warm"]["ttft_p90_s"] <= c["warm"]["ttft_p99_s"]
    assert c["input_tokens"] == 3 * (64 + (64 + n + 32) + (64 + 2 * (n + 32)))
    assert c["miss_tokens"] >= 9  # every request computes at least its last prompt token
    assert c["cache"]["host_hit_tokens"] >= c["host_hit_tokens"]  # the cache saw what the requests report
    assert set(c["machine"]) == {"cpu_s", "threads", "load_before", "load_after", "longest_step_s", "steps"}
    steps = c["machine"]["steps"]
    walls = [s["wall_s"] for s in steps["longest"]]
    assert steps["count"] >= 3 and len(walls) == min(8, steps["count"])
    assert walls == sorted(walls, reverse=True)
    assert c["machine"]["longest_step_s"] == walls[0] and sum(walls) <= steps["total_s"] + 1e-3
    assert all(0 <= s["at_s"] <= c["duration_s"] and s["running"] >= 0 for s in steps["longest"])
    for client in range(3):
        mine = sorted((r for r in c["records"] if r["client"] == client), key=lambda r: r["round"])
        assert [r["round"] for r in mine] == [1, 2, 3]
        assert [r["prompt_tokens"] for r in mine] == [64, 64 + n + 32, 64 + 2 * (n + 32)]
        assert all(r["output_tokens"] == n and len(r["token_gaps_s"]) == n - 1 for r in mine)
        assert all(r["finish_reason"] == "length" and r["ttft_s"] > 0 for r in mine)


def test_a_report_of_the_older_shape_is_shown_from_its_records(capsys) -> None:
    old = ROOT / "bench" / "results" / "multiturn_cpu_2026-12-01.json"
    assert cli.main(["bench", "multiturn", "--from-json", str(old)]) == 0
    shown = capsys.readouterr().out
    assert "output 16: 8 conversations, 32 requests" in shown and "warm TTFT p50 s" in shown
    (report,) = multiturn_report.load(json.loads(old.read_text()))
    (table,) = report["tables"]
    kv = table["runs"][0]["configs"][0]
    assert (kv["config"], kv["warm"]["requests"], kv["cold"]["requests"], kv["itl_p50_s"]) == (
        "kvtier",
        24,
        8,
        None,
    )


def test_poisson_rounds_go_at_their_instants_and_never_before_the_previous_round(tiny) -> None:
    plan = Workload(2, 3, question_tokens=16, output_tokens=3, request_rate=40.0, seed=3).plan()
    setup = multiturn.EngineSetup(device_tokens=256, host_tokens=1024)
    eng = multiturn.build_engine("kvtier", tiny, None, setup)
    try:
        records, duration, _ = multiturn.drive(eng, plan, engines.vocab_size(tiny))
    finally:
        eng.close()
    ticks = plan.arrivals().ticks
    arrived = sorted(r.arrived_s for r in records)
    assert all(a >= t - 1e-6 for a, t in zip(arrived, ticks, strict=True))
    assert all(r.submitted_s >= r.arrived_s for r in records)
    assert duration >= ticks[-1]
    for client in (0, 1):
        mine = sorted((r for r in records if r.client == client), key=lambda r: r.round)
        for before, after in itertools.pairwise(mine):
            assert after.arrived_s >= before.arrived_s + before.total_s - 1e-6


def test_a_failed_step_stops_the_run_with_its_error(tiny, monkeypatch) -> None:
    """The engine finishes the requests of a failed forward with the error; the bench raises it
    instead of waiting for answers that never come."""
    plan = Workload(2, 2, question_tokens=16, output_tokens=2).plan()
    eng = multiturn.build_engine(
        "kvtier", tiny, None, multiturn.EngineSetup(device_tokens=128, host_tokens=512)
    )

    def lost(*_args, **_kw):
        raise RuntimeError("device lost")

    monkeypatch.setattr(tiny, "forward", lost)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            multiturn.drive(eng, plan, engines.vocab_size(tiny))
    finally:
        eng.close()


@pytest.mark.parametrize("warm_run", [True, False])
def test_each_engine_is_closed_and_collected_before_the_next(tiny, monkeypatch, warm_run) -> None:
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
    plan = Workload(2, 2, question_tokens=16, output_tokens=2).plan()
    setup = multiturn.EngineSetup(device_tokens=128, host_tokens=512)
    saved: list[list[str]] = []
    gc.collect()
    gc.disable()
    try:
        (table,) = multiturn.run(
            tiny,
            None,
            multiturn.CONFIGS,
            setup,
            [{"label": "t"}],
            [plan],
            on_run=lambda tables: saved.append([c["config"] for c in tables[0]["runs"][-1]["configs"]]),
            warm_run=warm_run,
        )
    finally:
        gc.enable()
    assert [c["config"] for c in table["runs"][0]["configs"]] == list(multiturn.CONFIGS)
    assert saved == [list(multiturn.CONFIGS[:k]) for k in (1, 2, 3)]  # what a run cut short keeps
    first = [512] if warm_run else []  # the untimed kvtier run's engine first
    assert alive_at_build == [0] * (len(first) + 3) and len(live) == 0
    assert host_tokens == [*first, 512, 1, 1] and ("warm_run_s" in table) == warm_run


def test_the_warm_up_leaves_an_empty_cache_in_every_configuration(tiny) -> None:
    """The timed run starts with no page of the warm-up in either tier: a warm-up prompt again
    matches nothing."""
    plan = Workload(3, 2, question_tokens=16, output_tokens=2).plan()
    vocab = engines.vocab_size(tiny)
    for config in multiturn.CONFIGS:
        eng = multiturn.build_engine(
            config, tiny, None, multiturn.EngineSetup(device_tokens=256, host_tokens=1024)
        )
        try:
            multiturn.warm_up(eng, plan, vocab, seed=0)
            assert eng.cache.device.available() == eng.device_pool.num_slots
            assert eng.cache.host.available() == eng.host_pool.num_slots
            prompt = np.random.default_rng(2).integers(0, vocab, multiturn.WARMUP_TOKENS).tolist()
            result = engines.run_alone(eng, prompt, multiturn.WARMUP)
            assert result.device_hit_tokens + result.host_hit_tokens == 0
        finally:
            eng.close()


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


def test_a_step_log_keeps_the_longest_steps_with_what_they_did() -> None:
    from kvtier.bench.multiturn_stats import StepLog

    log, asked = StepLog(keep=3), []
    for i, wall in enumerate([0.05, 0.2, 0.01, 0.15, 0.3, 0.02]):
        log.add(i * 1.0, wall, lambda i=i: asked.append(i) or {"step": i})
    assert [s["step"] for s in log.longest] == [4, 1, 3] and log.longest_s == 0.3
    assert asked == [0, 1, 2, 3, 4]  # described only while among the longest so far
    assert log.summary()["count"] == 6 and log.summary()["over_100ms"] == 3
    assert log.summary()["total_s"] == pytest.approx(0.73)
    assert StepLog().longest_s == 0.0


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


def test_every_timed_decode_step_runs_every_request_when_the_prefill_takes_many_steps(tmp_path: Path) -> None:
    # 8 prompts of 40 tokens through 48-token steps: the first requests decode for several steps
    # while the rest prefill, and must still be running through every timed step
    out = tmp_path / "batching.json"
    argv = ["bench", "batching", "--shape", "tiny", "--device", "cpu", "--parts", "decode", "--running", "8"]
    argv += ["--decode-prompt-tokens", "40", "--max-num-batched-tokens", "48", "--steps", "5"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["decode"]
    assert row["running"] == 8 and row["tokens"] == 8 * 5


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
        (["multiturn", "--output-tokens", "1,0"], "expected a positive integer, got 0"),
        (["multiturn", "--repeats", "0"], "expected a positive integer, got 0"),
        (["multiturn", "--order", "sideways"], "invalid choice: 'sideways'"),
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
    assert (m.configs, m.output_tokens, m.repeats, m.order, m.trace, m.threads) == (
        multiturn.CONFIGS,
        None,
        1,
        "rotate",
        None,
        None,
    )
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
