"""The Triton row-copy kernel (`prepare_rows` then `RowLaunch.run`), bit for bit against plain
torch indexing.

On a machine without CUDA the kernel runs under Triton's CPU interpreter
(TRITON_INTERPRET=1, set here before Triton is imported); on a GPU machine the
compiled kernel runs, reading and writing pinned host memory directly.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

pytest.importorskip("triton")

from conftest import on_device, on_host
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import jit
from kvtier.errors import TransferError
from kvtier.pool.rows import flat_words, word_dtype
from kvtier.transfer import kernels
from kvtier.transfer.kernels import runs_on

CUDA = torch.cuda.is_available()
GATHER, SCATTER = "gather", "scatter"
DEVICE = torch.device("cuda" if CUDA else "cpu")

if not runs_on(DEVICE):  # pragma: no cover - depends on the environment
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)


# ---------------------------------------------------------------------------
# Placement and reference.
# ---------------------------------------------------------------------------


def place(src: torch.Tensor, dst: torch.Tensor, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    if direction == GATHER:
        return on_host(src), on_device(dst)
    return on_device(src), on_host(dst)


def read(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes on the CPU, after the GPU has finished with it (pinned host memory included)."""
    if CUDA:
        torch.cuda.synchronize()
    return t.cpu().view(torch.uint8)


