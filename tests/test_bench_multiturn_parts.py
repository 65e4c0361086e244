"""The multi-turn benchmark's parts without a model: arrival rules, configuration orders, ITL from token
times, the warm/cold split, the spread over repeats and the agreement of two reports."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from kvtier.bench.multiturn import CONFIGS, Order, config_orders
from kvtier.bench.multiturn_plan import ClosedLoop, Plan, PoissonArrivals, ScheduledArrivals, Turn, Workload
from kvtier.bench.multiturn_report import by_order, machine_line
from kvtier.bench.multiturn_stats import (
    RequestRecord,
    aggregate,
    agreement,
    latency,
    summarize,
    token_gaps,
)
from kvtier.errors import ConfigError


@dataclass
class Ready:
    ready_s: float = 0.0
    next_arrival_s: float | None = None


def test_closed_loop_sends_every_ready_conversation_from_when_it_was_ready() -> None:
    ready = [Ready(0.5), Ready(0.2)]
    assert ClosedLoop().due(ready, 9.0) == [(0, 0.5), (1, 0.2)]
    assert ClosedLoop().wake_at(ready) is None


def test_poisson_instants_go_to_the_conversations_ready_longest_and_are_never_skipped() -> None:
    rule = PoissonArrivals(np.array([1.0, 2.0, 3.0]))
    assert rule.due([Ready(), Ready()], 0.5) == [] and rule.wake_at([Ready()]) == 1.0
    assert rule.due([Ready(), Ready()], 2.5) == [(0, 1.0), (1, 2.0)]
    assert rule.due([], 9.0) == []  # an instant with nobody ready waits for the next that is
    assert rule.due([Ready()], 9.0) == [(0, 3.0)]
    assert rule.wake_at([Ready()]) is None and rule.due([Ready()], 99.0) == []


def test_scheduled_turns_go_at_their_own_times() -> None:
    ready = [Ready(0.0, 2.0), Ready(0.0, 1.0), Ready(0.0, 5.0)]
    rule = ScheduledArrivals()
    assert rule.due(ready, 0.5) == [] and rule.wake_at(ready) == 1.0
    assert rule.due(ready, 2.0) == [(0, 2.0), (1, 1.0)]
    assert rule.wake_at([]) is None


def test_a_plan_is_checked_and_its_tokens_come_from_the_seed() -> None:
    w = Workload(clients=2, rounds=3, context_tokens=5, question_tokens=4, output_tokens=2, seed=7)
    plan = w.plan()
    assert plan.conversations == ((Turn(9, 2), Turn(4, 2), Turn(4, 2)),) * 2
    assert plan.longest_tokens == 9 + 4 + 4 + 3 * 2 and plan.working_set_tokens == 2 * 23
    qs = plan.tokens(100)
    assert qs == w.plan().tokens(100) and qs != Workload(2, 3, 5, 4, 2, seed=8).plan().tokens(100)
    assert [[len(q) for q in conv] for conv in qs] == [[9, 4, 4], [9, 4, 4]] and qs[0][0] != qs[1][0]
    assert isinstance(plan.arrivals(), ClosedLoop)
    rated = Workload(2, 3, 5, 4, 2, request_rate=50.0, seed=7).plan()
    assert rated.tokens(100) == qs  # a rate changes no conversation
    ticks = rated.arrivals().ticks
    assert len(ticks) == 6 and (ticks[1:] > ticks[:-1]).all() and ticks[0] > 0
    with pytest.raises(ConfigError, match="either every turn"):
        Plan(((Turn(3, 1, 0.0), Turn(3, 1)),))
    with pytest.raises(ConfigError, match="a trace has its own times"):
        Plan(((Turn(3, 1, 0.0),),), request_rate=2.0)
    with pytest.raises(ConfigError, match="at least one conversation"):
        Plan(((),))
    with pytest.raises(ConfigError, match="request_rate"):
        Workload(2, 3, request_rate=0.0)


def test_each_repeat_runs_every_configuration_once_in_its_order() -> None:
    assert config_orders(CONFIGS, 2, Order.FIXED) == [CONFIGS, CONFIGS]
    assert config_orders(CONFIGS, 3, Order.ALTERNATE) == [CONFIGS, CONFIGS[::-1], CONFIGS]
    rotated = config_orders(CONFIGS, 3, Order.ROTATE)
    assert [o[0] for o in rotated] == list(CONFIGS)  # each first once
    assert rotated[1] == ("device-only", "no-cache", "kvtier")
    shuffled = config_orders(CONFIGS, 8, Order.SHUFFLE, seed=1)
    assert shuffled == config_orders(CONFIGS, 8, Order.SHUFFLE, seed=1)
    assert all(sorted(o) == sorted(CONFIGS) for o in shuffled) and len(set(shuffled)) > 1
    with pytest.raises(ConfigError, match="distinct"):
        config_orders(("kvtier", "kvtier"), 1, Order.FIXED)


def record(round_: int, ttft: float, times: list[float] = (), client: int = 0, **kw) -> RequestRecord:
    return RequestRecord(
        client=client,
        round=round_,
        arrived_s=0.0,
        submitted_s=0.0,
        prompt_tokens=kw.get("prompt", 10),
        output_tokens=max(1, len(times)),
        ttft_s=ttft,
        total_s=ttft + (times[-1] - times[0] if times else 0.0),
        device_hit_tokens=kw.get("device", 0),
        host_hit_tokens=kw.get("host", 0),
        storage_hit_tokens=0,
        preemptions=0,
        finish_reason="length",
        token_gaps_s=token_gaps(list(times)),
    )


def test_itl_is_the_gaps_between_a_requests_tokens_pooled_over_requests() -> None:
    assert token_gaps([10.0, 10.5, 10.75, 11.75]) == (0.5, 0.25, 1.0)
    assert token_gaps([3.0]) == () and token_gaps([]) == ()
    a, b = record(1, 0.1, [0.0, 0.5, 0.75, 1.75]), record(2, 0.2, [5.0, 5.125])
    got = latency([a, b])
    assert got["requests"] == 2
    assert got["itl_p50_s"] == pytest.approx(np.percentile([0.5, 0.25, 1.0, 0.125], 50))
    assert got["itl_p99_s"] == pytest.approx(np.percentile([0.5, 0.25, 1.0, 0.125], 99))
    one_token = latency([record(1, 0.3, [7.0])])
    assert one_token["itl_p50_s"] is None and one_token["ttft_p50_s"] == 0.3
    assert latency([])["ttft_p90_s"] is None


def test_warm_turns_are_every_round_after_a_conversations_first() -> None:
    recs = [record(1, 4.0, client=c) for c in range(3)] + [record(k, 1.0 + k, client=0) for k in (2, 3)]
    recs += [record(2, 0.5, client=1, host=6)]
    s = summarize("kvtier", recs, 2.0, 0, {}, {"longest_step_s": 0.5})
    assert s["cold"]["requests"] == 3 and s["cold"]["ttft_p50_s"] == 4.0
    assert s["warm"]["requests"] == 3 and s["warm"]["ttft_p50_s"] == 3.0  # 0.5, 3, 4: cold 4s left out
    assert s["ttft_p50_s"] == 4.0
    assert [r["requests"] for r in s["per_round"]] == [3, 2, 1]
    assert s["per_round"][1]["host_hit_tokens"] == 6 and s["requests_per_s"] == 3.0


def summary(config: str, rps: float, warm: float) -> dict:
    return {"config": config, "requests_per_s": rps, "warm": {"ttft_p50_s": warm}, "machine": {}}


def test_the_spread_is_over_repeats_and_ratios_are_paired_within_each_repeat() -> None:
    runs = [
        {"configs": [summary("kvtier", 1.0, 1.0), summary("device-only", 2.0, 2.0)]},
        {"configs": [summary("device-only", 4.0, 4.0), summary("kvtier", 4.0, 4.0)]},
        {"configs": [summary("kvtier", 3.0, 0.3), summary("device-only", 3.0, 1.0)]},
    ]
    agg = aggregate(runs)
    assert agg["spread"]["kvtier"]["requests_per_s"] == {"min": 1.0, "median": 3.0, "max": 4.0, "n": 3}
    assert agg["spread"]["device-only"]["warm_ttft_p50_s"]["median"] == 2.0
    assert agg["spread"]["kvtier"]["itl_p50_s"] is None  # no repeat had it
    warm = agg["ratios"]["warm_ttft_p50_kvtier_over_device_only"]
    assert warm["values"] == [0.5, 1.0, 0.3] and warm["median"] == 0.5  # not 1.0 / 2.0 of the medians
    assert "cold_ttft_p50_kvtier_over_device_only" not in agg["ratios"]
    assert aggregate([{"configs": [summary("no-cache", 1.0, 1.0)]}])["ratios"] == {}


def test_two_reports_agree_where_their_ranges_overlap() -> None:
    def agg(rps: tuple[float, ...], warm: float, dev_warm: float = 2.0) -> dict:
        return aggregate(
            [{"configs": [summary("kvtier", x, warm), summary("device-only", 1.0, dev_warm)]} for x in rps]
        )

    a, b, c = agg((1.0, 2.0), 1.0), agg((1.5, 3.0), 1.0), agg((2.5, 3.0), 9.0)
    by = {(r["config"], r["figure"]): r["overlap"] for r in agreement([a, b])}
    assert by[("kvtier", "requests_per_s")] and by[("kvtier", "warm_ttft_p50_s")]
    assert by[("kvtier / device-only", "warm_ttft_p50_s")]
    by = {(r["config"], r["figure"]): r["overlap"] for r in agreement([a, c])}
    assert not by[("kvtier", "requests_per_s")] and not by[("kvtier", "warm_ttft_p50_s")]
    assert not by[("kvtier / device-only", "warm_ttft_p50_s")]  # 0.5 against 4.5
    assert by[("device-only", "requests_per_s")]
    assert ("kvtier", "itl_p50_s") not in by  # no report had it
    once = agg((1.0,), 1.0)
    assert {r["overlap"] for r in agreement([a, once])} == {None}  # a single repeat is no range


def test_a_report_splits_into_one_report_per_order_its_repeats_ran() -> None:
    fwd, rev = ["kvtier", "device-only"], ["device-only", "kvtier"]
    runs = [
        {"repeat": r + 1, "order": order, "configs": [summary(c, 1.0 + r, 1.0) for c in order]}
        for r, order in enumerate([fwd, rev, fwd, rev])
    ]
    report = {"meta": {}, "tables": [{"label": "t", "runs": runs, **aggregate(runs)}]}
    a, b = by_order(report)
    assert [r["repeat"] for r in a["tables"][0]["runs"]] == [1, 3]
    assert [r["repeat"] for r in b["tables"][0]["runs"]] == [2, 4]
    kv_a, kv_b = (r["tables"][0]["spread"]["kvtier"]["requests_per_s"] for r in (a, b))
    assert kv_a == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 2} and kv_b["median"] == 3.0
    (once,) = by_order({"meta": {}, "tables": [{"label": "t", "runs": runs[:1]}]})
    assert once["tables"][0]["runs"] == runs[:1]


def test_the_cpu_share_is_the_cpu_seconds_over_what_the_threads_had_in_the_wall_time() -> None:
    run = {"config": "kvtier", "duration_s": 4.0, "machine": {"cpu_s": 2.0, "threads": 2}}
    agg = aggregate([{"configs": [run]}])["spread"]["kvtier"]
    assert agg["cpu_share"]["median"] == 0.25 and agg["cpu_s"]["median"] == 2.0
    on_a_gpu = {**run, "machine": {"cpu_s": 2.0, "threads": None}}  # the GPU computes: no share
    assert aggregate([{"configs": [on_a_gpu]}])["spread"]["kvtier"]["cpu_share"] is None


def test_runs_that_waited_for_the_cpu_are_counted_in_the_header() -> None:
    busy = {"config": "kvtier", "duration_s": 4.0, "machine": {"cpu_s": 1.0, "threads": 1}}
    busy["machine"] |= {"load_before": 5.0, "load_after": 6.5}
    quiet = {**busy, "machine": {**busy["machine"], "cpu_s": 3.9}}
    report = {"meta": {"threads": 1, "cores": 2}, "tables": [{"runs": [{"configs": [busy, quiet]}]}]}
    line = machine_line(report)
    assert "1 torch thread(s) on 2 cores; load average 5.0-6.5" in line
    assert "1 of 2 runs got under 80% of their threads' CPU time" in line
    assert "got under" not in machine_line({**report, "tables": [{"runs": [{"configs": [quiet]}]}]})
