"""A step's copies between the host and the device that never make the host wait, and its one read.

`to_device` sends a host array through pinned memory with a copy the host does not wait for
(a plain `.to("cuda")` of pageable memory waits for the stream); a buffer from `host_buffer`,
filled in place, is pinned already and goes without the staging copy. `read_back` brings a step's
results (its sampled ids, and the few rows a request asked for) to the host after one wait
for the stream: the step's only synchronisation. On the CPU both are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(a: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`a` on `device`; on CUDA through a pinned buffer (the caching host allocator keeps it
    until the copy is done; a pinned tensor is its own) with a copy the host does not wait for."""
    host = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def host_buffer(size: int, device: torch.device) -> torch.Tensor:
    """An empty `[size]` int64 host tensor to fill (through `.numpy()`) and send with `to_device`:
    pinned where `device` is CUDA, from the caching host allocator, which keeps it until the copy
    that reads it is done; pageable elsewhere."""
    return torch.empty(size, dtype=torch.int64, pin_memory=device.type == "cuda")


def read_back(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of `tensors` (all on one device) after a single wait for its current stream."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors]
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for o, t in zip(out, tensors, strict=True):
        o.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out
