"""Block-attention backward on sm_90 for blocks of 65-128 tokens at head dims 144-256, one query head
per program (Gluon): the ``hopper_wide`` variant's backward (its forward is ``hopper``'s).

The 128-row hopper plan (q, k, v, dO and a P / dS tile, all whole) needs 288 KB of shared memory
at D256, over the 227 KB a program gets, so those calls' backward ran on the flash kernels (two
passes, the scores computed in each). Here one program of two warpgroups per (block, query head)
holds the block's q, k and dO tiles (128 x 256 each, 16-bit) in shared memory; v comes in two
column halves through one 128 x 128 tile, which then holds P and after it dS: 224 KB in all.
Every product is one ``wgmma`` of the whole block:

- ``S = Q K^T``, its exact softmax (all of the block's keys are in the program: nothing is read
  but q, k, v and dO, and the forward's logsumexp is not needed);
  with rotary, q and k are held as their rotary half tiles (``rotary.half_channels``: split halves,
  interleaved pairs, partial ``rotary_dim``), rotated in place 32 rows at a time, and S is the sum of
  the two halves' products;
- ``dP = dO V^T`` by v's column halves (the second half's copy in flight during the softmax);
- ``dV = P^T dO``, stored through dO's dead tile; ``dK = dS^T Q`` through q's, ``dQ = dS K``
  through k's, each as soon as it is summed, so that one 128 x 256 float32 accumulator (128
  registers a thread) is live at a time. With rotary, dK's and dQ's column halves are parked in
  float32 in two dead tiles (q's and dO's, then k's and q's) and rotated back 32 rows at a time
  with those rows' angles (``block._unrotate_store``).

Grouped query heads run as one query head per kv head (``Variant.group_partials``): the launch sees
one kv head's group of query heads against its k and v repeated by a zero head stride, each program
stores its query head's dK and dV, the group's programs adjacent in launch order (``GROUP_PROGRAMS``:
they run side by side and read each k and v tile from HBM once for the group), and with
``GROUP_SUMS`` the last of a block's programs to finish adds them up over the group while they are
in L2 (``group_sums``; else ``common.head_sums`` after the launch). Summed inside one
program they would be two more 128 x 256 float32 accumulators live across the heads; summed in a
float32 buffer in global memory by the programs (session 29) they were no faster than the flash
kernels.

Each gradient element is written once by one program: bitwise deterministic. Rows past the block
are masked on every copy and store (zero-filled), so no other block's data is used; channels past
``HEAD_DIM`` (tiles padded to 256) read as zeros and are not stored.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from ..common.launch import Launcher
from .block import (
    _acc_layout, _block_of, _channel_mask, _copy_halves, _copy_rows, _landed, _probs, _row_layout, _smem_layout,
    _store_tile_via, _tile_warps, _unrotate_store, group_program,
)
from .group_sums import last_to_arrive, sum_group_rows
from .rotary import rotate_rows_in_place


@gluon.jit
def _to_shared(buf, x):
    """Store ``x`` into ``buf`` once every warp is done reading it, visible to the next ``wgmma``."""
    gl.thread_barrier()
    buf.store(x.to(buf.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _wide_bwd_block(Q, K, V, DO, DQ, DK, DV, Pos, start, n, first_row, hk, scale, qk_scale, log2_theta,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROT_DIM: gl.constexpr,
                    INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Gradients of the block at ``start`` (``n`` tokens, the first at row ``first_row`` of its
    sequence) for kv head ``hk`` and its query head."""
    WARPS: gl.constexpr = _tile_warps(BLOCK_M)
    HALF: gl.constexpr = BLOCK_D // 2
    ROTARY: gl.constexpr = ROT_DIM > 0
    gl.static_assert(HALF == BLOCK_M, "v's half tile holds P and dS: BLOCK_D == 2 * BLOCK_M")
    gl.static_assert(HEAD_DIM > HALF, "head dims past one half tile")
    dtype: gl.constexpr = Q.dtype.element_ty
    ld: gl.constexpr = _row_layout(BLOCK_D, WARPS)
    ld_h: gl.constexpr = _row_layout(HALF, WARPS)
    acc_s: gl.constexpr = _acc_layout(BLOCK_M, WARPS)
    acc_d: gl.constexpr = _acc_layout(BLOCK_D, WARPS)

    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    rows = start + offs_m
    row_ok = offs_m < n
    mask_d = _channel_mask(gl.expand_dims(row_ok, 1), offs_d, HEAD_DIM, BLOCK_D)
    offs_mh = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld_h))
    offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_h))
    rows_h = start + offs_mh
    mask_h = gl.expand_dims(offs_mh < n, 1)
    # v's second column half: the channels HALF .. HEAD_DIM.
    mask_h2 = _channel_mask(mask_h, offs_h, HEAD_DIM - HALF, HALF)

    q_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], _smem_layout(BLOCK_D))
    k_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], _smem_layout(BLOCK_D))
    do_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], _smem_layout(BLOCK_D))
    x_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], _smem_layout(HALF))
    v_ptr = V + hk * stride_vh
    if ROTARY:
        # q and k as their rotary half tiles: columns 0 .. HALF and HALF .. 2 HALF of each tile.
        _copy_halves(q_s.slice(0, HALF, 1), q_s.slice(HALF, HALF, 1), Q + hk * stride_qh, rows_h, offs_h, mask_h,
                     stride_qt, HEAD_DIM, ROT_DIM, INTERLEAVED, HALF)
        _copy_halves(k_s.slice(0, HALF, 1), k_s.slice(HALF, HALF, 1), K + hk * stride_kh, rows_h, offs_h, mask_h,
                     stride_kt, HEAD_DIM, ROT_DIM, INTERLEAVED, HALF)
    else:
        _copy_rows(q_s, Q + hk * stride_qh, rows, offs_d, mask_d, stride_qt)
        _copy_rows(k_s, K + hk * stride_kh, rows, offs_d, mask_d, stride_kt)
    async_copy.commit_group()
    _copy_rows(do_s, DO + hk * stride_doh, rows, offs_d, mask_d, stride_dot)
    _copy_rows(x_s, v_ptr, rows_h, offs_h, mask_h, stride_vt)
    async_copy.commit_group()

    zero_s = gl.zeros([BLOCK_M, BLOCK_M], gl.float32, acc_s)
    _landed(1)
    if ROTARY:
        rotate_rows_in_place(q_s.slice(0, HALF, 1), q_s.slice(HALF, HALF, 1), k_s.slice(0, HALF, 1),
                             k_s.slice(HALF, HALF, 1), Pos, start, n, first_row, log2_theta, True, BLOCK_M, HALF,
                             ROT_DIM // 2, HAS_POS, ld_h)
        fence_async_shared()
        gl.thread_barrier()
    # (Rotary or not, the whole tiles' product: the sum of the half tiles' products.)
    s = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_s)
    _landed(0)
    dp = warpgroup_mma(do_s.slice(0, HALF, 1), x_s.permute((1, 0)), zero_s)
    gl.thread_barrier()  # every warp's product is done reading v's first half
    _copy_rows(x_s, v_ptr + HALF, rows_h, offs_h, mask_h2, stride_vt)
    async_copy.commit_group()
    p, inv = _probs(s, n, qk_scale, IS_CAUSAL, BLOCK_M, acc_s)
    p = p * gl.expand_dims(inv, 1)
    _landed(0)
    dp = warpgroup_mma(do_s.slice(HALF, HALF, 1), x_s.permute((1, 0)), dp)
    ds = (p * (dp - gl.expand_dims(gl.sum(p * dp, 1), 1))).to(dtype)

    zero_d = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d)
    _to_shared(x_s, p)
    dv = warpgroup_mma(x_s.permute((1, 0)), do_s, zero_d)
    # dO's tile is dead: it carries dV out.
    _store_tile_via(do_s, DV + hk * stride_dvh, dv, start, n, rows, row_ok, stride_dvt, BLOCK_M, BLOCK_D, HEAD_DIM,
                    WARPS, 0)
    _to_shared(x_s, ds)
    if ROTARY:
        # dK's halves parked in float32 in q's and dO's dead tiles and rotated back; then dQ's in
        # k's and q's.
        acc_h: gl.constexpr = _acc_layout(HALF, WARPS)
        zero_h = gl.zeros([BLOCK_M, HALF], gl.float32, acc_h)
        dka = warpgroup_mma(x_s.permute((1, 0)), q_s.slice(0, HALF, 1), zero_h)
        dkb = warpgroup_mma(x_s.permute((1, 0)), q_s.slice(HALF, HALF, 1), zero_h)
        _unrotate_store(q_s, do_s, dka, dkb, DK + hk * stride_dkh, Pos, start, n, first_row, log2_theta, scale,
                        stride_dkt, BLOCK_M, HALF, HEAD_DIM, ROT_DIM, INTERLEAVED, HAS_POS, WARPS)
        dqa = warpgroup_mma(x_s, k_s.slice(0, HALF, 1), zero_h)
        dqb = warpgroup_mma(x_s, k_s.slice(HALF, HALF, 1), zero_h)
        _unrotate_store(k_s, q_s, dqa, dqb, DQ + hk * stride_dqh, Pos, start, n, first_row, log2_theta, scale,
                        stride_dqt, BLOCK_M, HALF, HEAD_DIM, ROT_DIM, INTERLEAVED, HAS_POS, WARPS)
    else:
        dk = warpgroup_mma(x_s.permute((1, 0)), q_s, zero_d)
        _store_tile_via(q_s, DK + hk * stride_dkh, dk * scale, start, n, rows, row_ok, stride_dkt, BLOCK_M, BLOCK_D,
                        HEAD_DIM, WARPS, 0)
        dq = warpgroup_mma(x_s, k_s, zero_d)
        _store_tile_via(k_s, DQ + hk * stride_dqh, dq * scale, start, n, rows, row_ok, stride_dqt, BLOCK_M, BLOCK_D,
                        HEAD_DIM, WARPS, 0)