def random_words(nbytes: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """`nbytes` random bytes (a poisoned buffer) viewed as 1-D `dtype` words."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype)


def reference(
    src: torch.Tensor, src_off: torch.Tensor, dst: torch.Tensor, dst_off: torch.Tensor, row_words: int
) -> torch.Tensor:
    """What `dst` holds after the copy: a per-row slicing loop over CPU copies."""
    src, dst = src.cpu(), dst.cpu().clone()
    for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
        dst[d : d + row_words] = src[s : s + row_words]
    return dst.view(torch.uint8)


def line_aligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of 1-D `t` starting on a 128-byte line (the kernel pipelines only line-aligned rows)."""
    nbytes = t.numel() * t.element_size()
    raw = torch.empty(nbytes + 128, dtype=torch.uint8)
    skip = -raw.data_ptr() % 128
    out = raw[skip : skip + nbytes].view(t.dtype)
    out.copy_(t)
    return out


def scattered_case(
    row_bytes: int, n: int, slots: int, gen: torch.Generator, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Source and poisoned destination pools of `slots` rows; `n` rows at random distinct slots of each."""
    dtype = dtype or word_dtype(row_bytes)
    size = torch.empty((), dtype=dtype).element_size()
    row_words = row_bytes // size
    src = random_words(slots * row_bytes, dtype, gen)
    dst = random_words(slots * row_bytes, dtype, gen)
    src_off = torch.randperm(slots, generator=gen)[:n] * row_words
    dst_off = torch.randperm(slots, generator=gen)[:n] * row_words
    return src, src_off, dst, dst_off, row_words


def move_rows(
    src_t: torch.Tensor,
    src_off: torch.Tensor,
    dst_t: torch.Tensor,
    dst_off: torch.Tensor,
    row_words: int,
    direction: str,
    sm_budget: int = 8,
    rows_per_program: int | None = None,
    stages: int | None = None,
) -> None:
    """One prepared launch, as the plan executor runs it: rows of `row_words` words at word offsets
    `src_off`, `dst_off` (`[n]` int64 CPU) of 1-D words tensors `src_t`, `dst_t`."""
    size = src_t.element_size()
    launch = kernels.prepare_rows(
        row_words * size,
        src_off.numpy() * size,
        dst_off.numpy() * size,
        [src_t.data_ptr(), dst_t.data_ptr()],
        direction == GATHER,
        DEVICE,
        sm_budget,
        rows_per_program,
        stages,
        lambda t: t.to(DEVICE),
    )
    word = launch.shape.word
    launch.run(lambda: (flat_words(src_t, word), flat_words(dst_t, word)))


def run_and_check(
    src: torch.Tensor,
    src_off: torch.Tensor,
    dst: torch.Tensor,
    dst_off: torch.Tensor,
    row_words: int,
    direction: str,
    **kwargs: object,
) -> None:
    expected = reference(src, src_off, dst, dst_off, row_words)
    src_t, dst_t = place(src, dst, direction)
    move_rows(src_t, src_off, dst_t, dst_off, row_words, direction, **kwargs)
    got = read(dst_t)
    assert torch.equal(got, expected), "destination differs from the reference"
    assert torch.equal(read(src_t), src.view(torch.uint8)), "source changed"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20240611)


# ---------------------------------------------------------------------------
# Correctness.
# ---------------------------------------------------------------------------

# DSA indexer, fp8 MLA (two sizes), bf16 MLA, 8 x 128 bf16 heads, a multi-KB row with a
# tail chunk, and two sizes that only narrow words divide.
ROW_BYTES = [132, 576, 656, 1152, 2048, 4160, 6, 130]
# (sm_budget, rows_per_program) pairs spread over the sizes; all nine pairs run below.
LAUNCHES = [(8, 16), (2, 64), (1, 16), (8, 1), (2, 16), (8, 64), (1, 1), (2, 1)]


@pytest.mark.parametrize("direction", [GATHER, SCATTER])
@pytest.mark.parametrize(("row_bytes", "launch"), list(zip(ROW_BYTES, LAUNCHES, strict=True)))
def test_scattered_rows_match_reference(
    row_bytes: int, launch: tuple[int, int], direction: str, gen: torch.Generator
) -> None:
    sm_budget, rows_per_program = launch
    n = 40 if row_bytes >= 2048 else 90
    case = scattered_case(row_bytes, n, slots=3 * n, gen=gen)
    run_and_check(*case, direction, sm_budget=sm_budget, rows_per_program=rows_per_program)


@pytest.mark.parametrize("direction", [GATHER, SCATTER])
@pytest.mark.parametrize("sm_budget", [1, 2, 8])
@pytest.mark.parametrize("rows_per_program", [1, 16, 64])
def test_every_launch_shape(
    sm_budget: int, rows_per_program: int, direction: str, gen: torch.Generator
) -> None:
    case = scattered_case(1152, 70, slots=150, gen=gen)
    run_and_check(*case, direction, sm_budget=sm_budget, rows_per_program=rows_per_program)


@pytest.mark.parametrize("direction", [GATHER, SCATTER])
@pytest.mark.parametrize("row_bytes", [656, 2048])
def test_page_first_offsets(row_bytes: int, direction: str, gen: torch.Generator) -> None:
    """Rows of one layer of a page-first host pool `[pages, layers, page_size, row]`, to a layer-first one."""
    pages, layers, page_size, layer = 12, 3, 4, 1
    dtype = word_dtype(row_bytes)
    row_words = row_bytes // torch.empty((), dtype=dtype).element_size()
    host = random_words(pages * layers * page_size * row_bytes, dtype, gen)
    dev = random_words(pages * page_size * row_bytes, dtype, gen)
    host_pages = torch.randperm(pages, generator=gen)[:7]
    dev_pages = torch.randperm(pages, generator=gen)[:7]
    o = torch.arange(page_size)
    host_off = (((host_pages[:, None] * layers + layer) * page_size + o) * row_words).flatten()
    dev_off = ((dev_pages[:, None] * page_size + o) * row_words).flatten()
    if direction == GATHER:
        run_and_check(host, host_off, dev, dev_off, row_words, GATHER, sm_budget=2)
    else:
        run_and_check(dev, dev_off, host, host_off, row_words, SCATTER, sm_budget=2)


@pytest.mark.parametrize(
    ("row_bytes", "dtype"), [(1152, torch.uint8), (1152, torch.int16), (132, torch.uint8)]
)
def test_narrow_words_are_copied_wide(row_bytes: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Words narrower than the rows allow (offsets in bytes, say) give the same bytes."""
    case = scattered_case(row_bytes, 50, slots=100, gen=gen, dtype=dtype)
    run_and_check(*case, GATHER, rows_per_program=16)


def test_misaligned_offsets(gen: torch.Generator) -> None:
    """Even-sized rows at odd word offsets (no vector access), in the same tiles as aligned ones."""
    row_words, n, slots = 72, 60, 200
    stride = row_words + 2  # Room to shift a row by one word without touching its neighbours.
    src = random_words(8 * (slots * stride + 1), torch.int64, gen)
    dst = random_words(8 * (slots * stride + 1), torch.int64, gen)
    src_off = torch.randperm(slots, generator=gen)[:n] * stride + (torch.arange(n) % 3 == 0).long()
    dst_off = torch.randperm(slots, generator=gen)[:n] * stride + (torch.arange(n) % 2 == 0).long()
    run_and_check(src, src_off, dst, dst_off, row_words, SCATTER, rows_per_program=16)
    run_and_check(src, dst_off, dst, src_off, row_words, GATHER, rows_per_program=4)


def test_odd_rows_per_program_and_repeated_sources(gen: torch.Generator) -> None:
    """A tile height that is not a power of two, more programs than blocks, one source row read many times."""
    src, _, dst, dst_off, row_words = scattered_case(576, 23, slots=40, gen=gen)
    src_off = torch.tensor([5, 5, 0, 39] * 5 + [5, 7, 5]) * row_words
    run_and_check(src, src_off, dst, dst_off, row_words, GATHER, sm_budget=16, rows_per_program=3)


def test_offsets_alignment_is_found_on_the_host() -> None:
    from kvtier.transfer.kernels import common_alignment

    assert common_alignment(np.array([0, 4, 12]), np.array([8])) == 4
    assert common_alignment(np.array([0, 6]), np.array([2])) == 2
    assert common_alignment(np.array([0]), np.array([0])) == 1 << 20  # all zero: any width
    assert common_alignment(np.array([3]), np.array([], dtype=np.int64)) == 1
    assert common_alignment(np.array([144, 288]), np.array([0, 432])) == 16
    assert common_alignment(np.array([], dtype=np.int64)) == 1 << 20


def test_no_rows_launches_nothing(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel() -> None:
        raise AssertionError("a kernel was launched for no rows")

    monkeypatch.setattr(kernels, "_kernel", no_kernel)
    src, _, dst, _, row_words = scattered_case(576, 0, slots=4, gen=gen)
    before = dst.clone()
    empty = torch.empty(0, dtype=torch.int64)
    src_t, dst_t = place(src, dst, GATHER)
    move_rows(src_t, empty, dst_t, empty, row_words, GATHER)
    assert torch.equal(read(dst_t), before.view(torch.uint8))


@pytest.mark.parametrize(
    ("n", "sm_budget", "rows_per_program", "programs"),
    [(100, 8, 16, 7), (100, 2, 16, 2), (100, 8, 64, 2), (5, 8, 1, 5), (3, 2, 1, 2)],
)
def test_persistent_grid_size(
    n: int,
    sm_budget: int,
    rows_per_program: int,
    programs: int,
    gen: torch.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exactly min(sm_budget, row blocks) programs, whatever the number of rows."""
    grids: list[tuple[int, ...]] = []
    real = kernels._kernel()

    class Recording:
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(kernels, "_kernel", Recording)
    case = scattered_case(132, n, slots=n + 10, gen=gen)
    run_and_check(*case, GATHER, sm_budget=sm_budget, rows_per_program=rows_per_program)
    assert grids == [(programs,)]


@settings(max_examples=30, deadline=None)
@given(
    row_bytes=st.integers(1, 300),
    n=st.integers(0, 40),
    extra_slots=st.integers(0, 20),
    narrow=st.booleans(),
    sm_budget=st.integers(1, 9),
    rows_per_program=st.sampled_from([1, 2, 5, 16, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_cases(
    row_bytes: int, n: int, extra_slots: int, narrow: bool, sm_budget: int, rows_per_program: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.uint8 if narrow else None
    case = scattered_case(row_bytes, n, slots=n + extra_slots, gen=gen, dtype=dtype)
    run_and_check(
        *case, SCATTER if seed % 2 else GATHER, sm_budget=sm_budget, rows_per_program=rows_per_program
    )


def test_rows_in_flight_follows_the_row_size() -> None:
    from kvtier.transfer.kernels import rows_in_flight

    # About 64 KiB of whole rows per program, at most 256 rows.
    assert rows_in_flight(1152) == 56
    assert rows_in_flight(656) == 99
    assert rows_in_flight(132) == 256
    assert rows_in_flight(16 * 132) == 31
    assert rows_in_flight(4) == 256
    assert rows_in_flight(1 << 20) == 1


def test_long_rows_take_the_programs_that_keep_512_kib_in_flight() -> None:
    from kvtier.transfer.kernels import programs_for, rows_in_flight, tile_bytes, warps_for

    # ~512 KiB across the grid: 2 programs of 4 stages of 64 KiB; unpipelined, 4 of 128 KiB.
    assert [programs_for(1152, 8, stages) for stages in (4, 3, 2, 1)] == [2, 3, 4, 4]
    assert programs_for(1024, 8) == 4 and programs_for(1023, 8) == 8
    assert programs_for(1152, 1, 4) == 1 and programs_for(656, 16, 4) == 16
    # Over a wide host span, twice the lean programs within the budget; short rows keep the budget.
    assert [programs_for(1152, 8, stages, wide=True) for stages in (4, 3, 1)] == [4, 6, 8]
    assert programs_for(1152, 3, 4, wide=True) == 3 and programs_for(656, 8, 1, wide=True) == 8
    span, piece = kernels.WIDE_SPAN_BYTES, kernels.WIDE_PIECE_BYTES
    assert not kernels.is_wide(span, 1152) and kernels.is_wide(span + 1, 1152)
    assert kernels.is_wide(span + 1, piece - 1) and not kernels.is_wide(span + 1, piece)
    # Pipelined tiles are 64 KiB whatever the grid; unpipelined, 512 KiB / programs in [64, 128] KiB.
    assert [tile_bytes(p, 4) for p in (1, 2, 8)] == [65536] * 3
    assert [tile_bytes(p) for p in (1, 2, 4, 5, 8, 16)] == [131072, 131072, 131072, 104857, 65536, 65536]
    assert rows_in_flight(1152, 2, 4) == rows_in_flight(1152, 8) == rows_in_flight(1152, 16) == 56
    assert (rows_in_flight(1152, 4), rows_in_flight(656, 4), rows_in_flight(132, 4)) == (113, 199, 512)
    assert rows_in_flight(1 << 20, 4) == 1
    # One warp per 4 KiB of tile: 16 for 64 KiB, 32 (1024 threads) from 128 KiB.
    assert [warps_for(b) for b in (512, 4096, 65536, 131072, 262144)] == [1, 1, 16, 32, 32]


def test_only_whole_aligned_lines_are_pipelined() -> None:
    from kvtier.transfer.kernels import pipelines, stages_for

    assert pipelines(1152, 1152) and pipelines(2048, 128)
    # 656-byte fp8 rows and 2112-byte indexer pages straddle lines; 1152-byte rows 16 bytes off do too.
    assert not pipelines(656, 656) and not pipelines(2112, 2112) and not pipelines(1152, 16)
    assert not pipelines(1152, 1152, gather=False)  # scatters read device memory
    assert [stages_for(1152, 1152, None, s) for s in (None, 2, 1)] == [4, 2, 1]
    assert stages_for(656, 656, None) == stages_for(1152, 64, None) == 1


@pytest.mark.parametrize(
    ("shared", "stages"),
    # An H200, an A100, a part of 99 KiB, less, more.
    [(232448, 4), (166912, 3), (101376, 2), (65536, 1), (1 << 20, 4)],
)
def test_stages_are_what_the_device_s_shared_memory_holds(
    shared: int, stages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.transfer import KernelOptions

    # A device with `shared` bytes per program (the query of the device itself stands in).
    monkeypatch.setattr(kernels, "device_shared_bytes", lambda index: shared)
    gpu = torch.device("cuda", 0)
    assert kernels.shared_bytes(gpu) == shared and kernels.stages_for(1152, 1152, shared) == stages
    # Planning on the CPU (or under the interpreter) assumes a device that holds them all.
    assert kernels.shared_bytes(torch.device("cpu")) is kernels.shared_bytes(None) is None
    assert kernels.stages_for(1152, 1152, None) == 4
    shape = KernelOptions(sm_budget=7).launch(1152, 1152, gpu)
    assert (shape.programs, shape.stages) == ({4: 2, 3: 3, 2: 4, 1: 4}[stages], stages)
    assert shape.rows == (56 if stages > 1 else 113)
    assert KernelOptions(stages=2, sm_budget=9).launch(1152, 128, gpu).stages == min(2, stages)


def test_kernel_options_take_fewer_programs_for_long_rows() -> None:
    from kvtier.pool.device import Direction
    from kvtier.transfer import KernelOptions
    from kvtier.transfer.kernels import KernelLaunch

    lean, full = KernelOptions(), KernelOptions(lean=False)
    # Rows of 1 KiB or more: 2 programs of 4 stages of 56 rows when they are whole, aligned lines,
    # else 4 of 128 KiB unpipelined; shorter rows the whole budget.
    assert lean.launch(1152) == KernelLaunch(2, 56, 4)
    assert lean.launch(1152, 16) == KernelLaunch(4, 113, 1)
    assert lean.launch(2112, 2112) == KernelLaunch(4, 62, 1)
    assert lean.launch(656, 656) == KernelLaunch(8, 99, 1)
    assert lean.launch(1023, 1) == KernelLaunch(8, 64, 1)
    assert full.launch(1152) == KernelLaunch(8, 56, 4)
    assert KernelOptions(stages=1).launch(1152) == KernelLaunch(4, 113, 1)
    assert KernelOptions(sm_budget=1).launch(1152) == KernelLaunch(1, 56, 4)
    assert KernelOptions(sm_budget=16).launch(132, 4).programs == 16
    # A shape given whole is taken as it is.
    assert KernelOptions(rows_per_program=7).launch(1152) == KernelLaunch(8, 7, 4)
    # Backups are not pipelined: their reads are of device memory.
    assert lean.launch(1152, 1152, None, Direction.BACKUP) == KernelLaunch(4, 113, 1)
    # Host rows over a wide span: twice the programs, tiles as the grid's size gives them.
    assert lean.launch(1152, 1152, None, Direction.LOAD, wide=True) == KernelLaunch(4, 56, 4)
    assert lean.launch(1152, 1152, None, Direction.BACKUP, wide=True) == KernelLaunch(8, 56, 1)
    assert full.launch(1152, 1152, None, Direction.LOAD, wide=True) == KernelLaunch(8, 56, 4)


def test_rows_wider_than_a_tile_are_refused_before_launch(gen: torch.Generator) -> None:
    """A row of more than 16384 chunks cannot sit in one tile: a clear error, nothing written."""
    src, src_off, dst, dst_off, row_words = scattered_case(16384 * 16 + 8, 2, slots=3, gen=gen)
    before = dst.clone()
    src_t, dst_t = place(src, dst, GATHER)
    with pytest.raises(TransferError, match="wider than one tile"):
        move_rows(src_t, src_off, dst_t, dst_off, row_words, GATHER)
    assert torch.equal(read(dst_t), before.view(torch.uint8)), "destination written by a refused call"


def test_the_cli_takes_a_kernel_shape_or_a_budget_alone() -> None:
    import argparse

    from kvtier.cli.bench_args import kernel_shape
    from kvtier.transfer import KernelOptions

    assert kernel_shape("8x32") == KernelOptions(sm_budget=8, rows_per_program=32)
    assert kernel_shape("4") == KernelOptions(sm_budget=4)
    assert kernel_shape("8s1") == KernelOptions(sm_budget=8, stages=1)
    assert kernel_shape("2x56S3") == KernelOptions(sm_budget=2, rows_per_program=56, stages=3)
    for bad in ("0", "4x0", "4x8x2", "x", "four", "8s0", "8s", "s2", "8s1s2"):
        with pytest.raises(argparse.ArgumentTypeError):
            kernel_shape(bad)


@pytest.mark.parametrize(
    ("sm_budget", "stages", "want"),
    # (programs, rows, rows rounded up, warps, stages) of the launch.
    [(8, None, (8, 56, 64, 16, 4)), (2, 1, (2, 113, 128, 32, 1)), (4, 3, (4, 56, 64, 16, 3))],
)
def test_tiles_default_to_64_kib_of_rows_pipelined_over_stages(
    sm_budget: int, stages: int | None, want: tuple, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    """Without `rows_per_program`: pipelined, 64 KiB of 1152-byte rows per tile; else 512 KiB / programs."""
    launches = []
    real = kernels._kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((*grid, kw["ROWS_PER_BLOCK"], kw["ROWS_POW"], kw["num_warps"], kw["STAGES"]))
                assert kw["num_stages"] == kw["STAGES"]
                return real()[grid](*args, **kw)

            return launch

    monkeypatch.setattr(kernels, "_kernel", Spy)
    src, src_off, dst, dst_off, row_words = scattered_case(1152, 1000, 1200, gen)
    case = line_aligned(src), src_off, line_aligned(dst), dst_off, row_words
    run_and_check(*case, GATHER, sm_budget=sm_budget, stages=stages)
    assert launches == [want]


@pytest.mark.parametrize(
    ("row_bytes", "slot_bytes", "direction", "stages"),
    [(1152, 1152, GATHER, 4), (656, 656, GATHER, 1), (1152, 1168, GATHER, 1), (1152, 1152, SCATTER, 1)],
)
def test_rows_that_are_not_whole_aligned_lines_are_not_pipelined(
    row_bytes: int, slot_bytes: int, direction: str, stages: int, monkeypatch, gen: torch.Generator
) -> None:
    """656-byte rows, 1152-byte rows in 1168-byte slots, a scatter: one stage."""
    launches = []
    real = kernels._kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(kw["STAGES"])
                return real()[grid](*args, **kw)

            return launch

    monkeypatch.setattr(kernels, "_kernel", Spy)
    src, src_off, dst, dst_off, _ = scattered_case(slot_bytes, 60, 80, gen, dtype=torch.uint8)
    src, dst = line_aligned(src), line_aligned(dst)
    run_and_check(src, src_off, dst, dst_off, row_bytes, direction)
    assert launches == [stages]


def _identity(x):
    return x


def test_kernels_are_wrapped_once_per_mode_and_again_when_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton reads TRITON_INTERPRET when it wraps a function: a switched mode wraps again."""
    wrapped = jit.ModeJit(_identity, do_not_specialize=["x"])
    first = wrapped()
    assert wrapped() is first
    monkeypatch.setenv("TRITON_INTERPRET", "0" if jit.interpreting() else "1")
    other = wrapped()
    assert other is not first and wrapped() is other
    assert type(other) is not type(first)  # a compiled function against an interpreted one


@pytest.mark.skipif(CUDA, reason="under the interpreter both tiers are CPU tensors of one process")
@pytest.mark.parametrize("row_bytes", [48, 132, 1152])
@pytest.mark.parametrize("gather", [True, False])
def test_a_prepared_launch_reaches_rows_below_and_above_its_base(row_bytes, gather, gen) -> None:
    """`prepare_rows` then `RowLaunch.run`: rows at negative and positive byte offsets from one base (the
    middle of an allocation) move bit for bit, in either direction; no other row is written; a launch
    of no rows writes nothing."""
    from kvtier.pool.rows import flat_words

    slots = 96
    far = random_words(slots * row_bytes, torch.uint8, gen)  # the host side: base at slot 32
    near = random_words(slots * row_bytes, torch.uint8, gen)  # the device side: base at slot 0
    base = 32 * row_bytes
    far_slots = torch.randperm(slots, generator=gen)[:50]
    near_slots = torch.randperm(slots, generator=gen)[:50]
    assert (far_slots < 32).any() and (far_slots >= 32).any()
    far_off = far_slots.numpy().astype(np.int64) * row_bytes - base
    near_off = near_slots.numpy().astype(np.int64) * row_bytes
    src_off, dst_off = (far_off, near_off) if gather else (near_off, far_off)
    bases = [far.data_ptr() + base, near.data_ptr()]
    prepared = kernels.prepare_rows(
        row_bytes, src_off, dst_off, bases, gather, torch.device("cpu"), 4, None, None, lambda t: t
    )
    word = prepared.shape.word
    assert prepared.n == 50 and prepared.src_off.dtype == torch.int64
    assert prepared.shape.row_vecs * prepared.shape.kwargs["VEC"] * word == row_bytes

    def views():
        ends = flat_words(far[base:], word), flat_words(near, word)
        return ends if gather else ends[::-1]

    far_rows, near_rows = far.view(slots, row_bytes).clone(), near.view(slots, row_bytes).clone()
    empty = kernels.prepare_rows(
        row_bytes, src_off[:0], dst_off[:0], bases, gather, torch.device("cpu"), 4, None, None, lambda t: t
    )
    empty.run(views)
    assert torch.equal(far.view(slots, row_bytes), far_rows) and torch.equal(
        near.view(slots, row_bytes), near_rows
    )
    prepared.run(views)
    if gather:
        want, got, keep = near_rows.clone(), near.view(slots, row_bytes), far.view(slots, row_bytes)
        want[near_slots] = far_rows[far_slots]
        assert torch.equal(keep, far_rows)
    else:
        want, got, keep = far_rows.clone(), far.view(slots, row_bytes), near.view(slots, row_bytes)
        want[far_slots] = near_rows[near_slots]
        assert torch.equal(keep, near_rows)
    assert torch.equal(got, want)
