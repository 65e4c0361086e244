"""The worker side of the connector: vLLM's KV blocks, kvtier's host pool, and storage.

`BlockViews` wraps the per-layer tensors vLLM registers without copying: each becomes one or two
`[num_blocks, bytes]` uint8 views (a block's bytes of that layer; two where K and V sit in
separate halves, as vLLM's CUDA layout `[2, num_blocks, ...]` has them). A block is moved as
opaque bytes, so any element order works (vLLM's CPU layout interleaves K and V per ISA).

`HostBlocks` is the host pool: `rows.HostRows`, one row of `block_bytes` per slot holding every
layer's bytes of one vLLM block in `BlockViews` order (pinned in chunks where the KV is on a GPU).
On a GPU kvtier's row kernel moves blocks between the pinned rows and vLLM's tensors
(`rows.BlockRows`): loads layer by layer on a stream of their own, each layer's end an event
`wait_for_layer_load` waits on; saves on another stream after the layer's attention. Every use
across streams is ordered by an event, and the host waits only where the CPU touches the rows (a
page written to or read from storage):

- a load starts after the current stream's work (vLLM may still write the blocks it fills) and
  after the last save (the rows it reads are whole); a background fetch, after the current
  stream's work as of the step that submitted it (`mark`);
- the current stream waits for a step's saves at its end (`fence_saves`, no host wait), so a block
  vLLM frees and rewrites is read by its save first;
- the CPU writes a row (a page read from storage) only once no load reads the rows and no save
  writes them.

The row kernel is checked once when the pool is made (a save of block 0 against an index copy;
Triton compiles then, not in a step); where it fails, and without Triton or on vLLM's CPU build,
blocks move by index copies through the CPU.

A row is one storage page: `kvtier.storage.values.PageCodec` writes it with its fingerprint and
checksum and refuses any value that does not match on the way back (a refused page is a failed
load, never KV).
Writes to storage go through one background thread; a slow or failing store drops writes
(counted), never blocks a step. MLA's latent is the same on every tensor-parallel rank: its pages
are named once for all ranks and written by rank 0 alone (`config.rank_identity`). Requests whose
pages are in storage are loaded outside the steps by `fetches.Fetches`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.rows import BlockRows, HostRows
from kvtier.integrations.vllm.scheduler import Load
from kvtier.pool.host import DEFAULT_CHUNK_BYTES
from kvtier.storage.backend import StorageBackend
from kvtier.storage.keys import PageKeys
from kvtier.storage.values import PageCodec
from kvtier.transfer import kernels
from kvtier.transfer.plan import Uploader

log = logging.getLogger(__name__)


def byte_views(tensor: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """`tensor`'s blocks as `[num_blocks, bytes]` uint8 views: dim 0 when it has `num_blocks`
    entries, else dim 1 of each half of a `[2, num_blocks, ...]` tensor (K, V)."""
    if not tensor.is_contiguous():
        raise ConfigError(f"a KV tensor of shape {tuple(tensor.shape)} is not contiguous")
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    if tensor.shape[0] == num_blocks:
        return [raw.reshape(num_blocks, -1)]
    if tensor.dim() > 1 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
        return [half.reshape(num_blocks, -1) for half in raw.reshape(2, num_blocks, -1)]
    raise ConfigError(f"no block dimension of {num_blocks} in a KV tensor of shape {tuple(tensor.shape)}")


class BlockViews:
    """Every registered layer's blocks as byte views, in registration order.

    `views[name]`: the layer's `[num_blocks, n_i]` views; `offsets[name]`: where each starts in a
    host row; `block_bytes`: a host row's length (all layers of one block).
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ConfigError("vLLM registered no KV tensors")
        self.views: dict[str, list[torch.Tensor]] = {}
        self.offsets: dict[str, list[int]] = {}
        at = 0
        for name, tensor in kv_caches.items():
            views = byte_views(tensor, num_blocks)
            self.views[name], self.offsets[name] = views, []
            for v in views:
                self.offsets[name].append(at)
                at += v.shape[1]
        self.block_bytes = at
        self.device = next(iter(kv_caches.values())).device


def checked_kernel(views: BlockViews, rows: HostRows) -> BlockRows | None:
    """The row kernel between `views` and `rows`, where a save of block 0 through it into host slot
    0 writes the bytes of an index copy; else None (logged): blocks then move by index copies."""
    try:
        kernel = BlockRows(views, rows)
        zero = np.zeros(1, dtype=np.int64)
        launches = kernel.prepare(zero, zero, False, Uploader(views.device, None))
        for name in views.views:
            kernel.run(name, launches, False)
        if views.device.type == "cuda":
            torch.cuda.current_stream(views.device).synchronize()
        want = torch.cat([v[0].cpu() for vs in views.views.values() for v in vs])
        if torch.equal(rows.row(0), want):
            return kernel
        why = "its bytes differ from an index copy's"
    except Exception as e:  # (Triton cannot compile or launch here)
        why = f"{type(e).__name__}: {e}"
    log.warning("kvtier connector: the row kernel failed its check (%s); blocks move by index copies", why)
    return None


