"""`kvtier bench served`: TTFT of a long prefix that missed, hit on the device, or came back from the host.

The engine runs in-process (no HTTP in the timed path). For each model setup and
prefix length it measures TTFT of a miss (full prefill), a device-resident hit and a
host hit after the prefix was evicted (the reload), with kvtier's planner and with a
stock configuration (`first_fit` host allocator, per-token reference transfers),
after fill/evict cycles that fragment the host pool. Models have random weights of
the right shape: a SmolLM2-135M-shaped Llama (within its context), a
DeepSeek-V3-shaped model with the real KV (MLA 512 + 64, 61 layers) but tiny
compute, so a reload moves the real bytes, and a GLM-5-shaped one (`glm-5`): the same
tiny MLA model on 78 layers whose config declares a DSA indexer, so every layer also
keeps the 132-byte indexer row per token (the engine writes stand-in rows,
`kvtier.engine.indexer`) and a host hit reloads GLM-5's bytes per token. `layers`
cuts every setup to that many layers (for smoke tests; the KV bytes shrink with it).

`reload_overhead_ratio` = (host-hit TTFT - device-hit TTFT) / (KV bytes / ceiling):
1.0 means the reload cost exactly its bytes at the line rate; `kv_bytes` counts every
buffer of the spec (the indexer's too); `meta.specs` gives each setup's buffers. The
table's `vs stock` is stock's host-hit TTFT over kvtier's at the same setup and prefix.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from rich.console import Group
from rich.table import Table

from kvtier.alloc import AllocPolicy
from kvtier.bench.churn import CacheChurn
from kvtier.bench.common import ceiling_gbps, close, collect, environment
from kvtier.cache import CacheConfig
from kvtier.engine import Engine, SamplingParams, spec_from_hf_config
from kvtier.errors import ConfigError
from kvtier.transfer import TransferPath

SETUPS = ("smollm2", "deepseek-v3", "glm-5")
CONFIGS = ("kvtier", "stock")
# Tokens past the prefix each request needs: 16 of question, one answer, and margin.
PROMPT_ROOM = 64
# The churn's seed before the first repeat; repeat r re-churns with CHURN_SEED + r.
CHURN_SEED = 1000
# Layers of each setup's model at full size.
LAYERS = {"smollm2": 30, "deepseek-v3": 61, "glm-5": 78}


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


def make_model(setup: str, device: torch.device, layers: int | None = None):
    """A random-weight model of the setup's shape (float32 on CPU, bf16 on CUDA), on `layers` layers."""
    import transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config(setup, layers)
    kind = transformers.LlamaForCausalLM if setup == "smollm2" else transformers.DeepseekV3ForCausalLM
    return kind(cfg).to(device=device, dtype=dtype).eval()


def model_config(setup: str, layers: int | None = None):
    """The transformers config of the setup's shape (see the module docstring), on `layers` layers
    (default: the setup's own, `LAYERS`)."""
    import transformers

    if setup not in SETUPS:
        raise ConfigError(f"unknown setup {setup!r}; known: {SETUPS}")
    n = LAYERS[setup] if layers is None else layers
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"setup {setup!r}: layers must be a positive int, got {layers!r}")
    if setup == "smollm2":
        return transformers.LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=n,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        )
    # GLM-5's DSA indexer (its config's fields); its context is longer than DeepSeek-V3's.
    dsa = dict(index_head_dim=128, index_n_heads=32, index_topk=2048) if setup == "glm-5" else {}
    return transformers.DeepseekV3Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=n,
        num_attention_heads=1,
        num_key_value_heads=1,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=n,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=202752 if setup == "glm-5" else 163840,
        **dsa,
    )


