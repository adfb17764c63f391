"""Helpers of the persistent, warp-specialized Gluon block kernels (the experimental sm_90
``hopper_ws`` kernels and the sm_100 ones): each program's balanced share of the (block, kv
head) tiles, tensor maps of a ``[T, H * D]`` row view made in the kernel, and rings of
mbarrier pairs (``ready`` / ``empty``) that hand shared-memory slots between partitions."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .block import _smem_layout

# Rows a tensor map may address: only full blocks are copied through them, all inside [0, T).
ROWS = gl.constexpr(2**31 - 1)
# Threads of a consumer warpgroup: what one consumer adds to a ring's empty count when its threads release
# slots each (``release_slot``'s ``BY_THREADS``).
WARPGROUP_THREADS = gl.constexpr(128)


@gluon.jit
def tile_range(slots, kv_heads):
    """This program's contiguous, balanced share ``[lo, hi)`` of the ``slots * kv_heads`` tiles
    (tile ``t`` is slot ``t // kv_heads`` of kv head ``t % kv_heads``)."""
    tiles = slots.to(gl.int64) * kv_heads
    lo = gl.program_id(0) * tiles // gl.num_programs(0)
    hi = (gl.program_id(0) + 1) * tiles // gl.num_programs(0)
    return lo.to(gl.int32), hi.to(gl.int32)


@gluon.jit
def row_map(ptr, heads, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Tensor map of the ``[rows, heads * HEAD_DIM]`` view, ``[BLOCK_M, WIDTH]`` boxes."""
    return bounded_row_map(ptr, ROWS, heads, stride_t, BLOCK_M, WIDTH, HEAD_DIM)


@gluon.jit
def bounded_row_map(ptr, rows, heads, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Tensor map of the ``[rows, heads * HEAD_DIM]`` view, ``[BLOCK_M, WIDTH]`` boxes (rows past
    ``rows`` read as zeros, and stores there are dropped)."""
    return tma.make_tensor_descriptor(ptr, [rows, heads * HEAD_DIM], [stride_t, 1], [BLOCK_M, WIDTH],
                                      _smem_layout(WIDTH))


@gluon.jit
def init_ring(ready, empty, STAGES: gl.constexpr, EMPTY_COUNT: gl.constexpr, BY_THREADS: gl.constexpr = False):
    """A ring's barriers: one arrival makes a slot ready, ``EMPTY_COUNT`` consumers' make it empty (with
    ``BY_THREADS`` each consumer's threads arrive one by one: ``release_slot``)."""
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        if BY_THREADS:
            mbarrier.init(empty.index(s), count=EMPTY_COUNT * WARPGROUP_THREADS)
        else:
            mbarrier.init(empty.index(s), count=EMPTY_COUNT)


@gluon.jit
def release_slot(empty, BY_THREADS: gl.constexpr = False):
    """A consumer warpgroup hands a slot back on its ``empty`` barrier once every thread is done with it
    (its products on the slot waited for). By default a warpgroup barrier, then one elected thread's
    arrival (how Gluon lowers ``mbarrier.arrive``). ``BY_THREADS``: every thread arrives for itself, with no
    barrier, as CUTLASS's pipelines release a stage (the ring counts ``WARPGROUP_THREADS`` arrivals a
    consumer: ``init_ring``'s ``BY_THREADS``). The arrival is ``cp.async.mbarrier.arrive.noinc``, which
    fires once the thread's own ``cp.async`` copies so far have landed: at once in a partition that
    issues none."""
    if BY_THREADS:
        async_copy.mbarrier_arrive(empty, increment_count=False)
    else:
        gl.thread_barrier()
        mbarrier.arrive(empty)


@gluon.jit
def drop_ring(ready, empty, STAGES: gl.constexpr):
    """Invalidate a ring's barriers once every partition is done with them."""
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def init_turns(turn, CONSUMERS: gl.constexpr):
    """The ping-pong's ``turn`` barriers (:func:`await_turn`), one arrival each."""
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(c), count=1)


@gluon.jit
def drop_turns(turn, CONSUMERS: gl.constexpr):
    """Invalidate the ``turn`` barriers once every consumer is done with them."""
    for c in gl.static_range(CONSUMERS):
        mbarrier.invalidate(turn.index(c))


@gluon.jit
def await_turn(turn, c, g):
    """Ping-pong between ``CONSUMERS`` warpgroups that issue their products in turns, round robin,
    on one ``turn`` barrier each: consumer ``c``'s product number ``g`` waits until the previous
    consumer has issued its product ``g`` (``c`` > 0) or ``g - 1`` (consumer 0)."""
    if c == 0:
        if g > 0:
            mbarrier.wait(turn.index(0), (g - 1) & 1)
    else:
        mbarrier.wait(turn.index(c), g & 1)


@gluon.jit
def pass_turn(turn, c, CONSUMERS: gl.constexpr):
    """The whole warpgroup has issued its product: the next consumer's turn."""
    gl.thread_barrier()
    mbarrier.arrive(turn.index((c + 1) % CONSUMERS))
