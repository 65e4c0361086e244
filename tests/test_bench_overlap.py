"""`kvtier bench overlap`'s warm-up, on the CPU (the bench itself needs CUDA)."""

from __future__ import annotations

from kvtier.bench import overlap


def test_the_overlap_bench_measures_only_once_the_matmul_rate_alone_has_settled() -> None:
    """Warm rounds alone: at least WARM_S, then until three match the three before, at most SETTLE_S."""

    def rounds(seconds):
        it = iter(seconds)
        return lambda: next(it)

    steady = overlap.settle(rounds([2.0] * 200))
    assert len(steady) == overlap.WARM_S / 2.0  # settled from the start: the minimum time
    warming = [2.0 + 0.02 * min(i, 25) for i in range(200)]  # 1% slower per round for 25 rounds
    got = overlap.settle(rounds(warming))
    assert 25 < len(got) <= 31 and got[-1] == warming[len(got) - 1]
    drifting = [1.02**i for i in range(200)]  # never settles: stops after SETTLE_S seconds
    got = overlap.settle(rounds(drifting))
    assert sum(got) >= overlap.SETTLE_S > sum(got[:-1])