def spec_summary(setup: str, device: torch.device, layers: int | None = None) -> dict:
    """What a token of the setup keeps: layers, each buffer's row bytes and layer count, bytes in all."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = spec_from_hf_config(model_config(setup, layers), dtype=dtype)
    return {
        "layers": spec.num_layers,
        "buffers": {b.name: {"row_bytes": b.row_bytes, "layers": len(b.layers)} for b in spec.buffers},
        "bytes_per_token": spec.bytes_per_token(),
    }


def run(
    setups: tuple[str, ...],
    prefixes: tuple[int, ...],
    device: torch.device,
    cycles: int = 4,
    repeats: int = 3,
    progress: Callable[[str], None] = lambda _m: None,
    layers: int | None = None,
) -> tuple[list[ServedRow], dict]:
    """Rows for each setup, prefix and configuration, measured one configuration at a time.

    `layers`: every setup's model on that many layers (default: each setup's own).
    """
    rows = []
    for setup in setups:
        progress(f"building the {setup}-shaped model")
        model = make_model(setup, device, layers)
        rows += measure_setup(model, setup, prefixes, device, cycles, repeats, progress)
        del model
        collect()
    meta = {
        **environment(device),
        "cycles": cycles,
        "repeats": repeats,
        "stock": "first_fit host allocator, per-token reference transfers",
        "layers": layers,
        "specs": {setup: spec_summary(setup, device, layers) for setup in setups},
    }
    return rows, meta


def measure_setup(
    model,
    setup: str,
    prefixes: tuple[int, ...],
    device: torch.device,
    cycles: int,
    repeats: int,
    progress: Callable[[str], None],
) -> list[ServedRow]:
    """Each configuration at each prefix that fits `model`, one engine at a time.

    Each engine is closed and collected before the next is built: the pinned host
    pools of two configurations of a long prefix do not fit the host at once.
    """
    rows = []
    for n in fit_prefixes(prefixes, int(model.config.max_position_embeddings), progress, setup):
        for config in CONFIGS:
            progress(f"{setup}, {config}, prefix of {n} tokens")
            rows.append(_measure(model, setup, config, n, device, cycles, repeats))
            collect()  # the engine _measure closed is unreachable now
    return rows


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
    try:
        miss, dev_hit, host_hit, host_runs = _ttfts(eng, model, n, cycles, repeats)
        kv_bytes = n * eng.spec.bytes_per_token()
    finally:
        close(eng)
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


def _ttfts(eng: Engine, model, n: int, cycles: int, repeats: int):
    """`(miss, device hit, host hit)` TTFTs of `repeats` prompts of `n + 16` tokens, and the host's
    free runs after the first churn; the host pool is churned again after each repeat."""
    max_pages = max(2, n // 8 // eng.spec.page_size)
    CacheChurn(eng.cache, CHURN_SEED).cycles(cycles, max_pages)
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
        CacheChurn(eng.cache, CHURN_SEED + r).cycles(1, max_pages)
    return miss, dev_hit, host_hit, host_runs


def rows_as_dicts(rows: list[ServedRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def render(rows: list[ServedRow], meta: dict) -> Group:
    """The served table: TTFT of a miss, a device hit and a host hit per setup, configuration and prefix."""
    table = Table(title=f"TTFT, seconds (median of {meta['repeats']}), on {meta.get('gpu', meta['device'])}")
    cols = ("setup", "config", "prefix", "miss", "device hit", "host hit", "KV MB", "ceiling GB/s")
    for col in (*cols, "reload ratio", "vs stock"):
        table.add_column(col, justify="left" if col in ("setup", "config") else "right")
    stock = {(r.setup, r.prefix_tokens): r for r in rows if r.config == "stock"}
    for r in rows:
        other = stock.get((r.setup, r.prefix_tokens)) if r.config != "stock" else None
        table.add_row(
            r.setup,
            r.config,
            str(r.prefix_tokens),
            f"{r.ttft_miss_s:.4f}",
            f"{r.ttft_device_hit_s:.4f}",
            f"{r.ttft_host_hit_s:.4f}",
            f"{r.kv_bytes / 1e6:.1f}",
            f"{r.ceiling_gbps:.1f}",
            f"{r.reload_overhead_ratio:.2f}",
            f"{other.ttft_host_hit_s / r.ttft_host_hit_s:.1f}x" if other is not None else "",
        )
    note = (
        "reload ratio: (host hit - device hit) / (KV bytes / ceiling); vs stock: stock's host hit over "
        "kvtier's; stock: first_fit + per-token path"
    )
    return Group(table, note)
