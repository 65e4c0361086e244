"""Host memory is released deterministically: ten engines built and closed in one process.

The engines are kept referenced after `close()` (as a benchmark keeps its results, or a
caller a stale handle), so the garbage collector cannot be what frees their pools:
`close()` must. The pools are large enough (128 MiB each) that ten of them alive would
stand out from everything else the process allocates.
"""

from __future__ import annotations

import gc
import os

import pytest

pytest.importorskip("transformers")

from tiny_models import tiny_llama

from kvtier.engine import Engine, SamplingParams

# The tiny Llama keeps 512 B of KV per token (2 layers, K and V of 2 heads x 16 fp32).
HOST_TOKENS = 1 << 18
POOL_BYTES = HOST_TOKENS * 512
CYCLES = 10


def rss_bytes() -> int:
    """Resident memory of this process now."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_ten_engines_built_and_closed_return_their_host_memory() -> None:
    model = tiny_llama()
    kept: list[Engine] = []

    def build(close: bool) -> Engine:
        eng = Engine(model, device_tokens=256, host_tokens=HOST_TOKENS)
        assert eng.host_pool.footprint_bytes == POOL_BYTES
        eng.generate(list(range(40)), SamplingParams(max_tokens=4))  # a backup writes host rows
        if close:
            eng.close()
        kept.append(eng)
        return eng

    build(close=True)  # the first cycle warms up everything that is not a pool
    first = rss_bytes()
    for _ in range(CYCLES - 1):
        build(close=True)
    after = rss_bytes()
    # The measure sees a pool: one engine left open holds its pool in RSS.
    open_engine = build(close=False)
    held = rss_bytes()
    open_engine.close()
    released = rss_bytes()
    mib = 1 << 20
    print(
        f"\nRSS after 1 cycle {first / mib:.0f} MiB, after {CYCLES} {after / mib:.0f} MiB "
        f"(+{(after - first) / mib:.1f}); one open engine +{(held - after) / mib:.0f} MiB, "
        f"closed again +{(released - after) / mib:.1f} MiB; pool {POOL_BYTES / mib:.0f} MiB"
    )
    assert held - after > 0.8 * POOL_BYTES
    assert after - first < POOL_BYTES / 2, "closed engines still hold host memory"
    assert released - after < POOL_BYTES / 4
    assert all(e.closed and e.host_pool.closed for e in kept)
