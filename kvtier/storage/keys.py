"""Page keys: what names a page of KV in storage, shared by every process that computes the same bytes.

A page's hash is BLAKE2b-256 of its parent page's hash and its own token ids (as int64
little-endian, whatever dtype the caller holds them in), chained from a root seeded by
the `Fingerprint`; so a hash names a whole prefix, never one page's tokens alone, and two
processes agree on it (no `hash()`, no per-process seed). The key of a page is
`"<fingerprint hex>.<page hash hex>"`.

`Fingerprint` is what makes bytes interchangeable: the model's identity (a name and a hash
of its config), the `KVSpec` (buffers with their kinds, row shapes, dtypes and layers; the
layer count and page size) and, where the KV differs by tensor-parallel rank (standard
attention heads split over ranks), the rank and world size. MLA latent and indexer keys
are the same on every rank, so their fingerprint omits the rank.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import ConfigError
from kvtier.spec import BufferKind, KVSpec

HASH_BYTES = 32
FINGERPRINT_BYTES = 16
_RANKED_KINDS = (BufferKind.K, BufferKind.V)


@dataclass(frozen=True)
class Fingerprint:
    """`digest`: 16 bytes naming a model, a spec and (for K/V split over ranks) a rank."""

    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != FINGERPRINT_BYTES:
            raise ConfigError(f"a fingerprint is {FINGERPRINT_BYTES} bytes, got {self.digest!r}")

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def of(
        cls,
        model: str,
        spec: KVSpec,
        config: Mapping[str, Any] | str | None = None,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> Fingerprint:
        """The fingerprint of `model` (a name; `config`: its config as a dict or JSON) over `spec`."""
        if not isinstance(model, str) or not model:
            raise ConfigError(f"a fingerprint needs a model name, got {model!r}")
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tensor-parallel rank {tp_rank} is outside [0, {tp_size})")
        ranked = tp_size > 1 and is_ranked(spec)
        identity = {
            "model": model,
            "config": _canonical(config),
            "spec": spec_identity(spec),
            "tp": [tp_rank, tp_size] if ranked else None,
        }
        blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
        return cls(hashlib.blake2b(blob, digest_size=FINGERPRINT_BYTES).digest())


def is_ranked(spec: KVSpec) -> bool:
    """Whether `spec`'s bytes differ by tensor-parallel rank (K/V split by heads): its keys name the rank."""
    return any(b.kind in _RANKED_KINDS for b in spec.buffers)


def spec_identity(spec: KVSpec) -> dict[str, Any]:
    """What of a spec decides its bytes (its display name does not)."""
    return {
        "layers": spec.num_layers,
        "page": spec.page_size,
        "buffers": [
            [b.name, b.kind.value, list(b.row_shape), str(b.dtype), list(b.layers)] for b in spec.buffers
        ],
    }


def _canonical(config: Mapping[str, Any] | str | None) -> str:
    if config is None:
        return ""
    if isinstance(config, str):
        return hashlib.blake2b(config.encode(), digest_size=16).hexdigest()
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


class PageKeys:
    """Chained page hashes and keys under one `Fingerprint` for pages of `page_size` tokens."""

    def __init__(self, fingerprint: Fingerprint, page_size: int) -> None:
        if page_size < 1:
            raise ConfigError(f"page_size {page_size} must be positive")
        self.fingerprint = fingerprint
        self.page_size = page_size
        self.root = hashlib.blake2b(b"kvtier-root:" + fingerprint.digest, digest_size=HASH_BYTES).digest()
        self._prefix = fingerprint.hex + "."

    def chain(self, parent: bytes, tokens: np.ndarray) -> list[bytes]:
        """The hash of each whole page of `tokens` (`[n]` integer ids) after the page hashed `parent`."""
        ps = self.page_size
        if len(tokens) % ps:
            raise ConfigError(f"{len(tokens)} tokens is not a whole number of pages of {ps}")
        raw = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
        step = ps * 8
        out: list[bytes] = []
        h = parent
        for at in range(0, len(raw), step):
            h = hashlib.blake2b(h + raw[at : at + step], digest_size=HASH_BYTES).digest()
            out.append(h)
        return out

    def key(self, page_hash: bytes) -> str:
        return self._prefix + page_hash.hex()

    def keys(self, page_hashes: list[bytes]) -> list[str]:
        return [self._prefix + h.hex() for h in page_hashes]
