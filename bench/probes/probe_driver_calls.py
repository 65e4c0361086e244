"""What a reload's runtime calls cost the host: 61 copies with an event after each, made from C.

Variants, each timed inside the C loop (clock_gettime) for 61 layers of 1 MB host -> device copies:
- `rt_copy_record`: cudaMemcpyAsync + cudaEventRecord (what the cache does now);
- `rt_copy`: cudaMemcpyAsync only (the records' share is the difference);
- `drv_htod_record`: cuMemcpyHtoDAsync_v2 + cuEventRecord (the driver API, no runtime layer);
- `drv_copy_record`: cuMemcpyAsync (unified addressing) + cuEventRecord;
- `rt_copy_write`: cudaMemcpyAsync + cuStreamWriteValue32_v2 (a progress word instead of an event).
Each `cold` (after a device sync and a 150 ms sleep, as after waiting for a reload) and `warm`
(the fifth of five back to back). Medians of 15 rounds, microseconds per 61 layers. argv[1]: JSON.
"""

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from kvtier.transfer import cudart

SRC = r"""
#include <stdint.h>
#include <time.h>
typedef int (*copy_rt)(void *, const void *, size_t, int, void *);
typedef int (*copy_drv)(uint64_t, const void *, size_t, void *);
typedef int (*copy_uni)(uint64_t, uint64_t, size_t, void *);
typedef int (*rec)(void *, void *);
typedef int (*wv)(void *, uint64_t, uint32_t, unsigned);
static int64_t now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}
#define EV ((void *)events[i])
int64_t run(int variant, int n, uint64_t dst, uint64_t src, size_t bytes, void *stream, const int64_t *events,
            uint64_t word, void *f_copy, void *f_rec, int *err) {
    int64_t t0 = now();
    int e = 0;
    for (int i = 0; i < n && !e; i++) {
        uint64_t d = dst + (uint64_t)i * bytes, s = src + (uint64_t)i * bytes;
        switch (variant) {
        case 0: /* fallthrough */
        case 1:
        case 4: e = ((copy_rt)f_copy)((void *)d, (void *)s, bytes, 4, stream); break;
        case 2: e = ((copy_drv)f_copy)(d, (void *)s, bytes, stream); break;
        case 3: e = ((copy_uni)f_copy)(d, s, bytes, stream); break;
        }
        if (e || variant == 1) continue;
        e = variant == 4 ? ((wv)f_rec)(stream, word, (uint32_t)i + 1, 0) : ((rec)f_rec)(EV, stream);
    }
    *err = e;
    return now() - t0;
}
"""

tmp = tempfile.mkdtemp()
with open(os.path.join(tmp, "p.c"), "w") as f:
    f.write(SRC)
subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", f"{tmp}/p.so", f"{tmp}/p.c"], check=True)
lib = ctypes.CDLL(f"{tmp}/p.so")
lib.run.restype = ctypes.c_int64
P = ctypes.c_void_p
lib.run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, P, P,
                    ctypes.c_uint64, P, P, P]  # fmt: skip

torch.cuda.init()
rt = cudart.runtime()
drv = ctypes.CDLL("libcuda.so.1")
addr = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
fns = {
    "rt_copy_record": (0, addr(rt.lib.cudaMemcpyAsync), addr(rt.lib.cudaEventRecord)),
    "rt_copy": (1, addr(rt.lib.cudaMemcpyAsync), addr(rt.lib.cudaEventRecord)),
    "drv_htod_record": (2, addr(drv.cuMemcpyHtoDAsync_v2), addr(drv.cuEventRecord)),
    "drv_copy_record": (3, addr(drv.cuMemcpyAsync), addr(drv.cuEventRecord)),
    "rt_copy_write": (4, addr(rt.lib.cudaMemcpyAsync), addr(drv.cuStreamWriteValue32_v2)),
}
n, nbytes = 61, 1 << 20
host = torch.empty(n * nbytes, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(n * nbytes, dtype=torch.uint8, device="cuda")
word = torch.zeros(4, dtype=torch.int32, device="cuda")
stream = torch.cuda.Stream()
events = [torch.cuda.Event() for _ in range(n)]
for e in events:
    e.record(stream)
handles = (ctypes.c_int64 * n)(*[e.cuda_event for e in events])
err = ctypes.c_int(0)


def once(name: str) -> float:
    variant, fc, fr = fns[name]
    ns = lib.run(variant, n, dev.data_ptr(), host.data_ptr(), nbytes, stream.cuda_stream, handles,
                 word.data_ptr(), fc, fr, ctypes.byref(err))  # fmt: skip
    if err.value:
        raise RuntimeError(f"{name}: CUDA error {err.value}")
    return ns / 1e3


rows = []
for name in fns:
    cold, warm = [], []
    for _ in range(15):
        torch.cuda.synchronize()
        time.sleep(0.15)
        cold.append(once(name))
        for _ in range(4):
            once(name)
        warm.append(once(name))
    med = lambda xs: round(statistics.median(xs), 1)  # noqa: E731
    row = {"variant": name, "cold_us": med(cold), "warm_us": med(warm), "cold_max_us": round(max(cold), 1)}
    print(json.dumps(row))
    rows.append(row)
torch.cuda.synchronize()
assert torch.equal(dev[:4096].cpu(), host[:4096])
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
