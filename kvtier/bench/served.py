"""`kvtier bench served`: TTFT of a long prefix that missed, hit on the device, or came back from the host.

The engine runs in-process (no HTTP in the timed path). For each model setup and
prefix length it measures TTFT of a miss (full prefill), a device-resident hit and a
host hit after the prefix was evicted (the reload), with kvtier's planner and with a
stock configuration (`first_fit` host allocator, per-token reference transfers),
after fill/evict cycles that fragment the host pool. Models have random weights of
the right shape: a SmolLM2-135M-shaped Llama (within its context), and a
DeepSeek-V3-shaped model with the real KV (MLA 512 + 64, 61 layers) but tiny
compute, so a reload moves the real bytes.

`reload_overhead_ratio` = (host-hit TTFT - device-hit TTFT) / (KV bytes / ceiling):
1.0 means the reload cost exactly its bytes at the line rate.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvtier.alloc import AllocPolicy
from kvtier.bench.common import ceiling_gbps, environment
from kvtier.cache import CacheConfig
from kvtier.engine import Engine, SamplingParams
from kvtier.transfer import TransferPath

SETUPS = ("smollm2", "deepseek-v3")
CONFIGS = ("kvtier", "stock")
# Tokens past the prefix each request needs: 16 of question, one answer, and margin.
PROMPT_ROOM = 64


@dataclass
class ServedRow:
    setup: str
    config: str
    prefix_tokens: int
    ttft_miss_s: float
    ttft_device_hit_s: float
    ttft_host_hit_s: float
    kv_bytes: int
    ceiling_gbps: float
    reload_overhead_ratio: float
    host_runs_before: int


def make_model(setup: str, device: torch.device):
    """A random-weight model of the setup's shape (float32 on CPU, bf16 on CUDA)."""
    import transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if setup == "smollm2":
        cfg = transformers.LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif setup == "deepseek-v3":
        cfg = transformers.DeepseekV3Config(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_hidden_layers=61,
            num_attention_heads=1,
            num_key_value_heads=1,
            n_routed_experts=2,
            num_experts_per_tok=1,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=61,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            max_position_embeddings=163840,
        )
        model = transformers.DeepseekV3ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown setup {setup!r}; known: {SETUPS}")
    return model.to(device=device, dtype=dtype).eval()


def run(
    setups: tuple[str, ...],
    prefixes: tuple[int, ...],
    device: torch.device,
    cycles: int = 4,
    repeats: int = 3,
    progress: Callable[[str], None] = lambda _m: None,
) -> tuple[list[ServedRow], dict]:
    rows = []
    for setup in setups:
        progress(f"building the {setup}-shaped model")
        model = make_model(setup, device)
        for n in fit_prefixes(prefixes, int(model.config.max_position_embeddings), progress, setup):
            for config in CONFIGS:
                progress(f"{setup}, {config}, prefix of {n} tokens")
                rows.append(_measure(model, setup, config, n, device, cycles, repeats))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del model
    meta = {
        **environment(device),
        "cycles": cycles,
        "repeats": repeats,
        "stock": "first_fit host allocator, per-token reference transfers",
    }
    return rows, meta


def fit_prefixes(
    prefixes: tuple[int, ...], context: int, progress: Callable[[str], None], setup: str
) -> list[int]:
    """The prefixes a model of `context` tokens can take, each with room for its prompt and answer.

    A prefix longer than that is cut to the longest that fits (a multiple of 64, once),
    so a model with an 8192-token context is measured at 8128 tokens instead of skipped.
    """
    room = (context - PROMPT_ROOM) // 64 * 64
    out: list[int] = []
    for n in prefixes:
        if n > room:
            progress(f"{setup}: {n} tokens do not fit its context of {context}; using {room}")
            n = room
        if n > 0 and n not in out:
            out.append(n)
    return out


def _measure(model, setup: str, config: str, n: int, device, cycles: int, repeats: int) -> ServedRow:
    stock = config == "stock"
    cache_config = CacheConfig(
        host_alloc_policy=AllocPolicy.FIRST_FIT if stock else AllocPolicy.CONTIGUOUS,
        force_path=TransferPath.REFERENCE if stock else None,
    )
    eng = Engine(model, device_tokens=n + 256, host_tokens=4 * n + 1024, config=cache_config)
    _fragment(eng, n, cycles)
    host_runs = eng.cache.host_alloc.free_runs()
    rng = random.Random(n)
    vocab = int(model.config.vocab_size)
    params = SamplingParams(max_tokens=1)
    miss, dev_hit, host_hit = [], [], []
    for r in range(repeats):
        prompt = [rng.randrange(vocab) for _ in range(n + 16)]
        miss.append(eng.generate(prompt, params).ttft_s)
        eng.cache.flush()  # the miss's write-through backup must not run beside the device hit
        dev_hit.append(eng.generate(prompt, params).ttft_s)
        eng.cache.flush()
        eng.cache.evict_device(10**9)
        host_hit.append(eng.generate(prompt, params).ttft_s)
        eng.cache.flush()
        eng.cache.evict_device(10**9)
        eng.cache.evict_host(10**9)
        _fragment(eng, n, 1, seed=r)
    kv_bytes = n * eng.spec.bytes_per_token()
    ceiling = ceiling_gbps(device, min(kv_bytes, 1 << 30))
    t_host, t_dev = statistics.median(host_hit), statistics.median(dev_hit)
    ideal = kv_bytes / (ceiling * 1e9)
    return ServedRow(
        setup=setup,
        config=config,
        prefix_tokens=n,
        ttft_miss_s=round(statistics.median(miss), 5),
        ttft_device_hit_s=round(t_dev, 5),
        ttft_host_hit_s=round(t_host, 5),
        kv_bytes=kv_bytes,
        ceiling_gbps=round(ceiling, 2),
        reload_overhead_ratio=round((t_host - t_dev) / ideal, 3),
        host_runs_before=host_runs,
    )


def _fragment(eng: Engine, n: int, cycles: int, seed: int = 0) -> None:
    """Fill/evict cycles of random sequences, so the host pool's free space is scattered."""
    rng = random.Random(seed + 1000)
    cache = eng.cache
    for _ in range(cycles):
        inserted = []
        while True:
            length = rng.randint(1, max(2, n // 8))
            if cache.host_alloc.available() < length or cache.device_alloc.available() < length:
                break
            tokens = tuple(rng.randrange(1 << 30) for _ in range(length))
            cache.insert(tokens, cache.alloc_device(length))
            inserted.append(tokens)
            cache.flush()
            cache.evict_device(length)
        # Touch a random half, then evict the least recently used half of the host.
        for tokens in rng.sample(inserted, len(inserted) // 2):
            cache.match(tokens)
        cache.flush()
        cache.evict_host((cache.host_pool.num_slots - cache.host_alloc.available()) // 2)
    cache.flush()
    cache.evict_device(10**9)


def rows_as_dicts(rows: list[ServedRow]) -> list[dict]:
    return [asdict(r) for r in rows]
