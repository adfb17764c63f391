"""Tile helpers shared by the sm_90 Gluon block kernels (``sm90.block``, ``sm90.chunked``) and the other
sm_90 kernels: register and shared layouts, ``cp.async`` waits, the block softmax and stores through a dead
shared tile."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared


@gluon.constexpr_function
def _row_layout(width, warps=4):
    """Register layout of a row tile ``width`` columns wide in 16-byte row chunks (coalesced
    copies), over ``warps`` warps stacked along the rows."""
    return gl.BlockedLayout([1, 8], [32 // (width // 8), width // 8], [warps, 1], [1, 0])


@gluon.constexpr_function
def _smem_layout(width, rank=2):
    """Shared layout of 16-bit tiles ``width`` columns wide, as ``wgmma`` reads them (``rank`` 3: the same bytes as
    ``[rows, 1, width]`` boxes, as a rank-3 tensor map copies them)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(2 * width, 128), element_bitwidth=16, rank=rank)


@gluon.constexpr_function
def _acc_layout(width, warps=4):
    """Accumulator layout of a ``wgmma`` product ``[16 * warps, width]``: one warpgroup per 64 rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, width, 16])


@gluon.jit
def _ptrs(ptr, rows, cols, stride_t):
    return ptr + gl.expand_dims(rows, 1) * stride_t + gl.expand_dims(cols, 0)


@gluon.jit
def _copy_rows(dst, src, rows, cols, mask, stride_t):
    """Asynchronous copy of a row tile to shared memory (masked rows zero-filled)."""
    async_copy.async_copy_global_to_shared(dst, _ptrs(src, rows, cols, stride_t), mask)


@gluon.jit
def _channel_mask(row_mask, offs_d, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr):
    """The copy mask of a full-width tile: ``row_mask``, and the head's channels where the tile is
    padded past them (``HEAD_DIM < BLOCK_D``: the padding reads as zeros). Of a rotary half tile
    with ``HEAD_DIM // 2`` and ``HALF`` (``rotary.half_channels``)."""
    if HEAD_DIM < BLOCK_D:
        return row_mask & gl.expand_dims(offs_d < HEAD_DIM, 0)
    else:
        return row_mask


@gluon.jit
def _landed(pending: gl.constexpr):
    """Wait until at most ``pending`` copy groups are in flight, and make what landed visible to
    every warp's ``wgmma``."""
    async_copy.wait_group(pending)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _probs_lse(s, n, qk_scale, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr):
    """Exact softmax of raw scores ``s`` over the block's ``n`` keys (and the causal triangle):
    unnormalized probabilities, the rows' reciprocal sums, and the rows' natural-log logsumexp of
    the scaled scores (``qk_scale`` includes log2(e)), as the flash kernels store it."""
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, LAYOUT))
    valid = gl.expand_dims(cols < n, 0)
    if IS_CAUSAL:
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
        valid = valid & (gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0))
    s = gl.where(valid, s * qk_scale, float("-inf"))
    row_max = gl.max(s, 1)
    p = gl.exp2(s - gl.expand_dims(row_max, 1))
    total = gl.sum(p, 1)
    return p, 1.0 / total, (row_max + gl.log2(total)) * 0.6931471805599453


@gluon.jit
def _store_cols(buf, ptr, start, n, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr, COLS: gl.constexpr,
                WARPS: gl.constexpr):
    """``_store_buffer`` of the first ``COLS`` columns (the head dim of a padded tile), by ``WARPS`` warps."""
    layout: gl.constexpr = _row_layout(WIDTH, WARPS)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    mask = gl.expand_dims(offs_m < n, 1)
    if COLS < WIDTH:
        mask = mask & gl.expand_dims(cols < COLS, 0)
    gl.store(_ptrs(ptr, start + offs_m, cols, stride_t), buf.load(layout), mask=mask)


@gluon.jit
def _store_cols_via(buf, ptr, x, start, n, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr,
                    COLS: gl.constexpr, WARPS: gl.constexpr):
    """``_store_via`` of the first ``COLS`` columns, by ``WARPS`` warps."""
    gl.thread_barrier()  # every warp is done reading buf
    buf.store(x.to(buf.dtype))
    gl.thread_barrier()
    _store_cols(buf, ptr, start, n, stride_t, BLOCK_M, WIDTH, COLS, WARPS)
