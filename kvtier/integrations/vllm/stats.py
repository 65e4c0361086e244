"""The connector's counters as vLLM carries them: `KVTierStats` from each worker to the logger
process (its periodic "KV Transfer metrics" line), and `KVTierPromMetrics` on vLLM's `/metrics`
as `vllm:kvtier_<name>_total` counters, and kvtier's log lines in vLLM's log. Imports vLLM.

A worker reports what changed since its last report (`delta`), so every counter adds up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# name -> what it counts (the Prometheus help text)
COUNTERS = {
    "host_hit_blocks": "vLLM blocks kvtier loaded from its host pool",
    "storage_hit_blocks": "vLLM blocks kvtier loaded from storage",
    "load_failed_blocks": "vLLM blocks whose storage page was absent or refused (recomputed)",
    "saved_blocks": "vLLM blocks copied into kvtier's host pool",
    "stored_blocks": "blocks written to storage",
    "store_failed_blocks": "blocks whose storage write failed or was dropped",
    "loaded_bytes": "bytes kvtier moved into vLLM's KV blocks",
    "saved_bytes": "bytes kvtier copied out of vLLM's KV blocks",
    "load_seconds": "seconds the worker spent loading blocks",
    "save_seconds": "seconds the worker spent saving blocks",
}


def log_through_vllm() -> None:
    """kvtier's log lines (INFO and up: hits, refusals, failures) in vLLM's log, with its handlers,
    unless the application configured the `kvtier` logger itself."""
    ours = logging.getLogger("kvtier")
    if not ours.handlers:
        ours.handlers = list(logging.getLogger("vllm").handlers)
        ours.setLevel(logging.INFO)
        ours.propagate = not ours.handlers


def delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """The counters that moved since `before` (a snapshot of `now` taken at the last report)."""
    return {k: now[k] - before.get(k, 0) for k in COUNTERS if now.get(k, 0) != before.get(k, 0)}


@dataclass
class KVTierStats(KVConnectorStats):
    """Counter increments since the last report; aggregated by adding them up."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVTierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per `COUNTERS` entry, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._bound: dict[tuple[int, str], Any] = {}
        for name, help_text in COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=help_text, labelnames=labelnames
            )
            for engine, values in per_engine_labelvalues.items():
                self._bound[(engine, name)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            bound = self._bound.get((engine_idx, name))
            if bound is not None and value > 0:
                bound.inc(value)
