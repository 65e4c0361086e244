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
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import SpecError
from kvtier.spec import KVSpec, mha_spec, mla_spec


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
    layers = len(layer_windows(config))  # refuses layer types kvtier cannot serve
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


_FULL, _SLIDING = "full_attention", "sliding_attention"


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window in tokens (None: full attention), as transformers applies them.

    A query at position p sees the keys at positions in `(p - window, p]`. `SpecError` for
    layer types other than full and sliding attention, a sliding layer without a positive
    `sliding_window`, or bidirectional attention.
    """
    text = text_config(config)
    name = getattr(text, "model_type", None) or "model"
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers <= 0:
        raise SpecError(f"config of {name!r} has no num_hidden_layers kvtier can use")
    if getattr(text, "use_bidirectional_attention", False):
        raise SpecError(f"config of {name!r} uses bidirectional attention; kvtier serves causal models only")
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:  # transformers slides every layer of such a model (Mistral) by its config's window
        types = [_SLIDING if window is not None else _FULL] * layers
    types = list(types)
    if len(types) != layers or any(t not in (_FULL, _SLIDING) for t in types):
        raise SpecError(
            f"config of {name!r} has layer types {sorted(set(types))} over {len(types)} of {layers} layers; "
            f"kvtier maps {_FULL!r} and {_SLIDING!r} only"
        )
    if _SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise SpecError(f"config of {name!r} has sliding layers but sliding_window {window!r}")
    if _SLIDING in types and getattr(text, "attn_logit_softcapping", None) and _transformers() < (5, 24):
        raise SpecError(
            f"config of {name!r} soft-caps its sliding attention (Gemma 2): kvtier matches generate's "
            f"tokens there with transformers >= 5.24 only (this is {_transformers_version()}; with 5.17 "
            "the logits differed by ~1%); upgrade transformers"
        )
    return tuple(window if t == _SLIDING else None for t in types)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _transformers() -> tuple[int, ...]:
    from packaging.version import Version  # (a dependency of transformers)

    return Version(_transformers_version()).release
