"""The planner's mixed path: one operation's runs split among the mechanisms, buffer by buffer.

Each buffer's runs split by its `Choice` (`Choice.split`), and buffers whose runs split alike
share their parts, buffers that stage the same host runs their staged part (`by_buffer`).

Riders: a buffer of small rows (under `costs.SMALL_ROW_BYTES`, a DSA indexer's 132 bytes beside
an MLA latent's 1152) has its host runs staged by the copy engine wherever the widest buffer's
are, however short its own pieces, when the operation's copy-engine copies (every buffer's
joint-run copies and staged host runs, one layer) still average `PathCosts.copy_min_bytes` of
the bytes the layer moves. A copy costs the host ~0.5-1 us to issue whatever its size
(`bench/probes/probe_copy_issue.py`), so that average keeps the issuing under the layer's time on
the link, while the small pieces themselves cost the copy engine little beside the widest
buffer's: `glm-5` loads after first-fit churn onto scattered slots ran at 0.911-0.924 of the
ceiling on four H200 leases with the indexer riding, against 0.884-0.905 staged by its own 64 KiB,
and runs of 64 rows (8.4 KB indexer pieces, 4096 copies a layer) at 0.559 when it rode regardless
(bench/FINDINGS.md).
Otherwise, or where it has layers the widest buffer lacks (their copies would be its short pieces
alone), a rider keeps its own choice.

A share for the copy engine (`shared`, an overlapped backup's `PathCosts.copy_share`): a buffer of
rows of `SMALL_ROW_BYTES` or more whose split gives everything to the kernel hands that share of its
pieces of `PathCosts.copy_share_min_bytes` or more (host runs: a joint run, copied directly, or
single rows over scattered device slots, staged), evenly spread, to the copy engine, which moves
them beside the kernel on the layer's other stream.

Contract: pure functions of CPU index arrays; every row of every named buffer lands in exactly
one of a split's run sets, as `Choice.split` gives them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from kvtier.transfer.costs import SMALL_ROW_BYTES, Choice
from kvtier.transfer.runs import Scan, host_groups

# `(starts, lengths)` of runs, `[k]` int64 each, or None: a split's runs per mechanism keyword.
Split = dict[str, tuple[np.ndarray, np.ndarray] | None]


class Buffer(Protocol):
    """A buffer as the planner sees it (`plan.Group`)."""

    name: str
    row_bytes: int
    choice: Choice
    layers: frozenset[int]


def copies(split: Split) -> int:
    """Copy-engine copies of one layer of `split`: its joint-run copies and staged host runs."""
    return sum(len(split[k][0]) for k in ("copy", "staged") if split[k] is not None)


def rider(own: Choice, rb: int, wide: Choice, wide_rb: int) -> Choice:
    """`own` (rows of `rb` bytes) staging by the copy engine every host run `wide` (rows of `wide_rb`)
    stages, as well as its own."""
    least = min(own.staged_min_bytes, wide.staged_min_bytes * rb / wide_rb)
    return dataclasses.replace(own, staged_min_bytes=least)


def split_all(
    groups: Iterable[Buffer],
    found: Scan,
    n: int,
    min_average: float,
    share: float = 0.0,
    share_min_bytes: int = 0,
) -> dict[str, Split]:
    """Each buffer's split of `found` (`n` rows), riders riding where the copies still average
    `min_average` bytes and the widest buffer is on all their layers, then `share` of the kernel's
    pieces of `share_min_bytes` or more on the copy engine where `shared` applies (the module docstring)."""
    groups = list(groups)
    splits = _riding(groups, found, n, min_average)
    if share > 0:
        for g in groups:
            if g.row_bytes >= SMALL_ROW_BYTES:
                splits[g.name] = shared(splits[g.name], found, g.row_bytes, share, share_min_bytes)
    return splits


def shared(split: Split, found: Scan, rb: int, share: float, min_bytes: int) -> Split:
    """`split` (rows of `rb` bytes) with `share` of its kernel pieces of `min_bytes` or more, evenly
    spread, on the copy engine, where it gives the copy engine nothing: a piece of one joint run is
    copied, one of several (single rows over scattered device slots) staged."""
    if split["kernel"] is None or any(split[k] is not None for k in ("copy", "staged", "kernel_staged")):
        return split
    s, n = split["kernel"]
    heads, rows, per_run = host_groups(found, s, n)
    i = np.arange(len(heads))
    pick = (np.floor((i + 1) * share) > np.floor(i * share)) & (rows * rb >= min_bytes)
    if not pick.any():
        return split
    copied, staged = pick & (per_run == 1), pick & (per_run > 1)
    keep = ~np.repeat(pick, per_run)
    return {
        "copy": (s[heads][copied], rows[copied]) if copied.any() else None,
        "staged": (s[heads][staged], rows[staged]) if staged.any() else None,
        "kernel_staged": None,
        "kernel": (s[keep], n[keep]) if keep.any() else None,
    }


def _riding(groups: list[Buffer], found: Scan, n: int, min_average: float) -> dict[str, Split]:
    """Each buffer's split of `found`, riders riding where the module docstring says."""
    splits = {g.name: g.choice.split(found, g.row_bytes) for g in groups}
    wide = max(groups, key=lambda g: g.row_bytes)
    small = [
        g
        for g in groups
        if g.row_bytes < SMALL_ROW_BYTES and g.row_bytes < wide.row_bytes and g.layers <= wide.layers
    ]
    if not small:
        return splits
    riding = dict(splits)
    for g in small:
        riding[g.name] = rider(g.choice, g.row_bytes, wide.choice, wide.row_bytes).split(found, g.row_bytes)
    layer_bytes = n * sum(g.row_bytes for g in groups)
    total = sum(copies(s) for s in riding.values())
    return riding if total and layer_bytes / total >= min_average else splits


def by_buffer(splits: dict[str, Split]) -> list[tuple[frozenset[str], Split]]:
    """The buffers of `splits` grouped by identical splits, in order: `(names, split)`. Staged host
    runs are grouped on their own first: buffers that stage the same runs (a rider and the widest
    buffer) share one staged part whatever else they split into, so that its buffers can lie apart
    in the staging buffer (`staging.staging_layout`)."""
    staged = _alike({n: {"staged": s["staged"]} for n, s in splits.items() if s.get("staged") is not None})
    return staged + _alike({n: {**s, "staged": None} for n, s in splits.items()})


def _alike(splits: dict[str, Split]) -> list[tuple[frozenset[str], Split]]:
    """The buffers of `splits` grouped by identical splits, in order (none where a split is empty)."""
    alike: dict[tuple[bytes, ...], tuple[frozenset[str], Split]] = {}
    for name, split in splits.items():
        if all(v is None for v in split.values()):
            continue
        key = tuple(b"" if v is None else v[0].tobytes() + v[1].tobytes() for v in split.values())
        names = alike[key][0] if key in alike else frozenset()
        alike[key] = (names | {name}, split)
    return list(alike.values())
