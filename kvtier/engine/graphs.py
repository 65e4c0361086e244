"""CUDA graphs of decode-only steps: the whole forward captured once per batch-size bucket.

A decode-only step of `B` requests (no prefill piece, no pending load) runs as the replay of
the graph of the smallest bucket `>= B` (`BUCKETS`, capped at the engine's `max_num_seqs`).
The graph's inputs are static device buffers (`StepLayout`): the tokens' ids, positions and
write slots, and the decodes' slot tables and lengths. Before each replay the step's values
are copied into them (one pinned copy the host does not wait for, then device copies);
the rows past `B` are padding: slot -1 (written nowhere), length 0 (attends to nothing, its
logits ignored). The table's width is the graph's: a step whose longest context is wider
captures its bucket again at the next power of two (widths only grow, so a bucket is captured
a few times over a long run at most).

Capture: the first step of a bucket (or a wider one) runs the forward once eagerly on the
static buffers (Triton compiles, the step's rows are written), then captures it, then replays
it (writing the same rows again). Every graph shares one memory pool; steps run one at a time.
A model whose forward cannot be captured (a host read in it, e.g. a mixture of experts that
picks its experts on the host) turns graphs off for the engine, logged once, and runs eager.

Mixed steps (decodes beside prefill pieces) run eagerly as one forward: the prefill's matmuls
read the weights anyway and hide the launch costs, where a separate replay for the decodes
would read every weight a second time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.engine import paged
from kvtier.engine.hostio import host_buffer, to_device
from kvtier.engine.paged_step import HostLayout, PagedStep, StepLayout
from kvtier.errors import InvariantError
from kvtier.pool import DevicePool
from kvtier.spec import KVSpec

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)
# The narrowest slot table a graph is captured with (wider steps capture again at powers of two).
MIN_WIDTH = 256

Forward = Callable[[PagedStep], torch.Tensor]  # a step's forward: `[R, V]` logits of its last tokens


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: `BUCKETS` below `max_batch`, and `max_batch`."""
    return (*(b for b in BUCKETS if b < max_batch), max_batch)


@dataclass
class _Graph:
    """One captured bucket: its static inputs (`static_layout`), its step, the graph and its logits
    `[bucket, V]`."""

    head: torch.Tensor
    layout: StepLayout
    step: PagedStep
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    width: int


class DecodeGraphs:
    """The decode graphs of one engine; see the module docstring.

    `forward`: runs a `PagedStep`'s forward (the runner's); `groups`: `(kv heads, query heads
    per kv head)` of the model, for the decode kernel's split count.
    """

    def __init__(
        self,
        spec: KVSpec,
        pool: DevicePool,
        windows: Sequence[int | None],
        forward: Forward,
        max_batch: int,
        groups: tuple[int, int],
    ) -> None:
        if pool.device.type != "cuda":
            raise InvariantError(f"CUDA graphs need a CUDA device pool, not {pool.device}")
        self.spec, self.pool, self.windows, self.forward = spec, pool, tuple(windows), forward
        self.buckets = buckets_up_to(max_batch)
        self.groups = groups
        self.sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
        self.enabled = True
        self.captures = 0
        self._graphs: dict[int, _Graph] = {}
        self._mempool = torch.cuda.graph_pool_handle()

    def takes(self, host: HostLayout, loads: int) -> bool:
        """Whether a step of this layout with `loads` pending loads runs as a replay."""
        return (
            self.enabled
            and host.decode_only
            and not loads
            and host.arrays["dec_lens"].size <= self.buckets[-1]
        )

    def run(self, host: HostLayout) -> torch.Tensor | None:
        """`[B, V]` logits of the step (a view of the graph's output, valid until the next replay),
        or None where capture failed (graphs are then off: run the step eagerly)."""
        b = host.arrays["dec_lens"].size
        bucket = next(x for x in self.buckets if x >= b)
        width = host.arrays["dec_table"].shape[1]
        g = self._graphs.get(bucket)
        if g is None or g.width < width:
            g = self._capture(bucket, max(MIN_WIDTH, paged.next_power_of_2(width)), host)
            if g is None:
                return None
        else:
            fill(g.head, g.layout, host)
            g.graph.replay()
        return g.logits[:b]

    def _capture(self, bucket: int, width: int, host: HostLayout) -> _Graph | None:
        dev = self.pool.device
        head, layout = static_layout(bucket, width, dev)
        hkv, group = self.groups
        programs = bucket * hkv * -(-group // 64)
        splits = paged.decode_splits(programs, width, paged.decode_block(128), self.sms)
        step = PagedStep(self.spec, self.pool, layout, self.windows, (), splits)
        fill(head, layout, host)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # the warm-up forward: compiles, writes the step's rows
            self.forward(step)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._mempool):
                logits = self.forward(step)
        except Exception as e:  # a forward with a host read in it cannot be captured
            log.warning(
                "decode steps run eagerly: the model's forward cannot be captured in a CUDA graph (%s)", e
            )
            self.enabled = False
            self._graphs.clear()
            torch.cuda.synchronize(
                dev
            )  # (a failed capture leaves its stream in a state no one should add to)
            return None
        graph.replay()
        self.captures += 1
        log.info(
            "captured the decode graph of %d requests, tables of %d slots, %d splits", bucket, width, splits
        )
        self._graphs[bucket] = g = _Graph(head, layout, step, graph, logits, width)
        return g


