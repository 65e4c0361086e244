"""`kvtier bench cache`'s parts at tiny sizes: the trace, the allocator and the prefix reload."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.bench.allocator import run_allocator
from kvtier.bench.reload import run_prefix_reload
from kvtier.bench.trace import OPS, TraceConfig, make_trace, run_trace
from kvtier.cache import WritePolicy
from kvtier.spec import preset


def tiny_trace(page_size: int = 1, **kw) -> TraceConfig:
    """A working set of several thousand tokens against a 2048-slot device pool."""
    base = dict(
        spec=preset("tiny-mla", page_size),
        device=torch.device("cpu"),
        device_slots=2048,
        host_slots=16384,
        conversations=8,
        turns=3,
        active=4,
        system_tokens=(64, 128),
        documents=2,
        document_tokens=(512, 1024),
        user_tokens=(16, 64),
        answer_tokens=(16, 64),
        flush_every=3,
    )
    base.update(kw)
    return TraceConfig(**base)


def test_trace_turns_extend_the_previous_turn() -> None:
    cfg = tiny_trace(page_size=4)
    trace = make_trace(cfg)
    assert len(trace) == cfg.conversations * cfg.turns
    last: dict[int, tuple[int, tuple[int, ...]]] = {}
    for r in trace:
        assert len(r.prompt) % 4 == 0 and len(r.answer) % 4 == 0
        if r.conversation in last:
            turn, history = last[r.conversation]
            assert r.turn == turn + 1
            assert r.prompt[: len(history)] == history
        else:
            assert r.turn == 0
        last[r.conversation] = (r.turn, r.prompt + r.answer)


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_trace_under_pressure(policy: WritePolicy) -> None:
    result = run_trace(tiny_trace(), policy)
    row = result.row
    assert row.requests == 24
    assert math.isclose(row.device_hit + row.host_hit + row.miss, 1.0, abs_tol=1e-9)
    assert row.device_hit > 0 and row.miss > 0
    assert row.device_evictions > 0 and row.device_evicted_tokens > 0
    assert row.bytes_d2h > 0
    if policy is not WritePolicy.WRITE_THROUGH_SELECTIVE:
        assert (
            row.host_hit > 0
            and row.loads > 0
            and row.bytes_h2d == row.loaded_tokens * preset("tiny-mla").bytes_per_token()
        )
    if policy is WritePolicy.WRITE_THROUGH:
        assert row.backups >= row.requests  # every request inserts at least its answer
    assert all(s.calls == row.requests for s in row.ops if s.op != "load_back")
    assert row.ops[OPS.index("load_back")].calls == row.loads
    assert set(row.fragmentation) >= {"host_free_runs", "device_free_runs"}
    result.cache.check_invariants()


def test_trace_with_pages() -> None:
    result = run_trace(tiny_trace(page_size=4), WritePolicy.WRITE_BACK)
    assert result.row.host_hit > 0
    result.cache.check_invariants()


def test_trace_refuses_a_pool_smaller_than_one_request() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        run_trace(tiny_trace(device_slots=256), WritePolicy.WRITE_THROUGH)


def test_allocator_rows() -> None:
    rows = run_allocator(
        pool_slots=65536, page_size=16, churn_ops=400, pairs=20, sizes=(64, 1024, 4096), prefix=4096
    )
    assert [(r.policy, r.n) for r in rows] == [
        (p, n) for p in ("contiguous", "first_fit") for n in (64, 1024, 4096)
    ]
    for r in rows:
        assert r.pairs == 20 and r.median_us > 0 and r.p99_us >= r.median_us
        assert 0.85 < r.occupancy < 0.95
        assert r.free_runs > 0 and r.prefix_runs is not None and r.prefix_runs >= 1
    # Best fit keeps large free runs whole, so a long allocation after the same churn comes in
    # fewer runs than from first fit's FIFO (here 2 against 15).
    contiguous, first_fit = rows[0].prefix_runs, rows[-1].prefix_runs
    assert contiguous is not None and first_fit is not None and contiguous < first_fit


@pytest.mark.parametrize("policy", [WritePolicy.WRITE_THROUGH, WritePolicy.WRITE_BACK])
@pytest.mark.parametrize("host_runs", [1, 8])
def test_prefix_reload_on_cpu(policy: WritePolicy, host_runs: int) -> None:
    spec = preset("tiny-mla", 4)
    row = run_prefix_reload(spec, tokens=4096, device="cpu", repeats=2, policy=policy, host_runs=host_runs)
    # It ran: the bench checks that the prefix's host copy lies in `host_runs` runs before timing.
    assert row.loaded_bytes == 4096 * spec.bytes_per_token()
    assert len(row.samples) == 2 and row.cpu_us > 0 and row.wall_us >= row.match_us > 0
    assert row.reload_ms is None and row.ratio is None and row.ceiling_gbps is None


def test_prefix_reload_from_a_page_first_pool() -> None:
    """The reload bench takes the host layout."""
    spec = preset("tiny-dsa", 1)
    row = run_prefix_reload(
        spec, tokens=2048, device="cpu", repeats=1, host_runs=64, host_layout="page_first"
    )
    assert row.loaded_bytes == 2048 * spec.bytes_per_token()


def test_prefix_reload_refuses_a_bad_layout() -> None:
    with pytest.raises(ValueError, match="page_last"):
        run_prefix_reload(preset("tiny-mla", 1), tokens=64, device="cpu", repeats=1, host_layout="page_last")


@pytest.mark.parametrize(("tokens", "host_runs"), [(4096, 0), (4096, 3), (4098, 1)])
def test_prefix_reload_refuses_a_shape_it_cannot_lay_out(tokens: int, host_runs: int) -> None:
    """Runs that do not split the prefix into whole pages are refused before any pool is made."""
    with pytest.raises(ValueError, match="multiple of the page size"):
        run_prefix_reload(preset("tiny-mla", 4), tokens=tokens, device="cpu", repeats=1, host_runs=host_runs)
