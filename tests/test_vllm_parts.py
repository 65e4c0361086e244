"""The parts of kvtier's vLLM connector that need no vLLM: the options, the scheduler's page
index and plans, and the worker's host pool with a real file store (byte-identical moves into
poisoned blocks, damaged pages refused)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError, SlotError
from kvtier.integrations.vllm.blocks import BlockViews, HostBlocks, byte_views
from kvtier.integrations.vllm.config import ConnectorConfig, rank_identity
from kvtier.integrations.vllm.scheduler import ConnectorScheduler, HostIndex
from kvtier.storage.backend import open_backend
from kvtier.storage.keys import Fingerprint, PageKeys

BS = 4
KEYS = PageKeys(Fingerprint(b"f" * 16), BS)


def all_rows(host: HostBlocks) -> torch.Tensor:
    """`[slots, block_bytes]`: a copy of every host row."""
    return host.rows.gather(range(host.rows.slots))


def fill_rows(host: HostBlocks, value: int) -> None:
    for s in range(host.rows.slots):
        host.rows.row(s).fill_(value)


def copy_rows(dst: HostBlocks, src: HostBlocks) -> None:
    for s in range(src.rows.slots):
        dst.rows.row(s).copy_(src.rows.row(s))


def test_options_are_checked_before_anything_starts() -> None:
    assert ConnectorConfig.from_extra(None) == ConnectorConfig()
    assert ConnectorConfig.from_extra({"host_gb": 2, "storage": "file:///tmp/x"}).host_gb == 2.0
    for bad in (
        {"host_gb": 0},
        {"host_gb": True},
        {"storage": ""},
        {"hostgb": 1},
        {"max_pending_writes": -1},
    ):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra(bad)


def test_the_host_index_reuses_the_least_recently_used_slot_not_busy() -> None:
    index = HostIndex(2)
    a, b = index.take(set()), index.take(set())
    index.put(b"a", a)
    index.put(b"b", b)
    index.touch(b"a")  # b is now the least recently used
    assert index.take(set()) == b and b"b" not in index and index.evictions == 1
    assert index.take({a}) is None  # the only indexed slot is busy
    with pytest.raises(ConfigError):
        HostIndex(0)


class Tokens(dict):
    def __call__(self, req_id: str) -> list[int]:
        return self[req_id]


def test_the_scheduler_saves_completed_blocks_and_answers_whole_blocks_before_the_last_token() -> None:
    tokens = Tokens(r1=list(range(14)), r2=[*range(14), 99])
    sched = ConnectorScheduler(BS, 8, KEYS, tokens)
    assert sched.match("r1", 0) == (0, False)
    sched.scheduled("r1", [10, 11, 12, 13], True, 14)  # the prefill: 3 whole blocks of 14 tokens
    plan = sched.take_plan()
    assert [(s.block, s.store) for s in plan.saves] == [(10, False), (11, False), (12, False)]
    # The same first 14 tokens: 3 blocks held, but the block of the last prompt token is computed.
    assert sched.match("r2", 0) == (12, False)  # on the host: loaded in the step
    assert sched.match("r2", 4) == (8, False)  # vLLM's own cache had the first block
    sched.allocated("r2", [20, 21, 22, 23], 8)
    plan = sched.take_plan()
    assert [(ld.block, ld.from_storage) for ld in plan.loads] == [(21, False), (22, False)]
    assert {ld.slot for ld in plan.loads} == {s.slot for s in sched_saved(sched, [1, 2], tokens)}


def sched_saved(sched: ConnectorScheduler, blocks: list[int], tokens: Tokens):
    class S:
        def __init__(self, slot: int) -> None:
            self.slot = slot

    hashes = KEYS.chain(KEYS.root, np.array(tokens["r1"][:12]))
    return [S(sched.index.slot(hashes[b])) for b in blocks]


def test_storage_hits_are_fetched_in_the_background_their_slots_held_until_done() -> None:
    tokens = Tokens(r=list(range(9)), q=list(range(100, 109)))
    stored_keys: list[list[str]] = []

    def stored(keys: list[str]) -> int:
        stored_keys.append(keys)
        return len(keys)

    sched = ConnectorScheduler(BS, 4, KEYS, tokens, stored)
    assert sched.match("r", 0) == (8, True)  # from storage: asynchronous
    assert stored_keys == [KEYS.keys(KEYS.chain(KEYS.root, np.arange(8)))]
    sched.allocated("r", [5, 6, 7], 8)
    plan = sched.take_plan()
    (fetch,) = plan.fetches.values()
    assert not plan.loads and [ld.block for ld in fetch] == [5, 6]
    assert all(ld.from_storage and ld.slot >= 0 for ld in fetch)
    staged = {ld.slot for ld in fetch}
    # While the fetch runs, another request's saves never take its staging slots.
    sched.scheduled("q", [1, 2, 3], True, 9)
    plan = sched.take_plan()
    assert len(plan.saves) == 2 and staged.isdisjoint({sv.slot for sv in plan.saves})
    sched.fetched(["r"])
    # The fetched pages stay in their slots, on the host now: the request saves nothing, and the
    # same tokens are a host hit (loaded in the step) for the next request.
    sched.scheduled("r", [5, 6, 7], True, 9)
    assert not sched.take_plan().saves
    assert {sched.index.slot(h) for h in KEYS.chain(KEYS.root, np.arange(8))} == staged
    tokens["s"] = list(range(9))
    assert sched.match("s", 0) == (8, False)
    assert len(sched.index) == 4


def test_a_page_that_failed_to_load_never_joins_the_host_index() -> None:
    tokens = Tokens(r=list(range(9)))
    sched = ConnectorScheduler(BS, 4, KEYS, tokens, lambda keys: len(keys))
    assert sched.match("r", 0) == (8, True)
    sched.allocated("r", [5, 6, 7], 8)
    (fetch,) = sched.take_plan().fetches.values()
    sched.fetched(["r"], {6})  # vLLM block 6's page was refused
    first, second = KEYS.chain(KEYS.root, np.arange(8))
    assert sched.index.slot(first) == fetch[0].slot and second not in sched.index
    assert sched.index.free == 3 and len(sched.index) == 1


def test_a_fetch_with_no_free_slot_fails_its_block_instead_of_raising() -> None:
    tokens = Tokens(r=list(range(9)))
    sched = ConnectorScheduler(BS, 1, KEYS, tokens, lambda keys: len(keys))
    sched.match("r", 0)
    sched.allocated("r", [5, 6, 7], 8)
    (fetch,) = sched.take_plan().fetches.values()
    assert [ld.slot for ld in fetch] == [0, -1]  # the worker reports block 6 failed


def kv_layers(num_blocks: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Two layers in vLLM's CPU shape `[blocks, heads, block, 2 * head_dim]` and one in the CUDA
    shape `[2, blocks, block, heads, head_dim]`, random bf16."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return {
        "l0": rand(num_blocks, 2, BS, 16),
        "l1": rand(num_blocks, 2, BS, 16),
        "l2": rand(2, num_blocks, BS, 2, 8),
    }


def test_blocks_round_trip_through_host_and_storage_bit_for_bit(tmp_path) -> None:
    gen = torch.Generator().manual_seed(0)
    src = kv_layers(6, gen)
    views = BlockViews(src, 6)
    assert [len(v) for v in views.views.values()] == [1, 1, 2]
    backend = open_backend(f"file://{tmp_path}")
    host = HostBlocks(views, 4, KEYS, backend)
    pages = KEYS.chain(KEYS.root, np.arange(2 * BS))
    for name in src:
        host.save_layer(name, [1, 4], [0, 3])
    host.store(0, pages[0])
    host.store(3, pages[1])
    host.flush()
    assert host.counts["stored"] == 2
    # Another worker: its blocks poisoned, its host rows too.
    dst = {k: torch.full_like(v, float("nan")) for k, v in src.items()}
    other = HostBlocks(BlockViews(dst, 6), 4, KEYS, open_backend(f"file://{tmp_path}"))
    fill_rows(other, 0xA5)
    assert other.read(2, pages[1]) and other.read(1, pages[0])
    other.load([0, 5], [1, 2])
    for name in src:
        got, want = dst[name], src[name]
        if got.shape[0] == 2 and name == "l2":
            got, want = got.transpose(0, 1), want.transpose(0, 1)
        assert torch.equal(got[0].view(torch.int16), want[1].view(torch.int16))
        assert torch.equal(got[5].view(torch.int16), want[4].view(torch.int16))
        assert torch.isnan(got[2].float()).all()  # untouched
    host.close()
    other.close()


def test_mla_pages_are_named_once_and_written_by_rank_zero(tmp_path) -> None:
    """K/V split by heads: a page per rank, each rank writes; MLA: one name for every rank and any
    tensor-parallel size, rank 0 writes, the others read what it wrote."""
    assert rank_identity("FullAttentionSpec", 1, 2) == ([1, 2], True)
    assert rank_identity("MLAAttentionSpec", 0, 4) == ("replicated", True)
    assert rank_identity("MLAAttentionSpec", 3, 4) == ("replicated", False)
    assert rank_identity("MLAAttentionSpec", 0, 1)[0] == rank_identity("MLAAttentionSpec", 1, 8)[0]
    with pytest.raises(ConfigError, match="rank 2 of a tensor-parallel size 2"):
        rank_identity("FullAttentionSpec", 2, 2)
    gen = torch.Generator().manual_seed(3)
    src = {"mla": torch.randn(4, BS, 24, generator=gen).to(torch.bfloat16)}  # [blocks, block, latent]
    page = KEYS.chain(KEYS.root, np.arange(BS))[0]
    follower = HostBlocks(BlockViews(src, 4), 2, KEYS, open_backend(f"file://{tmp_path}"), store=False)
    follower.save_layer("mla", [1], [0])
    follower.store(0, page)
    follower.flush()
    assert follower.pending_writes == 0 and follower.counts["stored"] == 0
    assert not follower.read(1, page)  # the store holds nothing yet
    leader = HostBlocks(BlockViews(src, 4), 2, KEYS, open_backend(f"file://{tmp_path}"))
    leader.save_layer("mla", [1], [0])
    leader.store(0, page)
    leader.flush()
    assert leader.counts["stored"] == 1
    fill_rows(follower, 0xA5)
    assert follower.read(1, page)  # the follower reads the leader's page
    assert torch.equal(follower.rows.row(1), leader.rows.row(0))
    leader.close()
    follower.close()


def test_a_damaged_or_foreign_page_is_refused(tmp_path) -> None:
    gen = torch.Generator().manual_seed(1)
    src = kv_layers(3, gen)
    host = HostBlocks(BlockViews(src, 3), 2, KEYS, open_backend(f"file://{tmp_path}"))
    page = KEYS.chain(KEYS.root, np.arange(BS))[0]
    for name in src:
        host.save_layer(name, [0], [0])
    host.store(0, page)
    host.flush()
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file()]
    data = bytearray(path.read_bytes())
    data[-7] ^= 1
    path.write_bytes(bytes(data))
    assert not host.read(1, page) and host.counts["storage_rejected"] == 1
    foreign = PageKeys(Fingerprint(b"g" * 16), BS)
    assert not HostBlocks(BlockViews(src, 3), 2, foreign, open_backend(f"file://{tmp_path}")).read(0, page)
    host.close()


def test_tensors_without_a_block_dimension_are_refused() -> None:
    with pytest.raises(ConfigError, match="no block dimension"):
        byte_views(torch.zeros(3, 5), 4)
    with pytest.raises(ConfigError, match="contiguous"):
        byte_views(torch.zeros(4, 6)[:, ::2], 4)


def test_a_background_fetch_fills_blocks_and_reports_refused_pages(tmp_path) -> None:
    import time

    from kvtier.integrations.vllm.fetches import Fetches
    from kvtier.integrations.vllm.scheduler import Load

    gen = torch.Generator().manual_seed(2)
    src = kv_layers(4, gen)
    host = HostBlocks(BlockViews(src, 4), 4, KEYS, open_backend(f"file://{tmp_path}"))
    pages = KEYS.chain(KEYS.root, np.arange(2 * BS))
    for name in src:
        host.save_layer(name, [0, 1], [0, 1])
    host.store(0, pages[0])
    host.flush()  # page 1 never reaches storage
    dst = {k: torch.full_like(v, float("nan")) for k, v in src.items()}
    other = HostBlocks(BlockViews(dst, 4), 4, KEYS, open_backend(f"file://{tmp_path}"))
    fetches = Fetches(other)
    fetches.submit("r", [Load(2, 3, pages[0], True), Load(3, 2, pages[1], True), Load(1, -1, pages[1], True)])
    deadline = time.monotonic() + 30
    while not (taken := fetches.take())[0]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert taken == ({"r"}, {1, 3})
    assert torch.equal(dst["l0"][2].view(torch.int16), src["l0"][0].view(torch.int16))
    assert torch.isnan(dst["l0"][3].float()).all()
    fetches.close()
    host.close()
    other.close()


def test_a_load_that_cannot_be_planned_is_planned_as_failed() -> None:
    """What a hook does when planning raises: vLLM recomputes the blocks, and a request promised a
    background load is still reported done (it never waits forever)."""
    tokens = Tokens(r=list(range(9)), q=list(range(9)))
    sched = ConnectorScheduler(BS, 4, KEYS, tokens, lambda keys: len(keys))
    assert sched.match("r", 0) == (8, True)
    sched.fail_load("r", [5, 6, 7], 0, 8)
    plan = sched.take_plan()
    assert not plan.loads and [(ld.block, ld.slot) for ld in plan.fetches["r"]] == [(5, -1), (6, -1)]
    sched.scheduled("q", [1, 2, 3], True, 9)
    sched.take_plan()
    assert sched.match("r", 4) == (4, False)  # block 1 of the same tokens is on the host now
    sched.fail_load("r", [5, 6, 7], 1, 4)
    plan = sched.take_plan()
    assert not plan.fetches and [(ld.block, ld.slot) for ld in plan.loads] == [(6, -1)]


def test_a_slot_whose_save_failed_is_not_loaded_from() -> None:
    from kvtier.integrations.vllm.scheduler import Load

    src = kv_layers(2, torch.Generator().manual_seed(3))
    host = HostBlocks(BlockViews(src, 2), 2, KEYS)
    page = KEYS.root
    assert host.loadable(Load(0, 1, page)) and not host.loadable(Load(0, -1, page))
    host.bad.add(1)
    assert not host.loadable(Load(0, 1, page))
    assert not host.loadable(Load(0, 0, page, from_storage=True))  # no storage: nothing arrives
    host.close()


CUDA = torch.cuda.is_available()


def vllm_layer(layout: str, num_blocks: int, block: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """One layer's KV in a vLLM layout, random bf16: `cpu` `[blocks, heads, block, 2 * head_dim]`,
    `flash` (CUDA MHA/GQA) `[2, blocks, block, heads, head_dim]`, `mla` `[blocks, block, 576]`."""
    shape = {
        "cpu": (num_blocks, 2, block, 128),
        "flash": (2, num_blocks, block, 2, 64),
        "mla": (num_blocks, block, 576),
    }
    return torch.randn(*shape[layout], generator=gen).to(torch.bfloat16).to(device)


def assert_blocks(dst: dict, src: dict, layout: str, pairs, untouched) -> None:
    """Every layer's block `a` of `dst` holds block `b` of `src` bit for bit for each `(a, b)` of
    `pairs`, and the blocks `untouched` (poisoned with NaN) are still NaN."""
    for name in src:
        got, want = dst[name], src[name]
        if layout == "flash":  # `[2, blocks, ...]`: blocks first
            got, want = got.transpose(0, 1), want.transpose(0, 1)
        for a, b in pairs:
            assert torch.equal(got[a].view(torch.int16), want[b].view(torch.int16)), (name, a)
        for a in untouched:
            assert torch.isnan(got[a].float()).all(), (name, a)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]
)
@pytest.mark.parametrize("layout", ["cpu", "flash", "mla"])
@pytest.mark.parametrize("block", [16, 64])
def test_vllm_layouts_round_trip_through_host_and_storage(device, layout, block, tmp_path) -> None:
    """Blocks of two layers in each of vLLM's layouts, on the CPU or a GPU: saved to the host pool,
    written to a file store, read by another worker into its host pool and loaded into poisoned
    blocks: bit for bit, and no other block written."""
    gen = torch.Generator().manual_seed(block)
    keys = PageKeys(Fingerprint(b"v" * 16), block)
    src = {f"l{i}": vllm_layer(layout, 8, block, device, gen) for i in range(2)}
    host = HostBlocks(BlockViews(src, 8), 4, keys, open_backend(f"file://{tmp_path}"))
    pages = keys.chain(keys.root, np.arange(3 * block))
    for name in src:
        host.save_layer(name, [1, 6, 3], [0, 1, 2])
    for slot, page in enumerate(pages):
        host.store(slot, page)
    host.flush()
    dst = {k: torch.full_like(v, float("nan")) for k, v in src.items()}
    other = HostBlocks(BlockViews(dst, 8), 4, keys, open_backend(f"file://{tmp_path}"))
    fill_rows(other, 0x5A)
    assert all(other.read(slot, page) for slot, page in zip((3, 2, 1), pages, strict=True))
    other.load([0, 7, 5], [3, 2, 1])
    if device == "cuda":
        torch.cuda.synchronize()
    assert_blocks(dst, src, layout, ((0, 1), (7, 6), (5, 3)), untouched=(2,))
    host.close()
    other.close()


def test_staging_a_storage_page_never_evicts_a_host_hit_of_the_same_request() -> None:
    """One host slot, holding the request's first block: its second block (in storage) finds no
    slot to stage in and fails, rather than evicting the page the same fetch reads."""
    tokens = Tokens(r=list(range(9)), w=list(range(5)))
    sched = ConnectorScheduler(BS, 1, KEYS, tokens, lambda keys: len(keys))
    sched.scheduled("w", [0, 1], True, 5)  # the first block of the same tokens, saved to the host
    sched.take_plan()
    assert sched.match("r", 0) == (8, True)
    sched.allocated("r", [5, 6, 7], 8)
    (fetch,) = sched.take_plan().fetches.values()
    assert [(ld.slot, ld.from_storage) for ld in fetch] == [(0, False), (-1, True)]
    assert len(sched.index) == 1  # the host hit's page is still indexed


def test_the_scheduler_state_shows_what_it_holds_until_released() -> None:
    """`state()` counts a request, its fetch, its held slots and the step's plan while they exist,
    and nothing once the fetch is reported and the request ends (the tests with a real vLLM check
    it after preemptions and aborts)."""
    tokens = Tokens(r=list(range(9)))
    sched = ConnectorScheduler(BS, 4, KEYS, tokens, lambda keys: len(keys))
    assert sched.match("r", 0) == (8, True)
    sched.allocated("r", [5, 6, 7], 8)
    held = sched.state()
    assert held["requests"] == 1 and held["fetches"] == 1 and held["planned"] == 1
    assert held["held_slots"] == held["staging"] == 2 and held["free_slots"] == 2
    assert sched.fetching
    sched.take_plan()
    assert sched.state()["planned"] == 0 and sched.fetching
    sched.fetched(["r"])
    sched.finished("r")
    idle = sched.state()
    assert not sched.fetching
    assert {
        k: idle[k] for k in ("requests", "matches", "fetches", "held_slots", "staging", "planned")
    } == dict.fromkeys(("requests", "matches", "fetches", "held_slots", "staging", "planned"), 0)
    assert idle["free_slots"] + idle["indexed"] == idle["host_slots"] == 4


@pytest.mark.parametrize("layout", ["cpu", "flash", "mla"])
@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("chunked", [False, True])
def test_the_row_kernel_moves_blocks_as_the_index_copies_do(layout, block, chunked, monkeypatch) -> None:
    """The GPU path (kvtier's row kernel reading and writing the host rows directly, one launch per
    layer view, rows cut into units), on the GPU or under Triton's interpreter on the CPU: saves
    write the same host bytes as the index copies and nothing else; loads fill poisoned blocks bit
    for bit. `chunked`: the host rows in chunks of two rows, which the kernel reaches from one base.
    (On a GPU machine Triton's library functions were wrapped compiled at import: the interpreter
    cannot call them, so the kernel runs compiled there.)"""
    pytest.importorskip("triton")
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(7)
    device = "cuda" if CUDA else "cpu"
    src = {f"l{i}": vllm_layer(layout, 6, block, device, gen) for i in range(2)}
    blocks, slots = [4, 0, 5], [2, 0, 4]  # (chunked: slots of three chunks)
    views = BlockViews(src, 6)
    chunk = {"chunk_bytes": 2 * views.block_bytes} if chunked else {}
    fast = HostBlocks(views, 5, KEYS, kernel=True, **chunk)
    plain = HostBlocks(BlockViews(src, 6), 5, KEYS, kernel=False, **chunk)
    assert fast.kernel is not None and plain.kernel is None
    assert fast.rows.pool.segment_slots == (2 if chunked else 5) * BS
    fill_rows(fast, 0xA5)
    fill_rows(plain, 0xA5)
    for name in src:
        fast.save_layer(name, blocks, slots)
        plain.save_layer(name, blocks, slots)
    fast.saved()
    assert torch.equal(all_rows(fast), all_rows(plain))
    assert (all_rows(fast)[[1, 3]] == 0xA5).all()  # slots not saved to are untouched
    dst = {k: torch.full_like(v, float("nan")) for k, v in src.items()}
    back = HostBlocks(BlockViews(dst, 6), 5, KEYS, kernel=True, **chunk)
    copy_rows(back, fast)
    back.load([1, 3, 2], slots, wait=True)
    assert_blocks(dst, src, layout, ((1, 4), (3, 0), (2, 5)), untouched=(0, 4, 5))
    for h in (fast, plain, back):
        h.close()


def test_a_block_row_is_cut_into_equal_units_within_the_kernel_budget() -> None:
    from kvtier.integrations.vllm.rows import unit_bytes

    assert unit_bytes(8192, 16384) == 8192
    assert unit_bytes(32768, 16384) == 16384
    assert unit_bytes(18432, 16384) == 9216
    assert unit_bytes(73728, 16384) == 12288
    assert unit_bytes(524288, 16384) == 16384
    for size in (1152 * 64, 576 * 2 * 16, 4096 * 2 * 64, 130):
        u = unit_bytes(size, 16384)
        assert size % u == 0 and (u <= 16384 or size <= 16384)


@pytest.mark.parametrize("fault", ["raises", "writes nothing"])
def test_a_row_kernel_that_fails_its_check_leaves_the_index_copies(fault, monkeypatch, caplog) -> None:
    """Where the row kernel cannot launch here, or moves the wrong bytes, the pool finds it when it
    is made (a save of block 0 against an index copy), says so once and moves blocks by index copies:
    the round trip is still bit for bit."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvtier.integrations.vllm.rows import BlockRows

    def broken(self, name, launches, load):
        if fault == "raises":
            raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(BlockRows, "run", broken)
    gen = torch.Generator().manual_seed(11)
    src = {f"l{i}": vllm_layer("flash", 4, 16, "cpu", gen) for i in range(2)}
    with caplog.at_level("WARNING", logger="kvtier.integrations.vllm.blocks"):
        host = HostBlocks(BlockViews(src, 4), 3, KEYS, kernel=True)
    assert host.kernel is None
    (warning,) = [r.getMessage() for r in caplog.records if "row kernel failed its check" in r.getMessage()]
    assert ("no kernel image" in warning) == (fault == "raises")
    for name in src:
        host.save_layer(name, [3, 1], [2, 0])
    dst = {k: torch.full_like(v, float("nan")) for k, v in src.items()}
    back = HostBlocks(BlockViews(dst, 4), 3, KEYS, kernel=True)
    copy_rows(back, host)
    back.load([0, 2], [2, 0])
    assert_blocks(dst, src, "flash", ((0, 3), (2, 1)), untouched=(1, 3))


