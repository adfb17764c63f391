"""The hopper forward of a 128-row tile of a wide head (D 144-256) in 64-channel chunks (``CHUNKED``).

``sm90.block._fwd_tile`` holds a 128-row tile's q, k and v whole: 192 KB of shared memory at D256,
one program per SM, so each program's copies and its products take turns on the SM (H200 grid,
block 128, D256, one query head per kv head: 1.24-1.35x the floor, FA2 varlen as fast or faster).
Here the tiles pass through a ring of ``SLOTS`` shared ``[128, 64]`` chunks (96 KB), so two
programs fit an SM and one's copies run beside the other's products:

- the scores ``S = sum_c Q_c K_c^T`` over the head's ``NCH = ceil(HEAD_DIM / 64)`` channel chunks,
  each chunk's q and k in a pair of slots (three pairs, so the first three chunks' copies are in
  flight together); a pair freed by its product takes the next copy at once: the fourth chunk's q
  and k, then v's chunks two to a pair;
- the softmax of the whole row (one tile of keys: the block), then per v chunk ``O_c = P V_c``,
  scaled and stored through that chunk's own slot, dead once its product is done.

Every copy is a ``cp.async`` commit group issued in a fixed order, so the groups still in flight
at each wait are constants (:func:`v_slot` and the waits below): a score chunk's wait leaves
two groups in flight, v's pairs one and then none. One query head per program (``GROUPS`` 1; a
grouped call runs one program per query head, ``SPLIT_GROUPS``). Rows past the block are zero-
filled on every copy and dropped on every store, channels past ``HEAD_DIM`` likewise.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma

from .tile_ops import (
    _acc_layout, _channel_mask, _copy_rows, _landed, _probs_lse, _row_layout, _smem_layout, _store_cols_via,
)

CHUNK = gl.constexpr(64)  # channels per chunk: a 128-byte swizzle row of 16-bit values
SLOTS = gl.constexpr(6)  # three pairs of [128, 64] chunks: 96 KB at 16 bits
TILE_M = gl.constexpr(128)
WARPS = gl.constexpr(8)


@gluon.constexpr_function
def chunk_count(head_dim):
    """The channel chunks of a head: ``ceil(head_dim / CHUNK)`` (3 or 4 at D 144-256)."""
    return -(-int(head_dim) // int(CHUNK))


@gluon.constexpr_function
def chunk_cols(head_dim, j):
    """The head's channels in chunk ``j``: ``CHUNK``, fewer in the last chunk of a head dim not a multiple of it."""
    return min(int(CHUNK), int(head_dim) - int(j) * int(CHUNK))


@gluon.constexpr_function
def v_slot(head_dim, j):
    """The ring slot of v's chunk ``j``. Score chunk ``c`` takes pair ``c % 3``; the pairs that the
    products of chunks ``NCH - 3`` on free (no later score chunk takes them) take v's chunks in
    order, two each."""
    return 2 * ((chunk_count(head_dim) - 3 + int(j) // 2) % 3) + int(j) % 2


@gluon.jit
def _copy_chunk(dst, src, rows, row_ok, stride_t, c: gl.constexpr, HEAD_DIM: gl.constexpr,
                LAYOUT: gl.constexpr):
    """``cp.async`` of the channels ``c * CHUNK ..`` of the tile's rows (rows past the block, channels
    past the head zero-filled)."""
    cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LAYOUT))
    mask = _channel_mask(gl.expand_dims(row_ok, 1), cols, HEAD_DIM - c * CHUNK, CHUNK)
    _copy_rows(dst, src + c * CHUNK, rows, cols, mask, stride_t)


@gluon.jit
def _copy_v_pair(ring, v_ptr, rows, row_ok, stride_vt, J: gl.constexpr, HEAD_DIM: gl.constexpr,
                 LAYOUT: gl.constexpr):
    """v's chunks ``J`` and ``J + 1`` (where the head has it) into their slots (:func:`v_slot`)."""
    _copy_chunk(ring.index(v_slot(HEAD_DIM, J)), v_ptr, rows, row_ok, stride_vt, J, HEAD_DIM, LAYOUT)
    if J + 1 < chunk_count(HEAD_DIM):
        _copy_chunk(ring.index(v_slot(HEAD_DIM, J + 1)), v_ptr, rows, row_ok, stride_vt, J + 1, HEAD_DIM, LAYOUT)


