"""What one batched copy call costs on the host, by count: cuda.bindings (lists) vs ctypes (arrays).

Also checks that the ctypes call copies the right bytes (poisoned destination, every run compared).
"""

import ctypes
import json
import os
import time

import numpy as np
import torch
from cuda.bindings import runtime as rt

from kvtier.transfer import dma

out = os.environ.get("OUT", "/tmp/out")
res = {}
torch.cuda.init()
s = torch.cuda.Stream()
with open("/proc/self/maps") as fh:
    libs = sorted({ln.split()[-1] for ln in fh.read().splitlines() if "libcudart" in ln})
res["cudart"] = libs
print("cudart:", libs)
dma.dma_mode()
attrs = dma._attrs
RUN = 4096
src = torch.randint(0, 255, (2048 * 2 * RUN,), dtype=torch.uint8).pin_memory()
dst = torch.empty(2048 * RUN, dtype=torch.uint8, device="cuda")
h = rt.cudaStream_t(s.cuda_stream)


def lists(n):
    order = np.random.default_rng(n).permutation(2 * n)[:n]
    srcs = src.data_ptr() + order.astype(np.int64) * RUN
    dsts = dst.data_ptr() + np.arange(n, dtype=np.int64) * RUN
    sizes = np.full(n, RUN, dtype=np.int64)
    return dsts, srcs, sizes, order


def bindings_call(dsts, srcs, sizes):
    n = len(sizes)
    (err, *_) = rt.cudaMemcpyBatchAsync(dsts.tolist(), srcs.tolist(), sizes.tolist(), n, [attrs], [0], 1, h)
    assert err == rt.cudaError_t.cudaSuccess, err


fn = None
if libs:
    lib = ctypes.CDLL(libs[0])
    fn = lib.cudaMemcpyBatchAsync
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.argtypes += [ctypes.c_void_p]
    idx0 = (ctypes.c_size_t * 1)(0)
    attr_ptr = attrs.getPtr()


def ctypes_call(dsts, srcs, sizes):
    n = len(sizes)
    err = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, attr_ptr, idx0, 1, s.cuda_stream)
    assert err == 0, err


def per_call(call, args, reps=200):
    call(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        call(*args)
    t = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return round(t, 2)


for name, call in (("bindings", bindings_call), ("ctypes", ctypes_call if fn else None)):
    if call is None:
        continue
    for n in (16, 256, 2048):
        dsts, srcs, sizes, order = lists(n)
        dst.fill_(0xAB)
        torch.cuda.synchronize()
        call(dsts, srcs, sizes)
        s.synchronize()
        want = src.view(-1, RUN)[torch.from_numpy(order)]
        ok = bool(torch.equal(dst[: n * RUN].view(n, RUN).cpu(), want))
        res[f"{name}_{n}_us"] = per_call(call, (dsts, srcs, sizes), reps=20 if n == 2048 else 100)
        res[f"{name}_{n}_identical"] = ok
        print(name, n, res[f"{name}_{n}_us"], "us", "identical" if ok else "WRONG")
with open(f"{out}/probe_batch.json", "w") as fh:
    json.dump(res, fh, indent=1)
