"""Persistent, warp-specialized block attention for Hopper (sm_90) in Gluon: the experimental
``hopper_ws`` variant (``block.variants.HOPPER_WS``: never taken by ``auto``, run only when
forced; the design to start the Blackwell kernels from).

Same positional arguments as the other block kernels (the constexprs are the subset these use).
``min(#SMs x k, #tiles)`` programs each take a balanced contiguous range of (block, kv head)
tiles (``sm90.persistent.tile_range``). In each program a one-warp loader partition fills a ring of
``STAGES`` shared-memory slots while the four-warp compute partition (one warpgroup) works on the
slot before: the loads of tile i+1 overlap the math of tile i.

- Full blocks (``BLOCK_M`` rows of one sequence) are copied by TMA from tensor maps of the
  ``[T, H * D]`` row view, made in the kernel (``tma.make_tensor_descriptor``; the launcher gives
  their global scratch), and the output of a full block leaves by a TMA store.
- Ragged and empty blocks: the loader only signals the slot; the compute partition copies the
  rows it needs with masked ``cp.async`` (rows past the block zero-filled) and stores with masks,
  so no other block's data is read: a TMA box past the block would hold the next sequence's rows.
- The math per tile is the hopper kernels' (``sm90.block``): wgmma from the shared tiles, the
  rotary halves rotated in place, the exact softmax, results staged through a dead tile.

Slots are handed over with two mbarriers each: ``ready`` (the loader's TMA bytes, or its bare
arrival for a ragged block) and ``empty`` (the compute partition is done with the slot).
Admitted calls (``block.variants.HOPPER_WS``): the hopper variant's, one query head per kv head
and heads contiguous within a row (head stride ``D``), so one 2-D tensor map covers every head.

On the H200 (BENCHMARKS.md, session 11) these are slower than the hopper kernels on every prod
shape (D128 forward 1.20 against 1.12 ms, backward 2.21 against 2.04): two stages of tiles per
program leave room for 2 programs per SM (1 for the D128 backward, 139 KB of shared memory)
against the hopper kernels' 3-4, so ``auto`` does not pick them.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from ..common.launch import Launcher
from ..sm90.block import (
    _acc_layout, _block_of, _copy_halves, _copy_rows, _probs, _row_layout,
    _smem_layout, _store_halves_tile_via, _store_via,
)
from ..sm90.persistent import drop_ring, init_ring, row_map, tile_range
from ..sm90.rotary import rotate_in_place, sin_cos

STAGES = gl.constexpr(2)
LOADER_REGS = gl.constexpr(48)


@gluon.jit
def _store_tile(buf, out_map, ptr, lo, hi, start, n, col, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr,
                HALVES: gl.constexpr):
    """Store a result tile (``lo``, or its column halves ``lo`` and ``hi`` where ``HALVES``) to rows
    ``start .. start + n`` through the dead shared tile ``buf``: by a TMA store (waited for, so
    ``buf`` can be reused) for a full block, else read back in 16-byte row chunks, masked."""
    if n == BLOCK_M:
        HALF: gl.constexpr = WIDTH // 2
        gl.thread_barrier()  # every warp is done reading buf
        if HALVES:
            buf.slice(0, HALF, 1).store(lo.to(buf.dtype))
            buf.slice(HALF, HALF, 1).store(hi.to(buf.dtype))
        else:
            buf.store(lo.to(buf.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(out_map, [start.to(gl.int32), col], buf)
        tma.store_wait(0)
    elif HALVES:
        _store_halves_tile_via(buf, ptr, lo, hi, start, n, 0, 0, stride_t, BLOCK_M, WIDTH, WIDTH, WIDTH, False, 4,
                               0)
    else:
        _store_via(buf, ptr, lo, start, n, stride_t, BLOCK_M, WIDTH)


@gluon.jit
def _loader(q_map, k_map, v_map, do_map, q_s, qb_s, k_s, kb_s, v_s, do_s, ready, empty, Sched, slots, num_seqs,
            block_size, kv_heads, lo, hi, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, ROTARY: gl.constexpr,
            INLINE_SEQS: gl.constexpr, WITH_DO: gl.constexpr):
    """Loader partition: a full block's q, k, v (and dO, ``WITH_DO``: the backward) into the next
    free slot by TMA, else a bare arrival (the compute partition copies ragged blocks itself)."""
    HALF: gl.constexpr = HEAD_DIM // 2
    TILES: gl.constexpr = 4 if WITH_DO else 3
    for t in range(lo, hi):
        i = t - lo
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        start, n, first_row = _block_of(Sched, slots, num_seqs, block_size, t // kv_heads, INLINE_SEQS, 1)
        start = start.to(gl.int32)  # (offsets may be int64; admitted calls have T < 2**31)
        col = (t % kv_heads) * HEAD_DIM
        bar = ready.index(s)
        if n == BLOCK_M:
            mbarrier.expect(bar, TILES * BLOCK_M * HEAD_DIM * q_s.dtype.primitive_bitwidth // 8)
            tma.async_copy_global_to_shared(q_map, [start, col], bar, q_s.index(s))
            tma.async_copy_global_to_shared(k_map, [start, col], bar, k_s.index(s))
            if ROTARY:
                tma.async_copy_global_to_shared(q_map, [start, col + HALF], bar, qb_s.index(s))
                tma.async_copy_global_to_shared(k_map, [start, col + HALF], bar, kb_s.index(s))
            tma.async_copy_global_to_shared(v_map, [start, col], bar, v_s.index(s))
            if WITH_DO:
                tma.async_copy_global_to_shared(do_map, [start, col], bar, do_s.index(s))
        else:
            mbarrier.arrive(bar)


@gluon.jit
def _tile_scores(qa, qb, ka, kb, vt, dot, Q, K, V, DO, h, start, n, sin, cos, offs_m, offs_d, offs_h, zero_s,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROTARY: gl.constexpr, WITH_DO: gl.constexpr):
    """Raw scores ``Q K^T`` of a non-empty block whose slot is ready: a ragged block's q, k, v (and
    dO, ``WITH_DO``) copied first with masks (the loader copied only full ones), the rotary halves
    rotated in place."""
    HALF: gl.constexpr = BLOCK_D // 2
    rot_l: gl.constexpr = _row_layout(HALF)
    if n < BLOCK_M:
        rows = start + offs_m
        mask = gl.expand_dims(offs_m < n, 1)
        if ROTARY:
            _copy_halves(qa, qb, Q + h * stride_qh, rows, offs_h, mask, stride_qt, BLOCK_D, BLOCK_D, False, HALF)
            _copy_halves(ka, kb, K + h * stride_kh, rows, offs_h, mask, stride_kt, BLOCK_D, BLOCK_D, False, HALF)
        else:
            _copy_rows(qa, Q + h * stride_qh, rows, offs_d, mask, stride_qt)
            _copy_rows(ka, K + h * stride_kh, rows, offs_d, mask, stride_kt)
        _copy_rows(vt, V + h * stride_vh, rows, offs_d, mask, stride_vt)
        if WITH_DO:
            _copy_rows(dot, DO + h * stride_doh, rows, offs_d, mask, stride_dot)
        async_copy.commit_group()
        async_copy.wait_group(0)
    if ROTARY:
        gl.thread_barrier()
        rotate_in_place(qa, qb, sin, cos, rot_l)
        rotate_in_place(ka, kb, sin, cos, rot_l)
    fence_async_shared()
    gl.thread_barrier()
    acc = warpgroup_mma(qa, ka.permute((1, 0)), zero_s)
    if ROTARY:
        acc = warpgroup_mma(qb, kb.permute((1, 0)), acc)
    return acc


@gluon.jit
def _fwd_compute(o_map, q_s, qb_s, k_s, kb_s, v_s, ready, empty, Q, K, V, O, Sched, Pos, slots, num_seqs, block_size,
                 qk_scale, log2_theta, kv_heads, lo, hi, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                 stride_vh, stride_ot, stride_oh, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
                 ROTARY: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr):
    """Compute partition (one warpgroup): per tile S = QK^T, the exact softmax, O = PV."""
    HALF: gl.constexpr = BLOCK_D // 2
    dtype: gl.constexpr = Q.dtype.element_ty
    acc_s: gl.constexpr = _acc_layout(BLOCK_M)
    acc_d: gl.constexpr = _acc_layout(BLOCK_D)
    rot_l: gl.constexpr = _row_layout(HALF)
    ld: gl.constexpr = _row_layout(BLOCK_D)
    a_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_d, k_width=2)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
    zero_s = gl.zeros([BLOCK_M, BLOCK_M], gl.float32, acc_s)
    zero_d = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d)
    for t in range(lo, hi):
        i = t - lo
        s = i % STAGES
        h = t % kv_heads
        start, n, first_row = _block_of(Sched, slots, num_seqs, block_size, t // kv_heads, INLINE_SEQS, 4)
        qa, qb, ka, kb, vt = q_s.index(s), qb_s.index(s), k_s.index(s), kb_s.index(s), v_s.index(s)
        if ROTARY:
            # Angles while the loads are in flight.
            sin, cos = sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, HALF, HAS_POS, rot_l)
        else:
            sin = 0.0  # (unused without rotary)
            cos = 0.0
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if n > 0:
            acc = _tile_scores(qa, qb, ka, kb, vt, vt, Q, K, V, V, h, start, n, sin, cos, offs_m, offs_d, offs_h,
                               zero_s, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_vt,
                               stride_vh, BLOCK_M, BLOCK_D, ROTARY, False)
            p, inv = _probs(acc, n, qk_scale, IS_CAUSAL, BLOCK_M, acc_s)
            o = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), vt, zero_d)
            o = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, acc_d)), 1)
            _store_tile(vt, o_map, O + h * stride_oh, o, o, start, n, h * BLOCK_D, stride_ot, BLOCK_M, BLOCK_D,
                        False)
        gl.thread_barrier()  # every warp is done with the slot
        mbarrier.arrive(empty.index(s))


@gluon.jit(do_not_specialize=["slots", "num_seqs", "block_size", "qk_scale", "log2_theta", "kv_heads"])
def _hopper_ws_fwd_kernel(
    Q, K, V, O, Sched, Pos,
    slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROT_DIM: gl.constexpr,
    HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
):
    ROTARY: gl.constexpr = ROT_DIM > 0
    WIDTH: gl.constexpr = BLOCK_D // 2 if ROTARY else BLOCK_D
    dtype: gl.constexpr = Q.dtype.element_ty
    lo, hi = tile_range(slots, kv_heads)
    q_map = row_map(Q, kv_heads, stride_qt, BLOCK_M, WIDTH, HEAD_DIM)
    k_map = row_map(K, kv_heads, stride_kt, BLOCK_M, WIDTH, HEAD_DIM)
    v_map = row_map(V, kv_heads, stride_vt, BLOCK_M, BLOCK_D, HEAD_DIM)
    o_map = row_map(O, kv_heads, stride_ot, BLOCK_M, BLOCK_D, HEAD_DIM)
    q_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    if ROTARY:
        qb_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
        kb_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    else:
        qb_s = q_s
        kb_s = k_s
    v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], _smem_layout(BLOCK_D))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    init_ring(ready, empty, STAGES, 1)
    gl.warp_specialize([
        (_fwd_compute, (o_map, q_s, qb_s, k_s, kb_s, v_s, ready, empty, Q, K, V, O, Sched, Pos, slots, num_seqs,
                        block_size, qk_scale, log2_theta, kv_heads, lo, hi, stride_qt, stride_qh, stride_kt, stride_kh,
                        stride_vt, stride_vh, stride_ot, stride_oh, BLOCK_M, BLOCK_D, ROTARY, HAS_POS, IS_CAUSAL,
                        INLINE_SEQS)),
        (_loader, (q_map, k_map, v_map, v_map, q_s, qb_s, k_s, kb_s, v_s, v_s, ready, empty, Sched, slots, num_seqs,
                   block_size, kv_heads, lo, hi, HEAD_DIM, BLOCK_M, ROTARY, INLINE_SEQS, False)),
    ], [1], [LOADER_REGS])
    drop_ring(ready, empty, STAGES)


@gluon.jit
def _bwd_compute(dq_map, dk_map, dv_map, q_s, qb_s, k_s, kb_s, v_s, do_s, pds_s, ready, empty, Q, K, V, DO, DQ, DK,
                 DV, Sched, Pos, slots, num_seqs, block_size, scale, qk_scale, log2_theta, kv_heads, lo, hi,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                 BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROTARY: gl.constexpr, HAS_POS: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr):
    """Compute partition of the backward (one warpgroup, one query head per kv head): the hopper
    backward's math per tile; dV leaves through v's tile, dQ and then dK through dO's."""
    HALF: gl.constexpr = BLOCK_D // 2
    dtype: gl.constexpr = Q.dtype.element_ty
    acc_s: gl.constexpr = _acc_layout(BLOCK_M)
    acc_d: gl.constexpr = _acc_layout(BLOCK_D)
    acc_h: gl.constexpr = _acc_layout(HALF)
    rot_l: gl.constexpr = _row_layout(HALF)
    ld: gl.constexpr = _row_layout(BLOCK_D)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
    zero_s = gl.zeros([BLOCK_M, BLOCK_M], gl.float32, acc_s)
    zero_d = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d)
    zero_h = gl.zeros([BLOCK_M, HALF], gl.float32, acc_h)
    for t in range(lo, hi):
        i = t - lo
        s = i % STAGES
        h = t % kv_heads
        start, n, first_row = _block_of(Sched, slots, num_seqs, block_size, t // kv_heads, INLINE_SEQS, 4)
        qa, qb, ka, kb = q_s.index(s), qb_s.index(s), k_s.index(s), kb_s.index(s)
        vt, dot = v_s.index(s), do_s.index(s)
        if ROTARY:
            sin, cos = sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, HALF, HAS_POS, rot_l)
        else:
            sin = 0.0  # (unused without rotary)
            cos = 0.0
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if n > 0:
            acc = _tile_scores(qa, qb, ka, kb, vt, dot, Q, K, V, DO, h, start, n, sin, cos, offs_m, offs_d, offs_h,
                               zero_s, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
                               stride_doh, BLOCK_M, BLOCK_D, ROTARY, True)
            p, inv = _probs(acc, n, qk_scale, IS_CAUSAL, BLOCK_M, acc_s)
            p = p * gl.expand_dims(inv, 1)
            pds_s.store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            dp = warpgroup_mma(dot, vt.permute((1, 0)), zero_s)
            ds = (p * (dp - gl.expand_dims(gl.sum(p * dp, 1), 1))).to(dtype)
            dv = warpgroup_mma(pds_s.permute((1, 0)), dot, zero_d)
            _store_tile(vt, dv_map, DV + h * stride_dvh, dv, dv, start, n, h * BLOCK_D, stride_dvt, BLOCK_M,
                        BLOCK_D, False)
            gl.thread_barrier()  # dV's product is done reading P
            pds_s.store(ds)
            fence_async_shared()
            gl.thread_barrier()
            if ROTARY:
                sin_h, cos_h = sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, HALF, HAS_POS, acc_h)
                dqa = warpgroup_mma(pds_s, ka, zero_h)
                dqb = warpgroup_mma(pds_s, kb, zero_h)
                _store_tile(dot, dq_map, DQ + h * stride_dqh, (dqa * cos_h + dqb * sin_h) * scale,
                            (dqb * cos_h - dqa * sin_h) * scale, start, n, h * BLOCK_D, stride_dqt, BLOCK_M, BLOCK_D,
                            True)
                dka = warpgroup_mma(pds_s.permute((1, 0)), qa, zero_h)
                dkb = warpgroup_mma(pds_s.permute((1, 0)), qb, zero_h)
                _store_tile(dot, dk_map, DK + h * stride_dkh, (dka * cos_h + dkb * sin_h) * scale,
                            (dkb * cos_h - dka * sin_h) * scale, start, n, h * BLOCK_D, stride_dkt, BLOCK_M, BLOCK_D,
                            True)
            else:
                dq = warpgroup_mma(pds_s, ka, zero_d)
                _store_tile(dot, dq_map, DQ + h * stride_dqh, dq * scale, dq, start, n, h * BLOCK_D, stride_dqt,
                            BLOCK_M, BLOCK_D, False)
                dk = warpgroup_mma(pds_s.permute((1, 0)), qa, zero_d)
                _store_tile(dot, dk_map, DK + h * stride_dkh, dk * scale, dk, start, n, h * BLOCK_D, stride_dkt,
                            BLOCK_M, BLOCK_D, False)
        gl.thread_barrier()  # every warp is done with the slot
        mbarrier.arrive(empty.index(s))