class HostBlocks:
    """The host pool and the moves between it, vLLM's blocks and storage (see the module docstring)."""

    def __init__(
        self,
        views: BlockViews,
        slots: int,
        keys: PageKeys,
        backend: StorageBackend | None = None,
        max_pending_writes: int = 4096,
        store: bool = True,
        kernel: bool | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.views, self.keys, self.backend = views, keys, backend
        cuda = views.device.type == "cuda"
        self.rows = HostRows(slots, views.block_bytes, keys.page_size, cuda, chunk_bytes)
        # The row kernel moves blocks where it runs (default: on CUDA; `kernel=True` under Triton's
        # interpreter in tests); else index copies through the CPU.
        use = kernels.runs_on(views.device) and (cuda if kernel is None else kernel)
        self.kernel = checked_kernel(views, self.rows) if use else None
        log.info("kvtier connector: blocks move by %s", "the row kernel" if self.kernel else "index copies")
        self._save_stream: torch.cuda.Stream | None = None
        self._fetch_stream: torch.cuda.Stream | None = None
        self._saves: tuple[tuple[int, ...], tuple[int, ...], dict] | None = None  # the step's launches
        # Events are published once recorded: a thread that reads one never waits on an unrecorded one.
        self._saved: torch.cuda.Event | None = None  # after the last save's copies
        self._loads_end: torch.cuda.Event | None = None  # after the last in-step load's copies
        self.codec = PageCodec(self.rows.pool.spec, keys.fingerprint)  # a page is one host row
        self.counts = {"loaded": 0, "saved": 0, "stored": 0, "store_failed": 0, "store_dropped": 0}
        self.counts |= {"storage_read": 0, "storage_rejected": 0}
        self._stream: torch.cuda.Stream | None = None
        self.bad: set[int] = set()  # slots whose last save failed: not loaded from
        self._loaded: dict[str, torch.cuda.Event] = {}
        self._writes: queue.Queue = queue.Queue(maxsize=max(1, max_pending_writes))
        self._writer: threading.Thread | None = None
        if backend is not None and store:  # (`store` False: another rank writes these pages)
            self._writer = threading.Thread(
                target=self._write_loop, args=(backend,), name="kvtier-vllm-store", daemon=True
            )
            self._writer.start()

    # -- host <-> vLLM blocks ---------------------------------------------------------

    def loadable(self, load: Load) -> bool:
        """Whether `load`'s slot can fill its block: a slot was given (-1: none was free), its last
        save did not fail, and a page from storage arrived in it whole (read here)."""
        if load.slot < 0 or load.slot in self.bad:
            return False
        return not load.from_storage or self.read(load.slot, load.page_hash)

    def mark(self) -> torch.cuda.Event | None:
        """An event after the current stream's work so far (on a GPU; else None), for a fetch that
        starts later on another thread: the blocks it fills are vLLM's to write until then."""
        if self.views.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.views.device))
        return event

    def load(
        self,
        blocks: Sequence[int],
        slots: Sequence[int],
        wait: bool = False,
        after: torch.cuda.Event | None = None,
    ) -> None:
        """vLLM blocks `blocks[i]` <- host slots `slots[i]`, every layer. On a GPU they move on a
        stream of the pool's after the last save, layer by layer: in a step, after the current
        stream's work, each layer's end recorded (`wait_layer`); where `wait` (a background fetch),
        after `after` (`mark`, taken in the step that submitted it), and this thread waits for them.
        Elsewhere they are done when this returns."""
        if not blocks:
            return
        device = self.views.device
        if device.type != "cuda":
            self._load_layers(blocks, slots, record=False)
            self.counts["loaded"] += len(blocks)
            return
        if wait:
            stream = self._fetch_stream = self._fetch_stream or torch.cuda.Stream(device)
            if after is not None:
                stream.wait_event(after)  # vLLM's work on these blocks before they were handed over
        else:
            stream = self._stream = self._stream or torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the blocks are free to write
        saved = self._saved
        if saved is not None:
            stream.wait_event(saved)  # the host rows are whole
        with torch.cuda.stream(stream):
            self._load_layers(blocks, slots, record=not wait)
        if wait:
            stream.synchronize()
        else:
            end = torch.cuda.Event()
            end.record(stream)
            self._loads_end = end
        self.counts["loaded"] += len(blocks)

    def _load_layers(self, blocks: Sequence[int], slots: Sequence[int], record: bool) -> None:
        """Every layer in order on the current stream: by the row kernel, else by index copies of the
        gathered rows (uploaded to the device); `record`: an event after each layer."""
        upload = Uploader(self.views.device, None)
        if self.kernel is not None:
            launches = self.kernel.prepare(np.asarray(blocks), np.asarray(slots), True, upload)
        else:
            b = upload(torch.tensor(blocks, dtype=torch.int64))
            rows = upload(self.rows.gather(slots))
        for name, views in self.views.views.items():
            if self.kernel is not None:
                self.kernel.run(name, launches, True)
            else:
                for v, at in zip(views, self.views.offsets[name], strict=True):
                    v.index_copy_(0, b, rows[:, at : at + v.shape[1]])
            if record:
                event = self._loaded[name] = torch.cuda.Event()
                event.record()

    def wait_layer(self, name: str) -> None:
        """Make the current stream wait for layer `name`'s loads (no host wait; nothing on the CPU)."""
        event = self._loaded.pop(name, None)
        if event is not None:
            torch.cuda.current_stream(self.views.device).wait_event(event)

    def save_layer(self, name: str, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Host slots `slots[i]` <- vLLM blocks `blocks[i]`, layer `name` only. With the row kernel on
        a GPU it runs on a stream of the pool's after the current stream's work (the layer's KV) and
        nothing waits: `saved()` waits for every save so far. The blocks and slots of a step's layers
        are the same: their launches are shaped once."""
        if not blocks:
            return
        device = self.views.device
        if self.kernel is None:
            b = torch.tensor(blocks, dtype=torch.int64, device=device)
            for v, at in zip(self.views.views[name], self.views.offsets[name], strict=True):
                # `.cpu()` waits for the layer's attention on a GPU: the host row is complete after it.
                got = v.index_select(0, b).cpu()
                for i, s in enumerate(slots):
                    self.rows.row(s)[at : at + v.shape[1]] = got[i]
            return
        key = (tuple(blocks), tuple(slots))
        if device.type != "cuda":  # Triton's interpreter (tests)
            self.kernel.run(name, self._save_launches(key), False)
            return
        stream = self._save_stream = self._save_stream or torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.kernel.run(name, self._save_launches(key), False)
        saved = torch.cuda.Event()
        saved.record(stream)
        self._saved = saved

    def _save_launches(self, key: tuple[tuple[int, ...], tuple[int, ...]]) -> dict:
        """The launches of a save of `key` (blocks, slots), shaped on the first layer of a step (their
        offsets uploaded on the current stream)."""
        if self._saves is None or self._saves[:2] != key:
            blocks, slots = (np.asarray(k, dtype=np.int64) for k in key)
            upload = Uploader(self.views.device, None)
            self._saves = (*key, self.kernel.prepare(blocks, slots, False, upload))
        return self._saves[2]

    def saved(self) -> None:
        """Wait until the host rows hold every save submitted so far (before reading them on the CPU)."""
        saved = self._saved
        if saved is not None:
            saved.synchronize()

    def fence_saves(self) -> None:
        """Make the current stream wait for every save so far (no host wait): whatever vLLM writes
        next into the saved blocks, once it frees them, comes after the saves read them."""
        saved = self._saved
        if saved is not None:
            torch.cuda.current_stream(self.views.device).wait_event(saved)

    # -- host <-> storage -------------------------------------------------------------

    def read(self, slot: int, page_hash: bytes) -> bool:
        """Host slot `slot` <- storage page `page_hash`; False (the slot's bytes undefined) where the
        page is absent, unreadable or refused by its checks."""
        if self.backend is None:
            return False
        self.saved()  # no save still writes the slot
        loads_end = self._loads_end
        if loads_end is not None:
            loads_end.synchronize()  # no load of an earlier step still reads it
        self.counts["storage_read"] += 1
        buffers = self.codec.read_buffers([memoryview(self.rows.row(slot).numpy())])
        try:
            (length,) = self.backend.get_into([self.keys.key(page_hash)], [buffers])
        except Exception as e:  # a storage fault is a miss
            log.warning("kvtier: storage read failed (%s); the block is recomputed", e)
            return False
        why = self.codec.check(page_hash, length, buffers)  # (`ABSENT` for -1 of a key with no value)
        if why is not None:
            self.counts["storage_rejected"] += 1
            log.info(
                "kvtier: storage page %s refused (%s); the block is recomputed", page_hash.hex()[:16], why
            )
            return False
        return True

    def store(self, slot: int, page_hash: bytes) -> None:
        """Queue host slot `slot`'s page for storage (a copy: the slot may be reused at once); nothing
        where this worker writes no storage (none, or another rank writes these pages)."""
        if self._writer is None:
            return
        self.saved()
        try:
            self._writes.put_nowait((page_hash, self.rows.row(slot).numpy().tobytes()))
        except queue.Full:
            self.counts["store_dropped"] += 1

    @property
    def pending_writes(self) -> int:
        """Pages queued for storage or being written."""
        return self._writes.unfinished_tasks

    def flush(self) -> None:
        """Wait until every queued write has been attempted."""
        if self._writer is not None:
            self._writes.join()

    def close(self) -> None:
        self.saved()  # no kernel still writes the rows
        if self._writer is not None:
            self.flush()
            self._writes.put(None)
            self._writer.join(timeout=10)
            self._writer = None
        if self.backend is not None:
            self.backend.close()
        self.rows.close()

    def _write_loop(self, backend: StorageBackend) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                page_hash, data = item
                chunks = self.codec.encode(page_hash, [memoryview(data)])
                (ok,) = backend.put([self.keys.key(page_hash)], [chunks])
                self.counts["stored" if ok else "store_failed"] += 1
            except Exception as e:  # counted and logged; the thread goes on
                self.counts["store_failed"] += 1
                log.warning("kvtier: storage write failed (%s)", e)
            finally:
                self._writes.task_done()
