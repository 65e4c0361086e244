"""Where the CPU time of match + load_back goes on the GPU machine (profile + primitive costs)."""

import cProfile
import ctypes
import io
import json
import os
import pstats
import time

import numpy as np
import torch
from cuda.bindings import runtime as rt

from kvtier.cache import CacheConfig, CacheController
from kvtier.pool.device import DevicePool
from kvtier.pool.host import HostPool
from kvtier.spec import preset

out = os.environ.get("OUT", "/tmp/out")
res = {}
torch.cuda.init()
x = torch.empty(1, device="cuda")
with open("/proc/self/maps") as fh:
    maps = fh.read()
libs = sorted({line.split()[-1] for line in maps.splitlines() if "cudart" in line or "libcuda.so" in line})
res["libs"] = libs
print("libs:", libs)

s = torch.cuda.Stream()
N = 2000


def per_call(fn):
    fn()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    return (time.perf_counter() - t0) / N * 1e6


src = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")


def ev_torch():
    e = torch.cuda.Event()
    e.record(s)


res["torch_event_new_record_us"] = per_call(ev_torch)
e0 = torch.cuda.Event()
e0.record(s)
res["torch_event_rerecord_us"] = per_call(lambda: e0.record(s))
res["torch_stream_ctx_us"] = per_call(lambda: torch.cuda.stream(s).__enter__())
res["torch_current_stream_us"] = per_call(lambda: torch.cuda.current_stream())
res["cuda_stream_attr_us"] = per_call(lambda: s.cuda_stream)
h = rt.cudaStream_t(s.cuda_stream)
kind = rt.cudaMemcpyKind.cudaMemcpyDefault
d, sp = dst.data_ptr(), src.data_ptr()
res["bindings_memcpy_us"] = per_call(lambda: rt.cudaMemcpyAsync(d, sp, 4096, kind, h))
torch.cuda.synchronize()
cudart = next((lib for lib in libs if "cudart" in lib), None)
if cudart:
    cr = ctypes.CDLL(cudart)
    f = cr.cudaMemcpyAsync
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    f.restype = ctypes.c_int
    sh = s.cuda_stream
    res["ctypes_cudart_memcpy_us"] = per_call(lambda: f(d, sp, 4096, 4, sh))
    ev = ctypes.c_void_p()
    cr.cudaEventCreateWithFlags(ctypes.byref(ev), 2)
    rec = cr.cudaEventRecord
    rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    res["ctypes_cudart_record_us"] = per_call(lambda: rec(ev, sh))
torch.cuda.synchronize()
drv = ctypes.CDLL("libcuda.so.1")
g = drv.cuMemcpyAsync
g.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
g.restype = ctypes.c_int
sh = s.cuda_stream
res["ctypes_driver_memcpy_us"] = per_call(lambda: g(d, sp, 4096, sh))
torch.cuda.synchronize()
print(json.dumps(res, indent=1))

spec = preset("deepseek-v3")
tokens = 131072
cache = CacheController(DevicePool(spec, tokens, "cuda"), HostPool(spec, tokens), CacheConfig())
rng = np.random.default_rng(0)
seq = rng.integers(1, 50000, tokens)
cache.insert(seq, cache.alloc_device(tokens))
prof = cProfile.Profile()
walls = []
for r in range(6):
    cache.flush()
    cache.evict_device(tokens)
    torch.cuda.synchronize()
    if r:
        prof.enable()
    t0 = time.perf_counter()
    m = cache.match(seq.copy())
    t1 = time.perf_counter()
    h = cache.load_back(m)
    t2 = time.perf_counter()
    if r:
        prof.disable()
    walls.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6))
    h.wait()
res["match_loadback_us"] = walls
print("match/load_back us:", walls)
sio = io.StringIO()
pstats.Stats(prof, stream=sio).sort_stats("tottime").print_stats(25)
print(sio.getvalue())
with open(f"{out}/probe_submit.txt", "w") as fh:
    fh.write(sio.getvalue())
with open(f"{out}/probe_submit.json", "w") as fh:
    json.dump(res, fh, indent=1)
