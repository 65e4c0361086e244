"""kvtier inside vLLM: `KVTierConnector`, a KV connector loaded with

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
      "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both"}'

`config` (the options), `scheduler` (the page index and each step's plan), `blocks` (the worker's
host pool and storage moves), `rows` (the row kernel's block moves), `fetches` (loads outside the
steps): none of them imports vLLM; `connector` (the vLLM interface) and
`stats` (its counters) do, imported when `KVTierConnector` is first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.integrations.vllm.connector import KVTierConnector, KVTierMetadata

__all__ = ["KVTierConnector", "KVTierMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtier.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
