"""Probe: the layer-group kernel's tile for 132-byte DSA indexer rows, G layers per stretch.

Calls 3-5 of the sixth session: through the library, stretches of 8, 16 and 78 layers load at
0.79-0.82 of the ceiling but 32 layers at 0.43-0.64 (backups 0.80-0.88 throughout); the split
probe (call 2) read 16 layers at 0.85 with 31 stretches per program (4092 lanes) and 0.65 with
62 (8184). Here `groups.copy_groups` itself, layers evenly spaced (one allocation), fully scattered
slots, at several units per program for G in 8, 16, 32, 78; each shape checked byte-identical
(poisoned destination) and timed (median of repeats) against the copy engine's ceiling.
One JSON line per shape; argv: output path, groups, units per program (0: the default).
"""

from __future__ import annotations

import sys

import torch
from probe_rates import Probe

from kvtier.pool.device import Direction
from kvtier.transfer import groups

out_path = sys.argv[1]
GROUPS = [int(x) for x in sys.argv[2].split(",")]
UNITS = [int(x) for x in sys.argv[3].split(",")]
N, RW = 65536, 33
probe = Probe(out_path)
dev, emit, timed = probe.device, probe.emit, probe.timed
ceil_load, ceil_back = probe.ceilings()
emit({"ceiling_load": ceil_load, "ceiling_backup": ceil_back})
gen = torch.Generator().manual_seed(7)
host_slots, dev_slots = torch.randperm(2 * N, generator=gen)[:N], torch.randperm(2 * N, generator=gen)[:N]
for g in GROUPS:
    host = torch.randint(-(2**31), 2**31 - 1, (2 * N * g * RW,), dtype=torch.int32, generator=gen)
    host = host.pin_memory()
    saved = host.clone()
    layers = list(torch.empty(g, 2 * N * RW, dtype=torch.int32, device=dev))
    packed = (host_slots * g * RW).to(dev)
    split = (dev_slots * RW).to(dev)
    expect = host.view(2 * N, g, RW)[host_slots].transpose(0, 1).to(dev)
    nbytes = N * g * RW * 4
    for units in UNITS:

        def run(
            direction: Direction, units=units, host=host, packed=packed, layers=layers, split=split
        ) -> None:
            groups.copy_groups(
                host, packed, layers, split, RW, direction,
                validate=False, offsets_align=RW, units_per_program=units or None,
            )  # fmt: skip

        for t in layers:
            t.fill_(-1)
        probe.run(lambda run=run: run(Direction.LOAD))
        load_ok = all(torch.equal(t.view(-1, RW)[dev_slots.to(dev)], expect[j]) for j, t in enumerate(layers))
        host.view(2 * N, g, RW)[host_slots] = -1
        probe.run(lambda run=run: run(Direction.BACKUP))
        back_ok = bool(torch.equal(host, saved))
        lg = timed(lambda run=run: run(Direction.LOAD), nbytes)
        bg = timed(lambda run=run: run(Direction.BACKUP), nbytes)
        emit({
            "group": g, "units": units or groups.units_in_flight(g * RW * 4), "load_ok": load_ok,
            "backup_ok": back_ok, "load_frac": round(lg / ceil_load, 3),
            "backup_frac": round(bg / ceil_back, 3),
        })  # fmt: skip
    del host, saved, layers, expect
