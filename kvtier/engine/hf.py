"""transformers integration: a spec from a model config, and a `Cache` backed by kvtier's device pool.

`spec_from_hf_config` maps standard attention (separate K and V rows of
`[kv_heads, head_dim]`) and MLA: transformers hands the cache the compressed latent as
"keys" (`[batch, 1, tokens, kv_lora_rank]`) and the rotary part as "values"
(`[batch, 1, tokens, rope_dim]`); kvtier stores them as one row of `kv_lora_rank + rope_dim`.

`KVTierCache` is what a request's forward passes read and write. Layer i waits for
`wait_layer(i)` of the load the first time it is touched, gathers the prefix rows into a
contiguous per-request buffer that attention reads, and writes each new token's rows to
the request's device slots, so the sequence inserted afterwards holds exactly the bytes
the model computed.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import ConfigError, SlotError, SpecError
from kvtier.pool import DevicePool
from kvtier.spec import BufferKind, KVSpec, mha_spec, mla_spec

try:
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError:  # pragma: no cover - the engine extra is not installed
    Cache = object  # type: ignore[assignment,misc]
    DynamicLayer = object  # type: ignore[assignment,misc]


def text_config(config: Any) -> Any:
    """The decoder's part of a transformers config (the config itself for a text-only model)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_identity(config: Any) -> str:
    """A model's name for storage keys: its config's name or path, else its architecture."""
    name = getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
    if name:
        return str(name).rstrip("/").rsplit("/", 1)[-1] if "/" in str(name) and _is_path(name) else str(name)
    archs = getattr(config, "architectures", None) or [type(config).__name__]
    return str(archs[0])


def _is_path(name: str) -> bool:
    return name.startswith(("/", ".", "~"))


def model_config_identity(config: Any) -> dict[str, Any]:
    """The parts of a transformers config that decide a model's KV (no paths, versions or dtypes)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    drop = {"transformers_version", "torch_dtype", "dtype", "name_or_path"}
    return {k: v for k, v in raw.items() if not k.startswith("_") and k not in drop}


def spec_from_hf_config(config: Any, dtype: torch.dtype | None = None, page_size: int = 1) -> KVSpec:
    """The `KVSpec` of a transformers model config; `SpecError` for a layout kvtier cannot map."""
    text = text_config(config)
    name = getattr(text, "model_type", None) or "model"
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers <= 0:
        raise SpecError(f"config of {name!r} has no num_hidden_layers kvtier can use")
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        kinds = sorted(set(layer_types))
        raise SpecError(f"config of {name!r} has layer types {kinds}; kvtier maps full attention only")
    if dtype is None:
        dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, dtype)
    if not isinstance(dtype, torch.dtype):
        raise SpecError(f"spec of {name!r}: dtype {dtype!r} is not a torch dtype")
    rank = getattr(text, "kv_lora_rank", None)
    if rank:
        rope = getattr(text, "qk_rope_head_dim", None)
        if not rope:
            raise SpecError(f"config of {name!r} has kv_lora_rank but no qk_rope_head_dim")
        return mla_spec(name, layers, rank, rope, dtype, page_size)
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise SpecError(f"config of {name!r} has neither MLA fields nor num_attention_heads")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return mha_spec(name, layers, kv_heads, head_dim, dtype, page_size)


class KVTierLayer(DynamicLayer):
    """One layer of a `KVTierCache`: a contiguous per-request buffer, filled from kvtier on first use."""

    def __init__(self, owner: KVTierCache, layer: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer = layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.device = key_states.device
            self.keys, self.values = self.owner._prefix(self.layer, key_states, value_states)
            self.is_initialized = True
        self.owner._store(self.layer, self.keys.shape[-2], key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return self.owner.prefix_len
        return self.keys.shape[-2]


class KVTierCache(Cache):
    """A transformers `Cache` for one request (batch 1) over kvtier's device pool.

    `prefix_slots`: `[P]` int64, device slots of the cached prefix (resident and
    reloaded); `new_slots`: `[N]` int64, slots held for the tokens this request
    computes (prompt suffix and generated tokens), filled in order. `handle`: the
    load handle whose `wait_layer(i)` must pass before layer i reads the prefix.
    """

    def __init__(
        self,
        spec: KVSpec,
        pool: DevicePool,
        prefix_slots: torch.Tensor,
        new_slots: torch.Tensor,
        handle: Any | None = None,
    ) -> None:
        super().__init__(layers=[KVTierLayer(self, i) for i in range(spec.num_layers)])
        self.spec, self.pool, self.handle = spec, pool, handle
        self.prefix_len = int(prefix_slots.numel())
        self._prefix_index = prefix_slots.to(pool.device)
        self._new_slots = new_slots
        self._new_index = new_slots.to(pool.device)
        self._mla = spec.buffers[0].kind is BufferKind.MLA_LATENT

    @property
    def written(self) -> int:
        """Tokens of this request whose KV is in its device slots (all layers)."""
        return self.layers[-1].get_seq_length() - self.prefix_len if self.layers[-1].is_initialized else 0

    def _prefix(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        if self.handle is not None:
            self.handle.wait_layer(layer)
        idx = self._prefix_index
        if self._mla:
            rows = self.pool.layer("kv", layer)[idx]  # [P, rank + rope]
            rank = key_states.shape[-1]
            k = rows[:, :rank].reshape(1, 1, -1, rank)
            v = rows[:, rank:].reshape(1, 1, -1, rows.shape[1] - rank)
        else:
            k = self.pool.layer("k", layer)[idx].permute(1, 0, 2).unsqueeze(0)  # [1, H, P, D]
            v = self.pool.layer("v", layer)[idx].permute(1, 0, 2).unsqueeze(0)
        return k.to(key_states.dtype).contiguous(), v.to(value_states.dtype).contiguous()

    def _store(self, layer: int, at: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the new tokens' rows (positions `at - P ...` of this request) to their device slots."""
        if key_states.shape[0] != 1:
            raise ConfigError(
                f"KVTierCache serves one sequence at a time (batch 1), got a batch of {key_states.shape[0]}"
            )
        start = at - self.prefix_len
        t = key_states.shape[-2]
        if start + t > self._new_slots.numel():
            raise SlotError(
                f"the request holds {self._new_slots.numel()} device slots for new tokens, "
                f"and needs {start + t}"
            )
        idx = self._new_index[start : start + t]
        if self._mla:
            rows = torch.cat([key_states[0, 0], value_states[0, 0]], dim=-1)  # [t, rank + rope]
            dst = self.pool.layer("kv", layer)
            dst.index_copy_(0, idx, rows.to(dst.dtype))
        else:
            k, v = self.pool.layer("k", layer), self.pool.layer("v", layer)
            k.index_copy_(0, idx, key_states[0].transpose(0, 1).to(k.dtype))
            v.index_copy_(0, idx, value_states[0].transpose(0, 1).to(v.dtype))
