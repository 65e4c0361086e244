"""The names `kvtier bench transfer` takes for its host slot sets, device slot sets and variants.

Plain names, no torch: the command line offers them as choices (`kvtier.cli.args`) and
`kvtier.bench.transfer` builds the sets they name.
"""

from __future__ import annotations

import re

# Host slot sets: one run, runs of N slots (`runs-N`, any N >= 1), and the allocators after churn.
HOST_SETS = ("contiguous", "runs-256", "runs-64", "runs-16", "runs-1", "contiguous-churn", "first_fit-churn")
DEVICE_SETS = ("contiguous", "scattered")
# The variants a run may time (`planned`: the planner's choice; `stock`: a stock-style kernel).
VARIANTS = ("planned", "fixed", "kernel", "copy", "stock", "reference")
DEFAULT_VARIANTS = ("planned", "fixed", "kernel", "copy")


def is_runs(name: str) -> bool:
    """Whether `name` is a host slot set of runs of a given length: `runs-N`, N >= 1."""
    return re.fullmatch(r"runs-[1-9][0-9]*", name) is not None
