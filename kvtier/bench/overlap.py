"""`kvtier bench overlap`: transfers beside each other and beside the model (CUDA only).

- duplex: a reload (host -> device) on one stream and a backup (device -> host) on
  another at once; the aggregate rate against the one-direction ceiling.
- interference: a bf16 8192 x 8192 matmul loop on the compute stream, alone and with
  a reload running beside it on the load stream, through the copy engine and through
  the gather kernel. Runs with and without the reload alternate and medians are
  taken, since clocks drift: each run with the reload against the runs alone on either
  side of it. Each run times `ROUND_S` seconds after `LEAD_S` seconds in the same
  conditions, and the runs start after matmuls alone until their rate settles
  (`settle`): the matmul holds the GPU at its power limit, its clock and temperature
  follow the load with a lag, and a run timed from its first matmul measures partly its
  predecessor's conditions; short runs start at boost clocks. bench/FINDINGS.md gives
  how far each of these moved the ratios.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from rich.table import Table

from kvtier.bench.transfer import BenchConfig, Setup, setup
from kvtier.pool.device import Direction
from kvtier.transfer import TransferPath, TransferPlan, backup, load_layer

# GPU clock cycles the load stream is held while a duplex sample's calls are issued (~4 ms).
DUPLEX_HOLD_CYCLES = 8_000_000
ROUND_S = 2.0
LEAD_S = 3.0  # untimed seconds at the start of each round, in the round's own conditions
CHUNKS = 50  # a round's matmuls and reloads are issued interleaved in this many steps
WARM_S = 30.0  # at least this long of matmuls alone before the first measured round
SETTLE_S = 150.0  # at most this long
SETTLED = 0.005  # settled: the last three warm rounds' mean within this share of the three before


@dataclass
class OverlapRow:
    test: str
    mechanism: str
    sms: int
    value: float
    unit: str
    reference: float
    ratio: float


def run(
    cfg: BenchConfig,
    progress: Callable[[str], None],
    rounds: int = 5,
    on_round: Callable[[dict], None] | None = None,
) -> tuple[list[OverlapRow], Setup]:
    """The duplex and interference rows; `on_round` gets each interference round's host
    start and end times (`time.time()`) and rates, to line them up with clock samples.

    Where the kernel takes fewer SMs than its budget (`KernelOptions.lean`), the matmul is
    also timed beside the kernel on the whole budget: each SM the kernel holds costs the
    matmul part of its rate (bench/FINDINGS.md).
    """
    s = setup(cfg, progress)
    rows = []
    t = cfg.tokens
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    host_perm = torch.randperm(s.host.num_slots, generator=gen)
    dev_perm = torch.randperm(s.dev.num_slots, generator=gen)
    # `(load host, load device, backup host, backup device)`: the two directions touch
    # disjoint halves of both pools, so they never race on a row.
    slot_sets = {
        "copy engine": (torch.arange(t), torch.arange(t), torch.arange(t, 2 * t), torch.arange(t, 2 * t)),
        "kernel": (host_perm[:t], dev_perm[:t], host_perm[t : 2 * t], dev_perm[t : 2 * t]),
    }
    paths = {"copy engine": TransferPath.COPY, "kernel": TransferPath.KERNEL}
    ceiling = s.ceilings[Direction.LOAD]
    loads = {}
    for name, (lh, ld, bh, bd) in slot_sets.items():
        progress(f"duplex via {name}")
        path = paths[name]
        load = TransferPlan.build(
            "load", s.host, s.dev, lh, ld, force=path, kernel=cfg.kernel, stream=s.stream
        )
        back = TransferPlan.build(
            "backup", s.host, s.dev, bh, bd, force=path, kernel=cfg.kernel, stream=s.stream
        )
        loads[name] = load
        gbps = _duplex_gbps(s, load, back, rounds)
        rows.append(OverlapRow("duplex", name, load.sms_used * 2, gbps, "GB/s", ceiling, gbps / ceiling))

    beside = list(loads.items())
    if loads["kernel"].sms_used < cfg.kernel.sm_budget:
        lh, ld = slot_sets["kernel"][:2]
        whole = replace(cfg.kernel, lean=False)
        load = TransferPlan.build(
            "load", s.host, s.dev, lh, ld, force=paths["kernel"], kernel=whole, stream=s.stream
        )
        beside.append(("kernel", load))
    for name, load in beside:
        sms = load.sms_used
        progress(f"interference via {name}" + (f" on {sms} SMs" if sms else ""))
        report = functools.partial(_tagged, on_round, {"mechanism": name, "sms": sms}) if on_round else None
        alone, beside_tflops, reload_gbps, kept = _interference(s, load, rounds, on_round=report)
        rows.append(OverlapRow("matmul beside reload", name, sms, beside_tflops, "TFLOP/s", alone, kept))
        rows.append(
            OverlapRow("reload beside matmul", name, sms, reload_gbps, "GB/s", ceiling, reload_gbps / ceiling)
        )
    return rows, s


def _tagged(on_round: Callable[[dict], None], tags: dict, r: dict) -> None:
    on_round({**tags, **r})


def _duplex_gbps(s: Setup, load: TransferPlan, back: TransferPlan, rounds: int, calls: int = 8) -> float:
    """Both directions' bytes over the window from their common start to the later end.

    As the transfer bench times its calls, the load stream is held by a GPU sleep while the
    host issues every call, and the backup stream waits for the same start: the window holds
    the transfers, not the host's cost of issuing them.
    """
    other = torch.cuda.Stream(s.dev.device)
    host, dev = s.host, s.dev

    def once() -> float:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        with torch.cuda.stream(s.stream):
            torch.cuda._sleep(DUPLEX_HOLD_CYCLES)
        start.record(s.stream)
        other.wait_event(start)
        for _ in range(calls):
            load_layer(load, host, dev, 0, s.stream)
            backup(back, dev, host, [0], other)
        ends[0].record(s.stream)
        ends[1].record(other)
        torch.cuda.synchronize()
        seconds = max(start.elapsed_time(end) for end in ends) / 1e3
        return 2 * calls * s.layer_bytes / seconds / 1e9

    once()
    return statistics.median(once() for _ in range(rounds))


class _MatmulLoop:
    """A bf16 `n x n` matmul loop on a compute stream of its own, timed with or without reloads beside it."""

    def __init__(self, s: Setup, load: TransferPlan, on_round: Callable[[dict], None] | None, n: int = 8192):
        gen = torch.Generator(device=s.dev.device).manual_seed(0)
        self.a = torch.randn(n, n, device=s.dev.device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(n, n, device=s.dev.device, dtype=torch.bfloat16, generator=gen)
        self.c = torch.empty_like(self.a)
        self.compute = torch.cuda.Stream(s.dev.device)
        self.s, self.load, self.on_round, self.n = s, load, on_round, n

    def flops(self, matmuls: int) -> int:
        return 2 * self.n**3 * matmuls

    def seconds(
        self, with_reload: bool, matmuls: int, per_matmul_s: float, lead: int = 0
    ) -> tuple[float, float]:
        """Seconds of the last `matmuls` of `lead + matmuls`, and the reloads' GB/s beside them.

        The reloads are sized at the ceiling to last through the lead-in and ~90% of the
        timed matmuls (longer where they run slower), and issued interleaved with the
        matmuls in `CHUNKS` steps: the host blocks once a stream's queue is full, so issuing
        either all first would start the other late, and the reloads would cover only part
        of the timed window.
        """
        s = self.s
        torch.cuda.synchronize()
        t0 = time.time()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        lstart, lend = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reloads = 0
        if with_reload:
            gbps = s.ceilings[Direction.LOAD]
            reloads = max(1, int((lead + 0.9 * matmuls) * per_matmul_s * gbps * 1e9 / s.layer_bytes))
            lstart.record(s.stream)

        def matmul(i: int) -> None:
            if i == lead:
                start.record(self.compute)
            with torch.cuda.stream(self.compute):
                torch.mm(self.a, self.b, out=self.c)

        interleave(lead + matmuls, reloads, lambda: load_layer(self.load, s.host, s.dev, 0, s.stream), matmul)
        end.record(self.compute)
        if with_reload:
            lend.record(s.stream)
        torch.cuda.synchronize()
        mm_s = start.elapsed_time(end) / 1e3
        reload_gbps = (
            reloads * s.layer_bytes / (lstart.elapsed_time(lend) / 1e3) / 1e9 if with_reload else 0.0
        )
        if self.on_round is not None:
            tflops = self.flops(matmuls) / mm_s / 1e12
            self.on_round(
                {
                    "reload": with_reload,
                    "start": t0,
                    "end": time.time(),
                    "tflops": tflops,
                    "gbps": reload_gbps,
                }
            )
        return mm_s, reload_gbps


def _interference(
    s: Setup,
    load: TransferPlan,
    rounds: int,
    round_s: float = ROUND_S,
    on_round: Callable[[dict], None] | None = None,
) -> tuple[float, float, float, float]:
    """Medians of `(matmul TFLOP/s alone, beside the reload, reload GB/s, share of the rate kept)`.

    Each round runs the matmul loop for about `LEAD_S` + `round_s` seconds, alone or with
    reloads queued beside it for as long, and times its last `round_s` seconds: the GPU's
    clock and temperature follow the round's load for a few seconds (bench/FINDINGS.md), so
    each round's own conditions are measured, not its predecessor's. Rounds alternate,
    and each round with the reload is compared with the rounds alone on either side of it.
    """
    loop = _MatmulLoop(s, load, on_round)
    per_matmul = loop.seconds(False, 20, 0.0)[0] / 20
    matmuls = max(20, int(round_s / per_matmul))
    warm = settle(lambda: loop.seconds(False, matmuls, per_matmul)[0])
    # The first 20 matmuls ran cold and short: size the rounds from the settled ones.
    per_matmul = warm[-1] / matmuls
    matmuls = max(20, int(round_s / per_matmul))
    lead = int(LEAD_S / per_matmul)
    flops = loop.flops(matmuls)
    loop.seconds(True, matmuls, per_matmul, lead)

    def alone_tflops() -> float:
        return flops / loop.seconds(False, matmuls, per_matmul, lead)[0] / 1e12

    # alone, beside, alone, beside, ..., alone: each round with the reload against the mean
    # of the rounds alone on either side of it, so a slow drift of the clock cancels.
    alone, beside, reload, kept = [alone_tflops()], [], [], []
    for _ in range(rounds):
        mm, gbps = loop.seconds(True, matmuls, per_matmul, lead)
        beside.append(flops / mm / 1e12)
        reload.append(gbps)
        alone.append(alone_tflops())
        kept.append(beside[-1] / ((alone[-2] + alone[-1]) / 2))
    med = statistics.median
    return med(alone), med(beside), med(reload), med(kept)


def interleave(
    matmuls: int,
    reloads: int,
    reload: Callable[[], None],
    matmul: Callable[[int], None],
    chunks: int = CHUNKS,
) -> None:
    """Issue `reloads` calls of `reload()` and `matmuls` of `matmul(i)` (i = 0, 1, ...) in `chunks`
    steps, each step the reloads' share of it first, so both streams' queues are fed together."""
    done_mm = done_rl = 0
    for k in range(1, chunks + 1):
        while done_rl < reloads * k // chunks:
            reload()
            done_rl += 1
        while done_mm < matmuls * k // chunks:
            matmul(done_mm)
            done_mm += 1


def settle(round_seconds: Callable[[], float]) -> list[float]:
    """Run rounds alone (`round_seconds()` runs one, returns its seconds) until their rate settles.

    At least `WARM_S` seconds and until the mean of the last three rounds is within `SETTLED`
    of the three before them, at most `SETTLE_S` seconds. Returns the rounds' seconds.
    """
    out: list[float] = []
    while sum(out) < SETTLE_S:
        out.append(round_seconds())
        if sum(out) >= WARM_S and len(out) >= 6:
            last, before = statistics.mean(out[-3:]), statistics.mean(out[-6:-3])
            if abs(last - before) <= SETTLED * before:
                break
    return out


def render(rows: list[OverlapRow], meta: dict) -> Table:
    """The table `kvtier bench overlap` prints: each test's value against its reference."""
    table = Table(title=f"{meta['spec']}, {meta['tokens']} tokens per layer call, on {meta.get('gpu')}")
    for col in ("test", "mechanism", "SMs", "value", "against", "ratio"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.test, r.mechanism, str(r.sms), f"{r.value:.1f} {r.unit}", f"{r.reference:.1f}", f"{r.ratio:.3f}"
        )
    return table
