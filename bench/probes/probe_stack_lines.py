"""How wide a 2-D copy-engine line must be for `page_first` stacks of some of a page's layers.

A `page_first` host page of GLM-5's latent buffer is 78 layers of 1152-byte rows (89856 B at page
size 1). A call of `g` layers copies one line of `g * 1152` bytes per page, the pages 89856 B
apart (`cudaMemcpy2DAsync`, `kvtier.transfer.strided.copy_2d`), into a packed device buffer.
Per width: the GB/s of one call over `pages` lines (median of 7 after a warm-up) against one
contiguous copy of the same bytes (the ceiling of the same run), and a byte check of one call.
Prints one JSON line per width and appends it to OUT.

Usage: python3 bench/probes/probe_stack_lines.py OUT.jsonl [ROW_BYTES=1152] [LAYERS=78]
"""

from __future__ import annotations

import sys

import torch
from probe_rates import Probe

from kvtier.transfer import strided

# Bytes of lines per measurement: about 64 MiB of each width.
VOLUME = 64 << 20


def main() -> None:
    out = sys.argv[1]
    row = int(sys.argv[2]) if len(sys.argv) > 2 else 1152
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 78
    probe = Probe(out)
    pitch = layers * row
    pages_max = VOLUME // row  # one layer's lines
    host = torch.randint(0, 256, (pages_max * pitch,), dtype=torch.uint8).pin_memory()
    dev = torch.empty(VOLUME, dtype=torch.uint8, device=probe.device)
    load_ceiling, _ = probe.ceilings()
    for g in (1, 2, 4, 8, 13, 16, 26, 39, 78):
        if g > layers:
            continue
        width = g * row
        pages = VOLUME // width
        nbytes = pages * width

        def call(width=width, pages=pages) -> None:
            strided.copy_2d(dev.data_ptr(), width, host.data_ptr(), pitch, width, pages, probe.stream)

        probe.run(call)
        want = host[: pages * pitch].view(pages, pitch)[:, :width]
        ok = torch.equal(dev[:nbytes].view(pages, width).cpu(), want)
        flat = host[:nbytes]

        def contiguous(nbytes=nbytes, flat=flat) -> None:
            dev[:nbytes].copy_(flat, non_blocking=True)

        gbps = probe.timed(call, nbytes)
        same_run = probe.timed(contiguous, nbytes)
        row_out = {"row_bytes": row, "layers": g, "line_bytes": width, "pitch": pitch, "lines": pages}
        row_out |= {"gbps": round(gbps, 2), "contiguous_gbps": round(same_run, 2), "identical": ok}
        probe.emit(row_out | {"ratio": round(gbps / load_ceiling, 3), "ceiling_gbps": round(load_ceiling, 2)})


if __name__ == "__main__":
    main()
