"""Tiny randomly initialised transformers models for the engine, server and served-bench tests."""

from __future__ import annotations

import torch
import transformers


def tiny_llama(
    vocab_size: int = 256, max_positions: int = 512, kv_heads: int = 2, **extra
) -> transformers.LlamaForCausalLM:
    """A 2-layer Llama-style GQA model (4 heads, `kv_heads` KV heads of 16), seeded, in eval mode."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        **extra,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_deepseek_v3(
    vocab_size: int = 256, max_positions: int = 512, layers: int = 2, **extra
) -> transformers.DeepseekV3ForCausalLM:
    """A 2-layer DeepSeek-V3-style MLA model (latent 32 + rope 8), seeded, in eval mode."""
    cfg = transformers.DeepseekV3Config(
        **{
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "max_position_embeddings": max_positions,
            **extra,
        }
    )
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).eval()


# The DSA indexer fields of a DeepSeek-V3.2 / GLM-5 config (transformers' names).
DSA = dict(index_head_dim=128, index_n_heads=4, index_topk=16)


def tiny_dsa(
    vocab_size: int = 256, max_positions: int = 512, dense: bool = False
) -> transformers.DeepseekV3ForCausalLM:
    """`tiny_deepseek_v3` on 3 layers whose config declares a DSA indexer (its forward computes none);
    `dense`: no MoE layer (a forward CUDA graphs can capture)."""
    return tiny_deepseek_v3(
        vocab_size, max_positions, layers=3, **DSA, **({"first_k_dense_replace": 3} if dense else {})
    )


def _gemma_shape(vocab_size: int, max_positions: int, window: int) -> dict:
    """A 4-layer Gemma shape: sliding, full, sliding, full.

    Untied, with a larger init than Gemma's, so that greedy tokens vary and the window
    changes them.
    """
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=32,  # a scale other than head_dim ** -0.5
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=max_positions,
        initializer_range=0.05,
        tie_word_embeddings=False,
    )


def tiny_gemma2(
    vocab_size: int = 256, max_positions: int = 512, window: int = 8, softcap: float | None = 0.5
) -> transformers.Gemma2ForCausalLM:
    """A Gemma 2-style model: sliding and full layers alternate, attention logits capped; seeded, eval."""
    cfg = transformers.Gemma2Config(
        **_gemma_shape(vocab_size, max_positions, window), attn_logit_softcapping=softcap
    )
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(cfg).eval()


def tiny_gemma3(
    vocab_size: int = 256, max_positions: int = 512, window: int = 8
) -> transformers.Gemma3ForCausalLM:
    """A text-only Gemma 3-style model: sliding and full layers, q/k norms, local rope; seeded, eval."""
    cfg = transformers.Gemma3TextConfig(**_gemma_shape(vocab_size, max_positions, window))
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(cfg).eval()


def tiny_mistral(
    vocab_size: int = 256, max_positions: int = 512, window: int = 8
) -> transformers.MistralForCausalLM:
    """A 2-layer Mistral-style model: no `layer_types`, every layer slides by `window`; seeded, eval."""
    cfg = transformers.MistralConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=window,
        max_position_embeddings=max_positions,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(cfg).eval()
