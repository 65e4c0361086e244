"""The device tier: one `[num_slots, *row]` tensor per buffer per layer.

`DevicePool` owns the tensors the model reads (one allocation per buffer, its layers
evenly spaced views) or wraps tensors an engine already has (which may lie anywhere).

Lifetime: `close()` (or leaving a `with` block) drops the pool's tensors;
afterwards every accessor raises `ClosedError`. On a GPU the freed blocks stay in
torch's caching allocator (`torch.cuda.empty_cache()` is the caller's choice). A wrapped
pool drops only its references.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from enum import Enum

import numpy as np
import torch

from kvtier.errors import ClosedError, SpecError
from kvtier.pool.memory import Owner, fmt_bytes
from kvtier.pool.rows import rows_contiguous
from kvtier.spec import KVSpec

log = logging.getLogger(__name__)

Tensors = Mapping[str, Sequence[torch.Tensor]]  # buffer name -> one `[num_slots, *row]` tensor per layer


class Direction(str, Enum):
    """Which way a transfer moves rows."""

    LOAD = "load"  # host -> device
    BACKUP = "backup"  # device -> host


class DevicePool(Owner):
    """KV rows of `num_slots` tokens for every buffer and layer of `spec` on `device`."""

    def __init__(
        self,
        spec: KVSpec,
        num_slots: int,
        device: torch.device | str = "cpu",
        *,
        tensors: Tensors | None = None,
    ) -> None:
        if num_slots <= 0:
            raise SpecError(f"device pool: num_slots {num_slots} must be positive")
        self.spec = spec
        self.num_slots = num_slots
        self.device = torch.device(device)
        if tensors is None:
            # One allocation per buffer, its layers evenly spaced:
            shapes = {b.name: (len(b.layers), num_slots, *b.row_shape) for b in spec.buffers}
            self._stacked = {
                b.name: torch.zeros(shapes[b.name], dtype=b.dtype, device=self.device) for b in spec.buffers
            }
            self._tensors = {name: list(t) for name, t in self._stacked.items()}
        else:
            self._stacked = {}
            self._tensors = self._check_tensors(tensors)
        self._layer_ptrs = {
            n: np.array([t.data_ptr() for t in ts], dtype=np.int64) for n, ts in self._tensors.items()
        }
        for ptrs in self._layer_ptrs.values():
            ptrs.flags.writeable = False  # the tensors never move
        # Buffers whose every layer holds the spec's dtype in packed rows: raw copies may address them.
        self._raw = {
            b.name: all(t.dtype == b.dtype and rows_contiguous(t) for t in self._tensors[b.name])
            for b in spec.buffers
        }
        kv_bytes = sum(t.nbytes for ts in self._tensors.values() for t in ts)
        self.footprint_bytes = kv_bytes
        log.info(
            "device pool: %d slots on %s, %s%s",
            num_slots,
            self.device,
            fmt_bytes(self.footprint_bytes),
            " (wrapped tensors)" if tensors is not None else "",
        )

    @classmethod
    def wrap(cls, spec: KVSpec, tensors: Tensors) -> DevicePool:
        """A pool over an engine's own tensors.

        `tensors[name][i]`: `[num_slots, *row]`, the buffer's i-th layer. Rows need not be
        packed nor of the spec's dtype; such buffers move on the reference path.
        """
        first = next((t for ts in tensors.values() for t in ts), None)
        if first is None:
            raise SpecError(f"device pool: no tensors to wrap for spec {spec.name!r}")
        return cls(spec, first.shape[0], first.device, tensors=tensors)

    def _check_tensors(self, tensors: Tensors) -> dict[str, list[torch.Tensor]]:
        out = {}
        for b in self.spec.buffers:
            ts = list(tensors.get(b.name, ()))
            if len(ts) != len(b.layers):
                raise SpecError(
                    f"device pool: buffer {b.name!r} needs {len(b.layers)} tensors, got {len(ts)}"
                )
            for t in ts:
                if tuple(t.shape) != (self.num_slots, *b.row_shape) or t.device != self.device:
                    raise SpecError(
                        f"device pool: buffer {b.name!r} tensor {tuple(t.shape)} on {t.device} does not "
                        f"match {(self.num_slots, *b.row_shape)} on {self.device}"
                    )
            out[b.name] = ts
        extra = set(tensors) - {b.name for b in self.spec.buffers}
        if extra:
            raise SpecError(f"device pool: tensors for unknown buffers {sorted(extra)}")
        return out

    def close(self) -> None:
        """Drop the KV tensors; idempotent (see the module docstring for the GPU cache)."""
        if self._closed:
            return
        self._closed = True
        self._tensors, self._layer_ptrs, self._stacked = {}, {}, {}
        log.info("device pool closed: %s on %s released", fmt_bytes(self.footprint_bytes), self.device)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"device pool of {self.spec.name!r} ({self.num_slots} slots) was closed")

    def layer(self, buffer: str, layer: int) -> torch.Tensor:
        """The tensor of one buffer on model layer `layer`: `[num_slots, *row]`."""
        self._check_open()
        b = self.spec.buffer(buffer)
        return self._tensors[buffer][b.local_layer(layer)]

    def stacked(self, buffer: str) -> torch.Tensor | None:
        """Every layer of `buffer` as one tensor, `[layers, num_slots, *row]`, where the pool made them
        (one allocation); None for wrapped tensors."""
        self._check_open()
        return self._stacked.get(self.spec.buffer(buffer).name)

    def raw_rows(self, buffer: str) -> bool:
        """Whether every layer of `buffer` has the spec's dtype in packed rows (raw copies can move it)."""
        self._check_open()
        return self._raw[self.spec.buffer(buffer).name]

    def layer_ptrs(self, buffer: str) -> np.ndarray:
        """`[layers of the buffer]` int64, read-only: the address of each layer's tensor."""
        self._check_open()
        return self._layer_ptrs[self.spec.buffer(buffer).name]

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return f"DevicePool({self.spec.name}, slots={self.num_slots}, device={self.device}{state})"