@gluon.jit(do_not_specialize=["slots", "num_seqs", "block_size", "scale", "qk_scale", "log2_theta", "kv_heads"])
def _hopper_wide_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, Sched, Pos,
    slots, num_seqs, block_size, scale, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    Counts, DK_SUM, DV_SUM, stride_dkst, stride_dvst,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROT_DIM: gl.constexpr,
    INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
    INT64: gl.constexpr, GROUP_PROGRAMS: gl.constexpr, GROUP_SUMS: gl.constexpr,
):
    """``block.bwd``'s kernel's positional arguments, then those of the sums over a group of query
    heads (the block counters ``Counts`` and the summed ``DK_SUM``, ``DV_SUM`` ``[T, D]`` with their
    row strides; ``group_sums``). One program per (block, kv head), each kv head with one query head
    (grouped ones come as k and v repeated by a zero head stride); ``GROUP_PROGRAMS`` (the group's
    size, 0 for none) takes the programs with the head fastest, a block's adjacent, and with
    ``GROUP_SUMS`` the last of them to finish sums their dK and dV."""
    WARPS: gl.constexpr = _tile_warps(BLOCK_M)
    if GROUP_PROGRAMS > 0:
        block, head = group_program(GROUP_PROGRAMS)
    else:
        block, head = gl.program_id(0), gl.program_id(1)
    start, n, first_row = _block_of(Sched, slots, num_seqs, block_size, block, INLINE_SEQS, WARPS)
    if INT64:
        start = start.to(gl.int64)
    if n > 0:
        _wide_bwd_block(Q, K, V, DO, DQ, DK, DV, Pos, start, n, first_row, head, scale,
                        qk_scale, log2_theta,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                        stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                        HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL)
        if GROUP_SUMS:
            gl.static_assert(GROUP_PROGRAMS > 0, "the group's sums need its programs adjacent")
            if last_to_arrive(Counts, block, GROUP_PROGRAMS, WARPS):
                sum_group_rows(DK, DK_SUM, start, n, stride_dkt, stride_dkh, stride_dkst, HEAD_DIM, BLOCK_M, BLOCK_D,
                               GROUP_PROGRAMS, WARPS)
                sum_group_rows(DV, DV_SUM, start, n, stride_dvt, stride_dvh, stride_dvst, HEAD_DIM, BLOCK_M, BLOCK_D,
                               GROUP_PROGRAMS, WARPS)


launch_bwd = Launcher(_hopper_wide_bwd_kernel)