def static_layout(bucket: int, width: int, device: torch.device) -> tuple[torch.Tensor, StepLayout]:
    """A graph's static buffers for `bucket` decodes of tables up to `width` slots, all padding.

    Returns `head` `[4, bucket]` int64, whose rows are the layout's `ids`, `positions`, `write`
    and `dec_lens` (views: one copy refills the four), and the layout (`dec_table` `[bucket, width]`).
    """
    head = torch.zeros(4, bucket, dtype=torch.int64, device=device)
    head[2].fill_(-1)
    none = torch.zeros(0, dtype=torch.int64, device=device)
    layout = StepLayout(
        ids=head[0],
        positions=head[1],
        write=head[2],
        last=torch.arange(bucket, device=device),
        dec_table=torch.full((bucket, width), -1, dtype=torch.int64, device=device),
        dec_lens=head[3],
        pf_table=torch.zeros(0, 0, dtype=torch.int64, device=device),
        pf_lens=none,
        pf_news=none.clone(),
        pf_starts=none.clone(),
        max_new=0,
    )
    return head, layout


def staged_inputs(host: HostLayout, bucket: int, device: torch.device) -> torch.Tensor:
    """`[4 * bucket + B * W]` int64 on the host (pinned for CUDA, `host_buffer`): a decode-only step's
    `head` rows (`static_layout`), its rows past `B` padding (id 0, position 0, slot -1, length 0),
    then its `[B, W]` slot table."""
    a = host.arrays
    b, w = a["dec_table"].shape
    buf = host_buffer(4 * bucket + b * w, device)
    out = buf.numpy()
    head = out[: 4 * bucket].reshape(4, bucket)
    head[0, :b], head[1, :b], head[2, :b], head[3, :b] = a["ids"], a["positions"], a["write"], a["dec_lens"]
    head[:, b:] = _PADDING
    out[4 * bucket :] = a["dec_table"].reshape(-1)
    return buf


_PADDING = np.array([[0], [0], [-1], [0]], np.int64)  # a padding row's id, position, slot, length


def fill(head: torch.Tensor, layout: StepLayout, host: HostLayout) -> None:
    """Copy a decode-only step's arrays into a graph's static buffers: one pinned copy to the
    device, then two device copies (the four `head` rows at once, the table's `[B, W]` corner)."""
    bucket = head.shape[1]
    b, w = host.arrays["dec_table"].shape
    staged = to_device(staged_inputs(host, bucket, head.device), head.device)
    head.copy_(staged[: 4 * bucket].view(4, bucket))
    layout.dec_table[:b, :w].copy_(staged[4 * bucket :].view(b, w))
