"""The sums of grouped query heads' dK and dV inside the backward launch (sm_90, Gluon).

A backward of grouped query heads run one query head per program (``Variant.group_partials``)
writes each head's dK and dV of a block to a ``[T, G, D]`` buffer. The G programs of a block
are adjacent in launch order (``block.group_program``), so they run at the same time, and with
``GROUP_SUMS`` their partials are still in L2 when the last of them to finish arrives at the
block's counter (``last_to_arrive``) and adds them up (``sum_group_rows``): in float32, heads in order
0 .. G - 1 whichever program sums, rounded once, the same values as the separate pass
``common.head_sums`` (which reads the partials back from HBM in a launch of its own).

Arrival is the classic last-block pattern: every thread fences its stores at GPU scope, the
program's threads meet at a barrier, one thread adds 1 to the counter (acquire-release, GPU
scope) and the old value, broadcast to the program, says whether it was the last.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .block import _row_layout


@gluon.jit
def _fence_each_thread(WARPS: gl.constexpr):
    """A ``fence.acq_rel.gpu`` by every thread of the program (one element per thread)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    lanes = gl.arange(0, 32 * WARPS, layout=one)
    gl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [lanes], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def last_to_arrive(Counts, block, GROUPS: gl.constexpr, WARPS: gl.constexpr):
    """Arrive at ``Counts[block]`` once this program's stores are done; whether it arrived last of
    the block's ``GROUPS`` programs (then every other program's stores are visible to it)."""
    _fence_each_thread(WARPS)
    gl.thread_barrier()
    arrived = gl.atomic_add(Counts + block, 1, sem="acq_rel", scope="gpu")
    return arrived == GROUPS - 1


@gluon.jit
def sum_group_rows(Parts, Out, start, n, stride_pt, stride_pg, stride_ot, HEAD_DIM: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, GROUPS: gl.constexpr, WARPS: gl.constexpr):
    """``Out[start + m] = sum_g Parts[start + m, g]`` for the block's rows ``m < n`` (channels below
    ``HEAD_DIM``), in float32 over the heads in order, 32 rows at a time."""
    _fence_each_thread(WARPS)
    ROWS: gl.constexpr = 32
    layout: gl.constexpr = _row_layout(BLOCK_D, WARPS)
    cols = gl.expand_dims(gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, layout)), 0)
    for c in gl.static_range(BLOCK_M // ROWS):
        offs = c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        rows = gl.expand_dims(start + offs, 1)
        mask = gl.expand_dims(offs < n, 1) & (cols < HEAD_DIM)
        acc = gl.zeros([ROWS, BLOCK_D], gl.float32, layout)
        for g in gl.static_range(GROUPS):
            acc += gl.load(Parts + rows * stride_pt + g * stride_pg + cols, mask=mask, other=0.0,
                           cache_modifier=".cg").to(gl.float32)
        gl.store(Out + rows * stride_ot + cols, acc.to(Out.dtype.element_ty), mask=mask)
