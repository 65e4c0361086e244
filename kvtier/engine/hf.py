"""transformers integration: a `KVSpec` from a model config, and a model's identity for storage keys.

`spec_from_hf_config` maps standard attention (separate K and V rows of
`[kv_heads, head_dim]`) and MLA: transformers hands the cache the compressed latent as
"keys" (`[batch, 1, tokens, kv_lora_rank]`) and the rotary part as "values"
(`[batch, 1, tokens, rope_dim]`); kvtier stores them as one row of `kv_lora_rank + rope_dim`.

Sliding-window layers (Gemma 2 / 3, whose `layer_types` mix "sliding_attention" and
"full_attention"; Mistral-style configs with a `sliding_window` and no `layer_types`,
where every layer slides) keep the same K/V rows as full layers, for every token: the
spec does not tell them apart, and `layer_windows` says which layers slide and how far
(the engine applies the window in the attention mask, `kvtier.engine.batch`).

DSA (DeepSeek-V3.2, GLM-5): a config that declares a DSA indexer (`index_head_dim`,
`index_n_heads`, `index_topk`, as transformers' `deepseek_v32` and `glm_moe_dsa` configs
name them) maps to MLA plus the indexer row (`kvtier.spec.INDEXER_ROW_BYTES`: the 128-value
fp8 index key and its fp32 scale) on each layer that runs an indexer: every layer, or the
`"full"` ones of `indexer_types` (GLM-MoE-DSA's `"shared"` layers reuse an earlier layer's
top-k and keep no index keys). transformers' own DSA classes (layer type
`"indexed_attention"`) write their index keys through `Cache.update_indexer`, which
kvtier's step does not serve: `spec_from_hf_config` maps their configs, `layer_windows`
(and so the engine) refuses them.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import ConfigError, SpecError
from kvtier.spec import INDEXER_ROW_BYTES, KVSpec, mha_spec, mla_spec


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


def spec_from_hf_config(
    config: Any, dtype: torch.dtype | None = None, page_size: int = 1, tp: int = 1
) -> KVSpec:
    """The `KVSpec` of a transformers model config; `SpecError` for a layout kvtier cannot map.

    `tp`: the tensor-parallel ranks, and the spec is one rank's: standard attention's K/V
    heads split over them (`ConfigError` where the query or K/V heads do not divide by
    `tp`: `check_tp`), MLA's latent whole on every rank.
    """
    text = text_config(config)
    name = getattr(text, "model_type", None) or "model"
    indexer = dsa_indexer_layers(config)
    # Refuses layer types kvtier cannot serve; a DSA config's own "indexed_attention" layers
    # keep full-attention KV (the engine refuses them, `layer_windows`).
    types = layer_windows(config) if indexer is None else _layer_types(text, name, (_INDEXED,))
    layers = len(types)
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
        return mla_spec(name, layers, rank, rope, dtype, page_size, indexer_layers=indexer)
    if indexer is not None:
        raise SpecError(f"config of {name!r} declares a DSA indexer but no MLA (kv_lora_rank)")
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise SpecError(f"config of {name!r} has neither MLA fields nor num_attention_heads")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    check_tp(config, tp)
    return mha_spec(name, layers, kv_heads // tp, head_dim, dtype, page_size)


def check_tp(config: Any, tp: int) -> None:
    """`ConfigError` unless `tp` ranks can split the config's attention by heads.

    MLA (a `kv_lora_rank`) keeps its latent whole on every rank and takes any `tp`;
    standard attention needs the query heads and the K/V heads to divide by `tp`.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor-parallel ranks must be a positive int, got {tp!r}")
    text = text_config(config)
    if tp == 1 or getattr(text, "kv_lora_rank", None):
        return
    heads = getattr(text, "num_attention_heads", None) or 0
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        name = getattr(text, "model_type", None) or "model"
        raise ConfigError(
            f"{tp} tensor-parallel ranks cannot split {name!r}'s {heads} query and {kv_heads} K/V heads "
            f"evenly; choose a number of ranks that divides {kv_heads}"
        )


_FULL, _SLIDING, _INDEXED = "full_attention", "sliding_attention", "indexed_attention"
# The config fields of a DSA indexer (transformers' `deepseek_v32` and `glm_moe_dsa` configs).
DSA_FIELDS = ("index_head_dim", "index_n_heads", "index_topk")


