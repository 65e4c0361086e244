"""Whether the copy engine beside the kernel lifts rows the kernel moves alone: a share of the widest
rows' kernel runs (rows of 256 B or more) given to the copy engine, the rest as planned, overlapped.

The kernel moves host runs of 16 rows (18 KB of 1152-byte rows) at its ~0.92 plateau; the copy engine
alone moves thousands of such pieces at 0.60-0.78 (bench/FINDINGS.md). Side by side on two streams,
the link is shared: if each engine's pace is its own limit (the kernel's request latency, the copy
engine's cost per piece) and not the link's, the two together may pass either alone. Per share `f`
(`SHARES`), every `1/f`-th joint run of the kernel goes to the copy engine directly (device slots
contiguous: joint runs of 16 rows) or every `1/f`-th host run through staging by the copy engine
(device slots scattered), evenly spread over the layer. Per spec, direction and device set: the
plan's rows by mechanism, GB/s over the same run's ceiling, each byte-checked first (destinations
poisoned).

One JSON line per row appended to OUT. Usage:
python3 bench/probes/probe_copy_share.py OUT [SPEC ...] (default glm-5 deepseek-v3)
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import torch
from probe_common import emit, one_layer, timed

from kvtier.bench.transfer import setup
from kvtier.pool.device import Direction
from kvtier.transfer import Planner, calibrate, costs

SHARES = (0.0, 0.15, 0.3, 0.45)
SETS = ("runs-16",)
share = 0.0
_split = costs.Choice.split


def _every(count: int, f: float) -> np.ndarray:
    """`[count]` bool: a share `f` of positions, evenly spread."""
    i = np.arange(count)
    return np.floor((i + 1) * f) > np.floor(i * f)


def _merge(a, b):
    """Two `(starts, lengths)` run sets (either None) as one, by start."""
    parts = [x for x in (a, b) if x is not None]
    if not parts:
        return None
    s, n = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    order = np.argsort(s, kind="stable")
    return s[order], n[order]


def shared_split(self, found, rb):
    """`Choice.split`, with a share of the kernel's joint runs (or host runs) on the copy engine."""
    out = _split(self, found, rb)
    if share == 0 or rb < costs.SMALL_ROW_BYTES or out["kernel"] is None:
        return out
    s, n = out["kernel"]
    if (n > 1).any():  # joint runs of several rows: device slots contiguous, copy them directly
        pick = _every(len(s), share) & (n > 1)
        out["copy"] = _merge(out["copy"], (s[pick], n[pick]))
        out["kernel"] = (s[~pick], n[~pick]) if (~pick).any() else None
        return out
    # Single rows: their host runs (consecutive positions, no host break) staged by the copy engine.
    cont = np.zeros(len(s), dtype=bool)
    cont[1:] = (s[1:] == s[:-1] + n[:-1]) & ~found.host_break[s[1:] // found.step]
    heads = np.flatnonzero(~cont)
    rows = np.add.reduceat(n, heads)
    pick_run = _every(len(heads), share) & (rows > 1)
    per_run = np.diff(np.append(heads, len(s)))
    pick = np.repeat(pick_run, per_run)
    out["staged"] = _merge(out["staged"], (s[heads][pick_run], rows[pick_run]))
    out["kernel"] = (s[~pick], n[~pick]) if (~pick).any() else None
    return out


costs.Choice.split = shared_split


def main() -> None:
    global share
    out = open(sys.argv[1], "a")  # noqa: SIM115
    for name in sys.argv[2:] or ["glm-5", "deepseek-v3"]:
        cfg = one_layer(name, SETS, ("contiguous", "scattered"))
        s = setup(cfg, lambda _m: None)
        model = calibrate.model_for(s.dev.device, [b.row_bytes for b in cfg.spec.buffers])
        for direction, host_label, dev_label, share in itertools.product(
            Direction, SETS, cfg.device_sets, SHARES
        ):
            planner = Planner(s.host, s.dev, model=model)
            plan = planner.plan(direction, s.host_sets[host_label], s.dev_sets[dev_label])
            ratio, ok = timed(s, plan, direction)
            row = {"spec": name, "direction": direction.value, "host_runs": host_label, "device": dev_label}
            row |= {"share": share, "mechanisms": plan.mechanisms_by_buffer(), "sms": plan.sms_used}
            row |= {"ceiling_ratio": ratio, "identical": ok}
            emit(out, row)
        del s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
