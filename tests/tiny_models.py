"""Tiny randomly initialised transformers models for the engine, server and served-bench tests."""

from __future__ import annotations

import torch
import transformers


def tiny_llama(vocab_size: int = 256, max_positions: int = 512, **extra) -> transformers.LlamaForCausalLM:
    """A 2-layer Llama-style GQA model (4 heads, 2 KV heads of 16), seeded, in eval mode."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        **extra,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_deepseek_v3(vocab_size: int = 256, max_positions: int = 512) -> transformers.DeepseekV3ForCausalLM:
    """A 2-layer DeepSeek-V3-style MLA model (latent 32 + rope 8), seeded, in eval mode."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).eval()
