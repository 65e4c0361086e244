"""Loads that run outside vLLM's steps: a request whose pages are in storage waits in vLLM's queue
while one thread reads its pages into host slots and fills its blocks (`HostBlocks.load` with
`wait`), then reports it done (vLLM's asynchronous load: `get_finished`)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import torch

from kvtier.integrations.vllm.blocks import HostBlocks
from kvtier.integrations.vllm.scheduler import Load

log = logging.getLogger(__name__)


class Fetches:
    """Loads that run in the background (a request with pages in storage): one thread reads each
    request's pages into their host slots and fills its vLLM blocks, then marks it done. `take()`
    gives the requests done since the last call and the blocks that failed among them; a block's
    failure is recorded before its request is marked done."""

    def __init__(self, host: HostBlocks) -> None:
        self.host = host
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[int] = set()
        self.in_flight = 0  # requests submitted and not done yet
        names = ("host_hit_blocks", "storage_hit_blocks", "load_failed_blocks", "loaded_bytes")
        self.counts = dict.fromkeys(names, 0)
        self._thread = threading.Thread(target=self._loop, name="kvtier-vllm-fetch", daemon=True)
        self._thread.start()

    def submit(self, req_id: str, loads: Sequence[Load], after: torch.cuda.Event | None = None) -> None:
        """Fetch `loads` for `req_id` in the background, their blocks filled after `after`
        (`HostBlocks.mark`)."""
        with self._lock:
            self.in_flight += 1
        self._jobs.put((req_id, list(loads), after))

    def untaken(self) -> int:
        """Requests done whose end `take()` has not given yet."""
        with self._lock:
            return len(self._done)

    def take(self) -> tuple[set[str], set[int]]:
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            req_id, loads, after = job
            failed: set[int] = set()
            try:
                blocks, slots = [], []
                for load in loads:
                    if not self.host.loadable(load):
                        failed.add(load.block)
                        continue
                    blocks.append(load.block)
                    slots.append(load.slot)
                    self.counts["storage_hit_blocks" if load.from_storage else "host_hit_blocks"] += 1
                self.host.load(blocks, slots, wait=True, after=after)
                self.counts["loaded_bytes"] += len(blocks) * self.host.views.block_bytes
            except Exception as e:  # every block of the request fails; the thread goes on
                log.warning("kvtier: a background load failed (%s); its blocks are recomputed", e)
                failed |= {load.block for load in loads}
            self.counts["load_failed_blocks"] += len(failed)
            with self._lock:
                self._failed |= failed
                self._done.add(req_id)
                self.in_flight -= 1