@gluon.jit
def fwd_tile_chunked(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, start, n, qk_scale, stride_qt, stride_kt, stride_vt,
                     stride_ot, HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr, STORE_LSE: gl.constexpr):
    """The forward of one block (rows ``start .. start + n``, ``n`` at most 128) and one query head:
    ``q_ptr`` / ``o_ptr`` at the head's first channel, ``k_ptr`` / ``v_ptr`` at its kv head's;
    ``STORE_LSE``: each row's natural-log logsumexp to ``lse_ptr + start + row``."""
    NCH: gl.constexpr = chunk_count(HEAD_DIM)
    gl.static_assert(NCH >= 3 and NCH <= 4, "head dims 129-256")
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    ld: gl.constexpr = _row_layout(CHUNK, WARPS)
    acc_s: gl.constexpr = _acc_layout(TILE_M, WARPS)
    acc_c: gl.constexpr = _acc_layout(CHUNK, WARPS)
    smem: gl.constexpr = _smem_layout(CHUNK)
    ring = gl.allocate_shared_memory(dtype, [SLOTS, TILE_M, CHUNK], smem)

    offs_m = gl.arange(0, TILE_M, layout=gl.SliceLayout(1, ld))
    rows = start + offs_m
    row_ok = offs_m < n
    # The first three score chunks' copies, a group each.
    for c in gl.static_range(3):
        _copy_chunk(ring.index(2 * c), q_ptr, rows, row_ok, stride_qt, c, HEAD_DIM, ld)
        _copy_chunk(ring.index(2 * c + 1), k_ptr, rows, row_ok, stride_kt, c, HEAD_DIM, ld)
        async_copy.commit_group()
    s = gl.zeros([TILE_M, TILE_M], gl.float32, acc_s)
    for c in gl.static_range(NCH):
        # Chunks 0 .. c - 1 each issued one group after their product, so two are newer than this one's.
        _landed(2)
        s = warpgroup_mma(ring.index(2 * (c % 3)), ring.index(2 * (c % 3) + 1).permute((1, 0)), s)
        if c < NCH - 1:
            gl.thread_barrier()  # every warp's product is done with the pair
            if c + 3 < NCH:
                _copy_chunk(ring.index(2 * (c % 3)), q_ptr, rows, row_ok, stride_qt, c + 3, HEAD_DIM, ld)
                _copy_chunk(ring.index(2 * (c % 3) + 1), k_ptr, rows, row_ok, stride_kt, c + 3, HEAD_DIM, ld)
            else:
                _copy_v_pair(ring, v_ptr, rows, row_ok, stride_vt, 2 * (c + 3 - NCH), HEAD_DIM, ld)
            async_copy.commit_group()
    p, inv, lse = _probs_lse(s, n, qk_scale, IS_CAUSAL, TILE_M, acc_s)
    if STORE_LSE:
        lse_rows = gl.arange(0, TILE_M, layout=gl.SliceLayout(1, acc_s))
        gl.store(lse_ptr + start + lse_rows, lse, mask=lse_rows < n)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc_c, k_width=2))
    inv_c = gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, acc_c)), 1)
    zero_c = gl.zeros([TILE_M, CHUNK], gl.float32, acc_c)
    for j in gl.static_range(NCH):
        if j % 2 == 0:
            # v's pairs are the last groups: the first leaves the second in flight (if there is one).
            _landed(1 if j + 2 < NCH else 0)
        v_s = ring.index(v_slot(HEAD_DIM, j))
        o = warpgroup_mma(p_op, v_s, zero_c) * inv_c
        _store_cols_via(v_s, o_ptr + j * CHUNK, o, start, n, stride_ot, TILE_M, CHUNK, chunk_cols(HEAD_DIM, j), WARPS)
