"""CPU tests of ``tests/gluon_shim.py``'s model of warp specialization: partitions run one at a time and hand
the turn over at barrier operations, so a buffer released before its last read is refilled before that read
(the bug shows in the result every time), and a program whose partitions all wait raises at once. And of its
``cp.async`` copies: a tile holds a copy's data only once a ``wait_group`` has retired the copy's group; and
of its TMA stores: a store reads its tile when a ``store_wait`` retires it."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tests next to Triton's interpreter (the shim stands in for Gluon)")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: E402

from tests import gluon_shim as gs  # noqa: E402


@gluon.jit
def _producer(Src, slot, ready, empty, N: gl.constexpr, ROUNDS: gl.constexpr):
    """Copy row ``r`` of ``Src`` into the one-slot ring by TMA in round ``r``, once the consumer has released it."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    desc = tma.make_tensor_descriptor(Src, [ROUNDS, N], [N, 1], [1, N], layout)
    for r in range(ROUNDS):
        mbarrier.wait(empty.index(0), (r & 1) ^ 1)
        mbarrier.expect(ready.index(0), N * 4)
        tma.async_copy_global_to_shared(desc, [r, 0], ready.index(0), slot)


@gluon.jit
def _consumer(slot, ready, empty, Out, N: gl.constexpr, ROUNDS: gl.constexpr, EARLY: gl.constexpr,
              BY_THREADS: gl.constexpr):
    """Sum the slot's rounds; ``EARLY`` releases the slot before reading it (the bug); ``BY_THREADS`` releases it
    by each thread's ``cp.async.mbarrier.arrive.noinc`` (no copies in flight) instead of one arrival."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
    total = gl.zeros([1, N], gl.float32, layout)
    for r in range(ROUNDS):
        mbarrier.wait(ready.index(0), r & 1)
        if EARLY:
            mbarrier.arrive(empty.index(0))
        total += slot.load(layout)
        if not EARLY:
            if BY_THREADS:
                async_copy.mbarrier_arrive(empty.index(0), increment_count=False)
            else:
                mbarrier.arrive(empty.index(0))
    gl.store(Out + gl.arange(0, N, layout=gl.SliceLayout(0, layout))[None, :], total)


@gluon.jit
def _ring_kernel(Src, Out, N: gl.constexpr, ROUNDS: gl.constexpr, EARLY: gl.constexpr, STUCK: gl.constexpr,
                 BY_THREADS: gl.constexpr, EMPTY_COUNT: gl.constexpr):
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    slot = gl.allocate_shared_memory(gl.float32, [1, N], layout)
    ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(ready.index(0), count=1)
    # STUCK: the producer waits for an arrival never made.
    mbarrier.init(empty.index(0), count=EMPTY_COUNT + 1 if STUCK else EMPTY_COUNT)
    gl.warp_specialize([(_consumer, (slot, ready, empty, Out, N, ROUNDS, EARLY, BY_THREADS)),
                        (_producer, (Src, slot, ready, empty, N, ROUNDS))], [1], [24])
    mbarrier.invalidate(ready.index(0))
    mbarrier.invalidate(empty.index(0))


def _run(early: bool, stuck: bool = False, by_threads: bool = False, empty_count: int = 1,
         num_warps: int = 4) -> torch.Tensor:
    src = (torch.arange(6, dtype=torch.float32) + 1)[:, None].expand(6, 32).contiguous()
    out = torch.full((32,), float("nan"))
    gs.launch(_ring_kernel, (1,), Src=src, Out=out, N=32, ROUNDS=6, EARLY=early, STUCK=stuck, BY_THREADS=by_threads,
              EMPTY_COUNT=empty_count, num_warps=num_warps)
    return out


def test_a_ring_released_after_its_read_sums_every_round():
    assert torch.equal(_run(early=False), torch.full((32,), 21.0))


def test_a_ring_released_before_its_read_is_refilled_first():
    """The consumer's early release hands the turn to the waiting producer, which refills the slot before the
    read: every round after the first reads the next round's values (2 + 3 + ... + 6, and 6 again)."""
    for _ in range(3):
        assert torch.equal(_run(early=True), torch.full((32,), 26.0))


