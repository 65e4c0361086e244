"""Are fully scattered kernel moves bound by translating host addresses, not by PCIe requests?

`copy_rows` moves 131072 rows of one size between host memory and contiguous device rows, the
host rows in one of these orders:
- `seq`: in order (the kernel's plateau);
- `perm`: a random permutation of the rows (a fully scattered layer, as `kvtier bench transfer`'s
  runs-1);
- `perm_x2` / `perm_x4` / `perm_x8`: the same count drawn at random from 2x / 4x / 8x the rows (a
  larger host footprint);
- `block_2m`: the permutation sorted by the 2 MiB block each row lies in,
  random within a block (as scattered per request, but the kernel's tiles in flight touch a
  few blocks only).
and the host memory of one of these kinds:
- `hostalloc`: torch's pinned allocator (`cudaHostAlloc`, as `HostPool` chunks);
- `reg_4k`: `mmap` memory with transparent huge pages refused, then `cudaHostRegister`;
- `reg_thp`: `mmap` memory, 2 MiB aligned, with `MADV_HUGEPAGE`, then `cudaHostRegister`
  (its huge pages counted from `/proc/self/smaps`).

If `block_2m` beats `perm` by far, the GPU's (or the IOMMU's) translation of host pages bounds
scattered rows, and huge pages (`reg_thp` under `perm`) may lift them. Every row is checked
byte for byte against the host rows (destinations poisoned first) before it is timed.

`span` mode: rows of 1152 and 2048 bytes, scattered or in host runs of 16, drawn from 1x-8x the
rows of torch's pinned memory, on 2-8 programs, both directions: how a fully scattered kernel's
rate falls with the host span its rows lie in, and how many programs win it back.

Usage (GPU): python3 bench/probes/probe_tlb.py OUT.jsonl [pages|span]
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import sys
import time
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from kvtier.transfer.kernels import copy_rows

ROWS = 131072
HUGE = 2 << 20
ROW_BYTES = (1152, 656, 132)
MADV_NOHUGEPAGE = 15
_libc = ctypes.CDLL(None, use_errno=True)


def emit(out: TextIO, row: dict) -> None:
    """`row` as one JSON line, printed and appended to `out` (flushed: a run cut short keeps its rows)."""
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()


def system() -> dict:
    """What the machine says about huge pages and the IOMMU."""

    def read(p: str) -> str:
        try:
            return Path(p).read_text().strip()
        except OSError as e:
            return f"unreadable: {e}"

    mem = {k: v.strip() for k, v in (line.split(":", 1) for line in read("/proc/meminfo").splitlines())}
    iommu = Path("/sys/class/iommu")
    return {
        "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "hugepages": {k: mem.get(k) for k in ("HugePages_Total", "HugePages_Free", "AnonHugePages")},
        "cmdline": read("/proc/cmdline"),
        "iommu": sorted(p.name for p in iommu.iterdir()) if iommu.exists() else "none",
        "iommu_groups": len(list(Path("/sys/kernel/iommu_groups").glob("*"))),
    }


def anon_huge_kb(addr: int, nbytes: int) -> int:
    """AnonHugePages of the mapping holding [addr, addr + nbytes) (kB, from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < addr + nbytes and hi > addr
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


class Memory:
    """`nbytes` of host memory of one kind, as a uint8 tensor usable by the kernel (`.t`)."""

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind, self.map, self.registered = kind, None, False
        if kind == "hostalloc":
            self.t = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
            self.huge_kb = 0
            return
        self.map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        skip = (-base) % HUGE
        whole = np.frombuffer(self.map, dtype=np.uint8)
        if kind == "reg_thp":
            self.map.madvise(mmap.MADV_HUGEPAGE)
        else:
            self.map.madvise(MADV_NOHUGEPAGE)
        self.t = torch.from_numpy(whole[skip : skip + nbytes])
        del whole
        self.t.fill_(0)  # first touch: the pages (huge ones where granted) exist before the pin
        ptr = self.t.data_ptr()
        self.huge_kb = anon_huge_kb(ptr, nbytes)
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister: {err}")
        self.registered = True
        if not self.t.is_pinned():
            raise RuntimeError("a registered buffer does not read as pinned")

    def close(self) -> None:
        """Unpin and unmap (callers drop their views of `.t` first)."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.t.data_ptr())
        self.t = None
        gc.collect()
        if self.map is not None:
            self.map.close()


def orders(row_bytes: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each order's host rows (`[ROWS]`, ids among 8 x ROWS host rows)."""
    perm = rng.permutation(ROWS)
    out = {"seq": np.arange(ROWS), "perm": perm}
    for spread in (2, 4, 8):
        out[f"perm_x{spread}"] = rng.permutation(spread * ROWS)[:ROWS]
    for name, block in (("block_2m", HUGE),):
        out[name] = perm[np.argsort(perm * row_bytes // block, kind="stable")]
    return out


def median_ms(fn, *args, repeats: int = 10, calls: int = 4, **kwargs) -> float:
    """The median of `repeats` timings of `calls` calls of `fn(*args, **kwargs)` (CUDA events, after 2
    warmups), ms per call."""
    for _ in range(2):
        fn(*args, **kwargs)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn(*args, **kwargs)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return float(np.median(times))


def ceilings(layer: int) -> dict[str, float]:
    """The copy engine's GB/s for one `layer`-byte pinned copy, each direction."""
    src = torch.empty(layer, dtype=torch.uint8).pin_memory()
    dev = torch.empty(layer, dtype=torch.uint8, device="cuda")
    load = layer / median_ms(dev.copy_, src, non_blocking=True) / 1e6
    return {"load": load, "backup": layer / median_ms(src.copy_, dev, non_blocking=True) / 1e6}


def checked(direction: str, host: torch.Tensor, dev: torch.Tensor, rows: np.ndarray, row_bytes: int) -> bool:
    """Whether `copy_rows` moves `rows` (host rows, onto device rows in order) byte for byte in
    `direction`, the destination poisoned first."""
    words = row_bytes // 4
    host_off = torch.from_numpy(rows.astype(np.int64)) * words
    dev_off = torch.arange(len(rows), dtype=torch.int64) * words
    picked = torch.from_numpy(rows)
    host_rows, dev_rows = host.view(-1, row_bytes), dev.view(-1, row_bytes)
    if direction == "load":
        dev.fill_(0xA5)
        copy_rows(host.view(torch.int32), host_off, dev.view(torch.int32), dev_off, words, sm_budget=4)
        return bool(torch.equal(dev_rows.cpu(), host_rows[picked]))
    dev.copy_(torch.randint(0, 256, (dev.numel(),), dtype=torch.uint8))
    host_rows[picked] = 0xA5
    copy_rows(dev.view(torch.int32), dev_off, host.view(torch.int32), host_off, words, sm_budget=4)
    torch.cuda.synchronize()
    return bool(torch.equal(host_rows[picked], dev_rows.cpu()))


def one_size(out, row_bytes: int, rng: np.random.Generator) -> None:
    """Every memory kind, order, direction and grid for rows of `row_bytes`."""
    words, layer = row_bytes // 4, ROWS * row_bytes
    ceiling = ceilings(layer)
    emit(out, {"row_bytes": row_bytes, "ceiling_gbs": {k: round(v, 2) for k, v in ceiling.items()}})
    dev = torch.empty(layer, dtype=torch.uint8, device="cuda")
    dev_w = dev.view(torch.int32)
    dev_off = torch.arange(ROWS, device="cuda", dtype=torch.int64) * words
    for kind in ("hostalloc", "reg_thp", "reg_4k"):
        mem = Memory(kind, 8 * layer)
        host_w = mem.t.view(torch.int32)
        host_w.copy_(torch.arange(host_w.numel(), dtype=torch.int32))  # every word distinct
        for order, rows in orders(row_bytes, rng).items():
            host_off = torch.from_numpy(rows.astype(np.int64)).cuda() * words
            for direction in ("load", "backup"):
                if direction == "backup" and order == "seq":
                    continue
                ok = checked(direction, mem.t, dev, rows, row_bytes)
                ends = (host_w, host_off, dev_w, dev_off)
                if direction == "backup":
                    ends = (dev_w, dev_off, host_w, host_off)
                row = {"row_bytes": row_bytes, "memory": kind, "huge_mb": mem.huge_kb // 1024, "order": order}
                for sms in (2, 4, 8):
                    kw = {"sm_budget": sms, "validate": False, "offsets_align": words}
                    ms = median_ms(copy_rows, *ends, words, **kw)
                    ratio = round(layer / ms / 1e6 / ceiling[direction], 3)
                    emit(out, {**row, "direction": direction, "sms": sms, "ok": ok, "ratio": ratio})
        del host_w, host_off, ends
        torch.cuda.synchronize()
        mem.close()


SPANS = {1152: (1, 2, 4, 6, 8), 2048: (1, 2, 3, 4)}


def one_span_size(out, row_bytes: int, rng: np.random.Generator) -> None:
    """Rows of `row_bytes` over every span, order, direction and grid (`span` mode)."""
    words, layer = row_bytes // 4, ROWS * row_bytes
    ceiling = ceilings(layer)
    emit(out, {"row_bytes": row_bytes, "ceiling_gbs": {k: round(v, 2) for k, v in ceiling.items()}})
    most = max(SPANS[row_bytes])
    host = torch.empty(most * layer, dtype=torch.uint8, pin_memory=True)
    base = torch.randint(0, 256, (layer,), dtype=torch.uint8)
    for k in range(most):  # every span's rows differ from the others'
        host[k * layer : (k + 1) * layer] = base + k
    host_w = host.view(torch.int32)
    dev = torch.empty(layer, dtype=torch.uint8, device="cuda")
    dev_w = dev.view(torch.int32)
    dev_off = torch.arange(ROWS, device="cuda", dtype=torch.int64) * words
    for spread in SPANS[row_bytes]:
        starts = rng.permutation(spread * ROWS // 16)[: ROWS // 16] * 16
        for order, rows in (
            ("rows", rng.permutation(spread * ROWS)[:ROWS]),
            ("runs16", (starts[:, None] + np.arange(16)).ravel()),
        ):
            host_off = torch.from_numpy(rows.astype(np.int64)).cuda() * words
            for direction in ("load", "backup"):
                ok = checked(direction, host, dev, rows, row_bytes)
                ends = (host_w, host_off, dev_w, dev_off)
                if direction == "backup":
                    ends = (dev_w, dev_off, host_w, host_off)
                row = {"row_bytes": row_bytes, "span_mb": spread * layer >> 20, "order": order}
                for sms in (2, 3, 4, 6, 8):
                    kw = {"sm_budget": sms, "validate": False, "offsets_align": words}
                    ms = median_ms(copy_rows, *ends, words, **kw)
                    ratio = round(layer / ms / 1e6 / ceiling[direction], 3)
                    emit(out, {**row, "direction": direction, "sms": sms, "ok": ok, "ratio": ratio})


def main(path: str, mode: str) -> None:
    rng = np.random.default_rng(7)
    start = time.time()
    with open(path, "w") as out:
        emit(out, {"system": system(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name()})
        for row_bytes in SPANS if mode == "span" else ROW_BYTES:
            (one_span_size if mode == "span" else one_size)(out, row_bytes, rng)
            print(f"# {row_bytes} B done at {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "pages")
