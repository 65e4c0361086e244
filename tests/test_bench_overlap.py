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


def test_reloads_and_matmuls_are_issued_together_in_proportion() -> None:
    """Neither stream's work is queued all first: after each step both have issued their share."""
    log: list[tuple[str, int]] = []
    overlap.interleave(103, 31, lambda: log.append(("r", 0)), lambda i: log.append(("m", i)), chunks=10)
    assert [i for kind, i in log if kind == "m"] == list(range(103))  # every matmul, in order
    assert sum(kind == "r" for kind, _ in log) == 31
    mm = rl = 0
    for kind, _ in log:  # at any point, neither has run more than a step ahead of the other
        mm, rl = mm + (kind == "m"), rl + (kind == "r")
        assert abs(mm / 103 - rl / 31) <= 0.1 + 1 / 31
    assert log[0][0] == "r"  # a step's reloads first: the copies start with the matmuls