def dsa_indexer_layers(config: Any) -> tuple[int, ...] | None:
    """The layers that keep a DSA index key per token, or None for a config without a DSA indexer.

    Every layer, or those whose `indexer_types` entry is `"full"`. `SpecError` for a partial
    set of `DSA_FIELDS`, an `index_head_dim` other than the 128 of kvtier's indexer row, or
    `indexer_types` of the wrong length or with other values.
    """
    text = text_config(config)
    name = getattr(text, "model_type", None) or "model"
    fields = {f: getattr(text, f, None) for f in DSA_FIELDS}
    if all(v is None for v in fields.values()):
        return None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in fields.values()):
        raise SpecError(f"config of {name!r}: the DSA indexer needs positive {DSA_FIELDS}, got {fields}")
    key_bytes = INDEXER_ROW_BYTES - 4  # one fp8 byte per value, then the fp32 scale
    if fields["index_head_dim"] != key_bytes:
        raise SpecError(
            f"config of {name!r}: index_head_dim {fields['index_head_dim']}; kvtier's indexer row holds "
            f"{key_bytes} fp8 values and their fp32 scale"
        )
    layers = _num_layers(text, name)
    types = getattr(text, "indexer_types", None)
    if types is None:
        return tuple(range(layers))
    types = list(types)
    if len(types) != layers or any(t not in ("full", "shared") for t in types):
        raise SpecError(
            f"config of {name!r}: indexer_types {sorted(set(types))} over {len(types)} of {layers} layers; "
            "kvtier maps 'full' and 'shared' only"
        )
    full = tuple(i for i, t in enumerate(types) if t == "full")
    if not full:
        raise SpecError(f"config of {name!r}: indexer_types has no 'full' layer")
    return full


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window in tokens (None: full attention), as transformers applies them.

    A query at position p sees the keys at positions in `(p - window, p]`. `SpecError` for
    layer types other than full and sliding attention (among them transformers' own DSA
    layers, see the module docstring), a sliding layer without a positive
    `sliding_window`, or bidirectional attention.
    """
    text = text_config(config)
    name = getattr(text, "model_type", None) or "model"
    types = _layer_types(text, name, ())
    window = getattr(text, "sliding_window", None)
    if _SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise SpecError(f"config of {name!r} has sliding layers but sliding_window {window!r}")
    if _SLIDING in types and getattr(text, "attn_logit_softcapping", None) and _transformers() < (5, 24):
        raise SpecError(
            f"config of {name!r} soft-caps its sliding attention (Gemma 2): kvtier matches generate's "
            f"tokens there with transformers >= 5.24 only (this is {transformers_version()}; with 5.17 "
            "the logits differed by ~1%); upgrade transformers"
        )
    return tuple(window if t == _SLIDING else None for t in types)


def _num_layers(text: Any, name: str) -> int:
    layers = getattr(text, "num_hidden_layers", None)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers <= 0:
        raise SpecError(f"config of {name!r} has no num_hidden_layers kvtier can use")
    return layers


def _layer_types(text: Any, name: str, also: tuple[str, ...]) -> list[str]:
    """Each layer's attention type: full, sliding, or one of `also`; `SpecError` for any other."""
    layers = _num_layers(text, name)
    if getattr(text, "use_bidirectional_attention", False):
        raise SpecError(f"config of {name!r} uses bidirectional attention; kvtier serves causal models only")
    types = getattr(text, "layer_types", None)
    if types is None:  # transformers slides every layer of such a model (Mistral) by its config's window
        types = [_SLIDING if getattr(text, "sliding_window", None) is not None else _FULL] * layers
    types = list(types)
    known = (_FULL, _SLIDING, *also)
    if len(types) != layers or any(t not in known for t in types):
        why = (
            f"; {_INDEXED!r} layers write their index keys through Cache.update_indexer, "
            "which kvtier's step does not serve"
            if _INDEXED in types and _INDEXED not in also
            else ""
        )
        raise SpecError(
            f"config of {name!r} has layer types {sorted(set(types))} over {len(types)} of {layers} layers; "
            f"kvtier maps {_FULL!r} and {_SLIDING!r} only{why}"
        )
    return types


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _transformers() -> tuple[int, ...]:
    from packaging.version import Version  # (a dependency of transformers)

    return Version(transformers_version()).release
