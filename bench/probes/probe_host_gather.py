"""Whether the host's cores can gather fully scattered rows fast enough for the copy engine.

One layer of `glm-5` at page size 1 is two buffers of rows at random host slots: 1152-byte
latent rows and 132-byte indexer rows (and `deepseek-v3-fp8-packed` 656-byte rows). The SMs
read such rows at 0.84-0.86 of the ceiling, bound by read requests (FINDINGS, "what a small
row costs"). Here the host's cores gather them into pinned staging (`index_select(out=)`), and
the copy engine moves the staging as one contiguous piece while the cores gather the next
window; backups the reverse (copy engine into staging, then `index_copy_` onto the host slots).

Rows printed (one JSON line each, appended to OUT):
- `gather`/`scatter`: the cores alone, GB/s of rows at 1-16 threads;
- `load`/`backup`: the pipeline over `LAYERS` layers of `TOKENS` rows in windows, host wall
  clock from the first gather to the last copy's end, against the same run's ceiling;
  each checked byte for byte against the rows themselves (destinations poisoned first).

Usage: python3 bench/probes/probe_host_gather.py OUT.jsonl [TOKENS=131072] [LAYERS=4]
"""

from __future__ import annotations

import sys
import time

import torch
from probe_rates import Probe

SPECS = {"glm-5": (1152, 132), "fp8-packed": (656,), "deepseek-v3": (1152,)}


def median_s(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


class Layers:
    """`layers` host layers per buffer, `[layers, 2 * tokens, row]` pinned, and `tokens` random slots."""

    def __init__(self, rows: tuple[int, ...], tokens: int, layers: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(7)
        self.rows = rows
        self.host = [
            torch.randint(0, 256, (layers, 2 * tokens, r), dtype=torch.uint8, generator=gen).pin_memory()
            for r in rows
        ]
        self.slots = torch.randperm(2 * tokens, generator=gen)[:tokens]
        self.dev = [torch.empty(layers, tokens, r, dtype=torch.uint8, device=device) for r in rows]
        self.tokens, self.layers = tokens, layers
        self.nbytes = layers * tokens * sum(rows)


def pipeline(lay: Layers, window: int, stream: torch.cuda.Stream, backup: bool) -> float:
    """Seconds of one pipelined load (or backup) of every layer, windows alternating two halves."""
    halves = [[torch.empty(window, r, dtype=torch.uint8).pin_memory() for r in lay.rows] for _ in range(2)]
    done = [torch.cuda.Event(), torch.cuda.Event()]
    for e in done:
        e.record(stream)
    torch.cuda.synchronize()
    pending: list[tuple] = []  # backups: (half, event, layer, start, stop) waiting for the cores
    t0 = time.perf_counter()
    k = 0
    for layer in range(lay.layers):
        for start in range(0, lay.tokens, window):
            stop = min(start + window, lay.tokens)
            n = stop - start
            h = k % 2
            idx = lay.slots[start:stop]
            if not backup:
                done[h].synchronize()
                for b, stage in enumerate(halves[h]):
                    torch.index_select(lay.host[b][layer], 0, idx, out=stage[:n])
                with torch.cuda.stream(stream):
                    for b, stage in enumerate(halves[h]):
                        lay.dev[b][layer, start:stop].copy_(stage[:n], non_blocking=True)
                done[h].record(stream)
            else:
                if len(pending) == 2:
                    _scatter(lay, pending.pop(0))
                with torch.cuda.stream(stream):
                    for b, stage in enumerate(halves[h]):
                        stage[:n].copy_(lay.dev[b][layer, start:stop], non_blocking=True)
                done[h].record(stream)
                pending.append((halves[h], done[h], layer, start, stop))
            k += 1
    for p in pending:
        _scatter(lay, p)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _scatter(lay: Layers, p: tuple) -> None:
    half, event, layer, start, stop = p
    event.synchronize()
    idx = lay.slots[start:stop]
    for b, stage in enumerate(half):
        lay.host[b][layer].index_copy_(0, idx, stage[: stop - start])


def main() -> None:
    out = sys.argv[1]
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    probe = Probe(out)
    load_ceiling, backup_ceiling = probe.ceilings()
    probe.emit(
        {
            "ceiling_load_gbps": round(load_ceiling, 2),
            "ceiling_backup_gbps": round(backup_ceiling, 2),
            "cpus": torch.get_num_threads(),
        }
    )
    cores = torch.get_num_threads()
    for name, rows in SPECS.items():
        lay = Layers(rows, tokens, layers, probe.device)
        per_layer = tokens * sum(rows)
        for threads in sorted({1, 2, 4, 8, cores}):
            torch.set_num_threads(threads)
            stages = [torch.empty(tokens, r, dtype=torch.uint8).pin_memory() for r in rows]

            def gather(stages=stages, lay=lay) -> None:
                for b, stage in enumerate(stages):
                    torch.index_select(lay.host[b][0], 0, lay.slots, out=stage)

            def scatter(stages=stages, lay=lay) -> None:
                for b, stage in enumerate(stages):
                    lay.host[b][1].index_copy_(0, lay.slots, stage)

            g = per_layer / median_s(gather) / 1e9
            s = per_layer / median_s(scatter) / 1e9
            probe.emit(
                {
                    "spec": name,
                    "kind": "cores",
                    "threads": threads,
                    "gather_gbps": round(g, 2),
                    "scatter_gbps": round(s, 2),
                }
            )
        torch.set_num_threads(cores)
        for window in (8192, 16384, 32768):
            for backup in (False, True):
                for d in lay.dev:
                    d.fill_(0xA5)
                want = [h[:, lay.slots].clone() for h in lay.host]
                if backup:
                    for h in lay.host:
                        h[:, lay.slots] = 0x5A
                    for b, d in enumerate(lay.dev):
                        d.copy_(want[b].to(probe.device))
                secs = pipeline(lay, window, probe.stream, backup)
                if backup:
                    ok = all(torch.equal(h[:, lay.slots], want[b]) for b, h in enumerate(lay.host))
                else:
                    ok = all(torch.equal(d.cpu(), want[b]) for b, d in enumerate(lay.dev))
                rates = sorted(
                    lay.nbytes / pipeline(lay, window, probe.stream, backup) / 1e9 for _ in range(3)
                )
                ceiling = backup_ceiling if backup else load_ceiling
                probe.emit(
                    {
                        "spec": name,
                        "kind": "backup" if backup else "load",
                        "window": window,
                        "tokens": tokens,
                        "layers": layers,
                        "threads": cores,
                        "gbps": round(rates[1], 2),
                        "ratio": round(rates[1] / ceiling, 3),
                        "identical": ok,
                        "first_s": round(secs, 4),
                    }
                )
        del lay
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