@gluon.jit(do_not_specialize=["slots", "num_seqs", "block_size", "scale", "qk_scale", "log2_theta", "kv_heads"])
def _hopper_ws_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, Sched, Pos,
    slots, num_seqs, block_size, scale, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROT_DIM: gl.constexpr,
    HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
):
    ROTARY: gl.constexpr = ROT_DIM > 0
    WIDTH: gl.constexpr = BLOCK_D // 2 if ROTARY else BLOCK_D
    dtype: gl.constexpr = Q.dtype.element_ty
    lo, hi = tile_range(slots, kv_heads)
    q_map = row_map(Q, kv_heads, stride_qt, BLOCK_M, WIDTH, HEAD_DIM)
    k_map = row_map(K, kv_heads, stride_kt, BLOCK_M, WIDTH, HEAD_DIM)
    v_map = row_map(V, kv_heads, stride_vt, BLOCK_M, BLOCK_D, HEAD_DIM)
    do_map = row_map(DO, kv_heads, stride_dot, BLOCK_M, BLOCK_D, HEAD_DIM)
    dq_map = row_map(DQ, kv_heads, stride_dqt, BLOCK_M, BLOCK_D, HEAD_DIM)
    dk_map = row_map(DK, kv_heads, stride_dkt, BLOCK_M, BLOCK_D, HEAD_DIM)
    dv_map = row_map(DV, kv_heads, stride_dvt, BLOCK_M, BLOCK_D, HEAD_DIM)
    q_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    if ROTARY:
        qb_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
        kb_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    else:
        qb_s = q_s
        kb_s = k_s
    v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], _smem_layout(BLOCK_D))
    do_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], _smem_layout(BLOCK_D))
    pds_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_M], _smem_layout(BLOCK_M))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    init_ring(ready, empty, STAGES, 1)
    gl.warp_specialize([
        (_bwd_compute, (dq_map, dk_map, dv_map, q_s, qb_s, k_s, kb_s, v_s, do_s, pds_s, ready, empty, Q, K, V, DO, DQ,
                        DK, DV, Sched, Pos, slots, num_seqs, block_size, scale, qk_scale, log2_theta, kv_heads, lo, hi,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                        stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, BLOCK_M, BLOCK_D,
                        ROTARY, HAS_POS, IS_CAUSAL, INLINE_SEQS)),
        (_loader, (q_map, k_map, v_map, do_map, q_s, qb_s, k_s, kb_s, v_s, do_s, ready, empty, Sched, slots,
                   num_seqs, block_size, kv_heads, lo, hi, HEAD_DIM, BLOCK_M, ROTARY, INLINE_SEQS, True)),
    ], [1], [LOADER_REGS])
    drop_ring(ready, empty, STAGES)


launch_fwd = Launcher(_hopper_ws_fwd_kernel, scratch=True)
launch_bwd = Launcher(_hopper_ws_bwd_kernel, scratch=True)
