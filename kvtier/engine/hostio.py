"""A step's copies between the host and the device that never make the host wait, and its one read.

`to_device` sends a host array through pinned memory with a copy the host does not wait for
(a plain `.to("cuda")` of pageable memory waits for the stream). `read_back` brings a step's
results (its sampled ids, and the few rows a request asked for) to the host after one wait
for the stream: the step's only synchronisation. On the CPU both are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(a: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`a` on `device`; on CUDA through a pinned buffer (the caching host allocator keeps it
    until the copy is done) with a copy the host does not wait for."""
    host = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def read_back(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of `tensors` (all on one device) after a single wait for its current stream."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors]
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for o, t in zip(out, tensors, strict=True):
        o.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return out