def test_partitions_all_waiting_raise_a_deadlock():
    with pytest.raises(RuntimeError, match="every partition waits"):
        _run(early=False, stuck=True)


@pytest.mark.parametrize("num_warps", [4, 8])
def test_a_slot_released_by_every_thread_counts_the_partitions_threads(num_warps):
    """A ``.noinc`` copy arrival is each thread's own: a barrier counting the consumer partition's threads
    (its warps times 32) completes a phase per round, one counting one arrival raises at the first release,
    and one counting a thread more than the partition has never completes (the producer waits for ever)."""
    threads = num_warps * 32
    assert torch.equal(_run(early=False, by_threads=True, empty_count=threads, num_warps=num_warps),
                       torch.full((32,), 21.0))
    with pytest.raises(RuntimeError, match="more arrivals than its count"):
        _run(early=False, by_threads=True, empty_count=1, num_warps=num_warps)
    with pytest.raises(RuntimeError, match="every partition waits"):
        _run(early=False, stuck=True, by_threads=True, empty_count=threads, num_warps=num_warps)


@gluon.jit
def _copies_kernel(Src, Out, N: gl.constexpr, WAITED: gl.constexpr):
    """Copy rows 0 and 1 of ``Src`` into two tiles, one commit group each, wait for all but ``WAITED``
    newest groups, then store both tiles' contents: rows 0 and 1 of ``Out``."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    tiles = gl.allocate_shared_memory(gl.float32, [2, 1, N], smem)
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, layout))[None, :]
    for r in gl.static_range(2):
        tiles.index(r).store(gl.zeros([1, N], gl.float32, layout))
    for r in gl.static_range(2):
        async_copy.async_copy_global_to_shared(tiles.index(r), Src + r * N + cols)
        async_copy.commit_group()
    async_copy.wait_group(WAITED)
    for r in gl.static_range(2):
        gl.store(Out + r * N + cols, tiles.index(r).load(layout))
    async_copy.wait_group(0)


@pytest.mark.parametrize("waited,landed", [(0, [True, True]), (1, [True, False]), (2, [False, False])])
def test_a_copy_lands_when_a_wait_retires_its_group(waited, landed):
    """``wait_group(n)`` lands every committed group but the ``n`` newest, oldest first; a tile read before
    its copy's group is retired still holds what it held before (zeros here)."""
    src = torch.arange(1, 65, dtype=torch.float32)
    out = torch.full((64,), float("nan"))
    gs.launch(_copies_kernel, (1,), Src=src, Out=out, N=32, WAITED=waited)
    for r, done in enumerate(landed):
        want = src[r * 32:(r + 1) * 32] if done else torch.zeros(32)
        assert torch.equal(out[r * 32:(r + 1) * 32], want), r


@gluon.jit
def _staged_stores_kernel(Out, N: gl.constexpr, WAITED: gl.constexpr):
    """Stage row 0 (ones) in a shared tile and TMA-store it to ``Out``'s row 0, wait for all but ``WAITED`` of
    this program's stores, then write twos into the same tile and store it to row 1."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    tile = gl.allocate_shared_memory(gl.float32, [1, N], smem)
    out_map = tma.make_tensor_descriptor(Out, [2, N], [N, 1], [1, N], smem)
    for r in gl.static_range(2):
        if r == 1:
            tma.store_wait(WAITED)
        tile.store(gl.full([1, N], r + 1.0, gl.float32, layout))
        tma.async_copy_shared_to_global(out_map, [r, 0], tile)
    tma.store_wait(0)


@pytest.mark.parametrize("waited,first", [(0, 1.0), (1, 2.0)])
def test_a_tma_store_reads_its_tile_when_a_wait_retires_it(waited, first):
    """A TMA store reads its shared tile at the ``store_wait`` that retires it, the latest a GPU may: a staging
    tile written again before that wait (``WAITED`` 1) stores the later data twice."""
    out = torch.full((2, 32), float("nan"))
    gs.launch(_staged_stores_kernel, (1,), Out=out, N=32, WAITED=waited)
    assert torch.equal(out[0], torch.full((32,), first)) and torch.equal(out[1], torch.full((32,), 2.0))
