"""The row kernel as the compiled loop launches it (`find`): Triton's compiled kernel for one launch
shape, found once per shape and checked against the parameters the loop passes.

The loop calls `cuLaunchKernel` with (src, src offsets, dst, dst offsets, n, row vectors) and null
pointers for Triton's scratch parameters. Where that could be wrong (other parameters, scratch
memory, clusters, cooperative launch, no driver) `find` gives None and Triton launches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.transfer import cudart, kernels

log = logging.getLogger(__name__)

PARAMS = ("src_ptr", "src_off_ptr", "dst_ptr", "dst_off_ptr", "n_rows", "row_vecs")
_INT_BYTES = {"i32": 4, "u32": 4, "i64": 8, "u64": 8}
_FOUND: dict[tuple, CompiledLaunch | None] = {}


@dataclass(frozen=True)
class CompiledLaunch:
    """What the loop needs to launch one compiled kernel: its `CUfunction`, threads per program,
    dynamic shared memory, the bytes of `n` and of the row vectors (0: a constant of the kernel) and
    how many null pointers follow them."""

    func: int
    threads: int
    shared: int
    n_bytes: int
    vecs_bytes: int
    extra: int


Views = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def find(launch: kernels.RowLaunch, views: Views, aligned: tuple[bool, bool]) -> CompiledLaunch | None:
    """The compiled kernel of `launch` for bases whose 16-byte alignment is `aligned` (src, dst), which
    `views()` (the bases as 1-D words tensors) share; compiled on first use, then one dict lookup."""
    shape = launch.shape
    key = (tuple(shape.kwargs.items()), shape.row_vecs, launch.n >= 2**31, aligned)
    if key not in _FOUND:
        _FOUND[key] = _compile(launch, views)
    return _FOUND[key]


def _compile(launch: kernels.RowLaunch, views: Views) -> CompiledLaunch | None:
    driver = cudart.driver()
    device = launch.src_off.device
    if driver is None or device.type != "cuda":
        return None
    src, dst = views()
    shape = launch.shape
    args = (src, launch.src_off, dst, launch.dst_off, launch.n, shape.row_vecs)
    try:
        with torch.cuda.device(device):
            kernel = kernels.row_kernel().warmup(*args, grid=(shape.grid(launch.n),), **shape.kwargs)
        found = _checked(kernel, driver)
    except (AttributeError, TypeError, KeyError, ValueError) as e:
        found, why = None, e
    else:
        why = "its parameters or launch options are not the ones the loop passes"
    if found is None:
        log.info("the row kernel launches through Triton, not the compiled loop: %s", why)
    return found


def _checked(kernel, driver: cudart.Driver) -> CompiledLaunch | None:
    """`kernel` (Triton's compiled kernel) as the loop launches it, or None where that would differ."""
    md = kernel.metadata
    special = ("global_scratch_size", "profile_scratch_size", "launch_cooperative_grid", "launch_pdl")
    if any(getattr(md, name, 0) for name in special) or getattr(md, "num_ctas", 1) != 1:
        return None
    kernel._init_handles()
    passed = [(name, ty) for name, ty in kernel.src.signature.items() if ty != "constexpr"]
    if [name for name, _ in passed] not in (list(PARAMS), list(PARAMS[:5])):
        return None
    sizes = [8 if ty.startswith("*") else _INT_BYTES.get(ty, 0) for _, ty in passed]
    actual = driver.param_sizes(kernel.function)
    extra = actual[len(sizes) :]
    if actual[: len(sizes)] != sizes or any(size != 8 for size in extra):
        return None
    vecs = sizes[5] if len(sizes) > 5 else 0
    return CompiledLaunch(kernel.function, 32 * md.num_warps, md.shared, sizes[4], vecs, len(extra))