def test_a_row_kernel_that_passes_its_check_is_kept(monkeypatch) -> None:
    pytest.importorskip("triton")
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(12)
    device = "cuda" if CUDA else "cpu"
    src = {"l0": vllm_layer("mla", 3, 16, device, gen)}
    host = HostBlocks(BlockViews(src, 3), 2, KEYS, kernel=True)
    assert host.kernel is not None
    assert torch.equal(host.rows.row(0), src["l0"][0].reshape(-1).view(torch.uint8).cpu())  # the check's save


# On a GPU the moves run on streams of their own; each test below delays one stream with a sleep
# kernel, so that a missing order between streams shows as wrong bytes (on the CPU nothing is
# asynchronous: they skip).
cuda_only = pytest.mark.skipif(not CUDA, reason="no GPU")
SLEEP_CYCLES = 200_000_000  # ~0.1 s of one SM's clock


@cuda_only
def test_a_save_reads_its_block_before_vllm_rewrites_it() -> None:
    """vLLM may free a block after the step that saved it and write another request's KV into it on
    its stream: the stream waits for the step's saves (`fence_saves`), so the host row holds the
    block as it was, even when the save stream runs late."""
    gen = torch.Generator().manual_seed(21)
    src = {f"l{i}": vllm_layer("flash", 4, 16, "cuda", gen) for i in range(2)}
    want = {k: v.clone() for k, v in src.items()}
    host = HostBlocks(BlockViews(src, 4), 2, KEYS)
    assert host.kernel is not None
    host._save_stream = torch.cuda.Stream()
    with torch.cuda.stream(host._save_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    for name in src:
        host.save_layer(name, [1], [0])
    host.fence_saves()  # (`wait_for_save`)
    for v in src.values():
        v.fill_(float("nan"))  # the block's next owner, on vLLM's stream
    host.saved()
    dst = {k: torch.full_like(v, float("nan")) for k, v in src.items()}
    back = HostBlocks(BlockViews(dst, 4), 2, KEYS)
    copy_rows(back, host)
    back.load([2], [0])
    torch.cuda.synchronize()
    assert_blocks(dst, want, "flash", ((2, 1),), untouched=(0, 1, 3))


@cuda_only
def test_a_page_read_from_storage_waits_for_a_load_still_reading_its_slot(tmp_path) -> None:
    """A slot loaded from in one step may take a storage page in the next: the CPU writes it only
    once the load, late on its stream, has read the slot's former bytes."""
    gen = torch.Generator().manual_seed(22)
    src = {"l0": vllm_layer("mla", 4, 16, "cuda", gen)}
    keys = PageKeys(Fingerprint(b"o" * 16), 16)
    _, b = keys.chain(keys.root, np.arange(32))
    host = HostBlocks(BlockViews(src, 4), 2, keys, open_backend(f"file://{tmp_path}"))
    for name in src:
        host.save_layer(name, [0, 1], [0, 1])
    host.store(1, b)  # storage holds block 1's bytes as page b
    host.flush()
    host._stream = torch.cuda.Stream()
    with torch.cuda.stream(host._stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    dst = src["l0"][3]
    dst.fill_(float("nan"))
    host.load([3], [0])  # block 3 <- slot 0 (block 0's bytes), late
    for name in src:
        host.wait_layer(name)
    assert host.read(0, b)  # slot 0 <- page b, on the CPU
    torch.cuda.synchronize()
    assert torch.equal(src["l0"][3].view(torch.int16), src["l0"][0].view(torch.int16))
    assert not torch.equal(src["l0"][0].view(torch.int16), src["l0"][1].view(torch.int16))
    host.close()


@cuda_only
def test_a_background_fetch_fills_its_blocks_after_the_step_that_handed_them_over(tmp_path) -> None:
    """A fetch runs on another thread and stream: it fills its blocks only after the work vLLM had
    queued on them when the step submitted it (`mark`), late as that work may run."""
    gen = torch.Generator().manual_seed(23)
    src = {"l0": vllm_layer("mla", 4, 16, "cuda", gen)}
    host = HostBlocks(BlockViews(src, 4), 2, KEYS)
    for name in src:
        host.save_layer(name, [0], [0])
    host.saved()
    want = src["l0"][0].clone()
    torch.cuda._sleep(SLEEP_CYCLES)  # vLLM's stream, busy
    src["l0"][2].fill_(float("nan"))  # the block's former owner's last write, queued behind it
    host.load([2], [0], wait=True, after=host.mark())
    torch.cuda.synchronize()
    assert torch.equal(src["l0"][2].view(torch.int16), want.view(torch.int16))
    host.close()


def test_a_host_pool_larger_than_the_hosts_memory_is_refused_before_it_is_allocated() -> None:
    """The rows are a `HostPool` of one layer: a pool over the RAM available (less its reserve) is
    refused at once, with its size, rather than pinned until the host runs out."""
    from kvtier.errors import HostMemoryError
    from kvtier.pool.memory import host_memory_bytes

    gen = torch.Generator().manual_seed(31)
    views = BlockViews({"l0": vllm_layer("mla", 2, 16, "cpu", gen)}, 2)
    too_many = 2 * host_memory_bytes()[1] // views.block_bytes
    with pytest.raises(HostMemoryError, match="host pool needs"):
        HostBlocks(views, too_many, PageKeys(Fingerprint(b"m" * 16), 16))
    with pytest.raises(ConfigError, match="0 blocks"):
        HostBlocks(views, 0, PageKeys(Fingerprint(b"m" * 16), 16))
    host = HostBlocks(views, 2, PageKeys(Fingerprint(b"m" * 16), 16))
    with pytest.raises(SlotError, match="not in"):
        host.rows.row(2)
    host.close()
