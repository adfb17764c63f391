"""Block attention for Blackwell (sm_100) in Gluon: persistent, warp-specialized, TMA + mbarriers,
tcgen05 MMA into tensor memory.

NOT RUN ON sm_100 HARDWARE. These kernels are compile-checked (``compile_check --arch sm_100``:
the PTX holds tcgen05.mma / tcgen05.ld / cp.async.bulk.tensor / mbarrier waits / setmaxnreg,
and ptxas reports registers and spills) and run on the CPU through ``tests/gluon_shim.py``
(``tests/test_gluon_sm100.py``: results against the reference, stores counted, mbarrier arrivals
and bytes balanced). Their timing, races the shim cannot see, and the tensor-memory layouts are
unverified until a B200 run.

Same positional arguments as the other block kernels (``block.fwd`` / ``block.bwd``); the
constexprs are the subset these use. What they serve: fp16 / bf16, head dim 64 or 128 (HEAD_DIM
== BLOCK_D), ``BLOCK_M`` 64 or 128 (the plan's tile of blocks of 33-128 rows), no rotary or
rotary on all channels in split halves (positions given or implicit), GQA (``GROUPS`` query
heads per kv head in one tile), causal, the block table or the in-kernel schedule, 32-bit
offsets, rows 16-byte aligned with unit channel stride and the heads of a row contiguous (head
stride ``HEAD_DIM``: one ``[T, heads * D]`` tensor map covers them).

Schedule: ``min(#SMs x programs_per_sm, tiles)`` programs each take a balanced contiguous range
of (block, kv head) tiles (``sm90.persistent.tile_range``); a tile is one block of one kv head and its
``GROUPS`` query heads, a *unit* one query head of a tile. Empty table slots are skipped by every
partition alike, so their counters agree.

Forward partitions (one program):
- loader (1 warp): k, v of a tile into a ring of ``STAGES`` kv slots, q of each unit into a
  ring of ``STAGES`` q slots, by TMA for full blocks (``n == BLOCK_M``); for a ragged block only a
  bare arrival (a TMA box past the block would read the next sequence's rows);
- default (4 warps, prepare + softmax): a ragged block's rows copied with masked ``cp.async``
  (rows past the block zero-filled); rotary halves of q and k rotated in place in shared
  memory; ``opnd`` arrived; then S from tensor memory, the exact softmax (no running max), P
  normalized to shared memory;
- MMA (1 warp): S = Q K^T into tensor memory (``use_acc=False``: one tile per block; rotary:
  two half products), then O = P V into one of two tensor-memory O buffers;
- epilogue (4 warps): O from tensor memory, stored through the unit's dead q slot: a TMA store
  for a full block, 16-byte row chunks with a row mask for a ragged one; frees the q slot (and
  the kv slot after the tile's last unit) and the O buffer.

Backward partitions: the same loader (k, v per tile; q, dO per unit), the default partition
(prepare; P and dS = P (dP - rowsum(P dP)) through one shared P/dS tile; dQ rotated back and
stored through the dead dO slot; at the tile's last unit dK and dV through the dead k and v
slots) and the MMA warp (S = Q K^T, dP = dO V^T, dV += P^T dO, dQ = dS K, dK += dS^T Q; dK, dV
accumulated in tensor memory over the group's query heads: no atomics, deterministic).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout, allocate_tensor_memory, fence_async_shared, get_tmem_reg_layout, mbarrier, tcgen05_commit,
    tcgen05_mma, tma,
)

from ..common.launch import Launcher
from ..sm90.block import _block_of, _copy_halves, _copy_rows, _probs, _row_layout, _smem_layout, _store_buffer
from ..sm90.persistent import drop_ring, init_ring, row_map, tile_range
from ..sm90.rotary import _reduced, rotate_in_place, sin_cos

# Register budgets of the worker partitions (setmaxnreg); the default partition keeps the rest.
# Forward: 4 + 4 + 1 + 1 warps (12 launched): 4 x 256 + 4 x 120 + 4 x 120 registers x 32 lanes fit
# the 64K of an SM. Backward: 4 + 1 + 1 warps (8 launched). The 1-warp partitions need more
# than the usual 24-48: each finds its tiles' blocks itself (the in-kernel schedule's scan).
LOADER_REGS = gl.constexpr(120)
MMA_REGS = gl.constexpr(120)
EPILOGUE_REGS = gl.constexpr(120)
BWD_WORKER_REGS = gl.constexpr(128)
# Shared memory a program may use (sm_100: 227 KB per block), less room for barriers and scratch.
SMEM_BUDGET = 227 * 1024 - 2048


@gluon.constexpr_function
def fwd_stages(block_m, block_d):
    """Stages of the forward's kv and q rings: 3 where they fit beside the P tile, else fewer."""
    slot = 3 * block_m * block_d * 2
    for stages in (3, 2):
        if stages * slot + block_m * block_m * 2 <= SMEM_BUDGET:
            return stages
    return 1


@gluon.constexpr_function
def bwd_stages(block_m, block_d):
    """``(kv stages, q/dO stages)`` of the backward: 2 and 2 where they fit beside the P/dS tile."""
    half = 2 * block_m * block_d * 2
    for kv, qd in ((2, 2), (1, 2), (1, 1)):
        if (kv + qd) * half + block_m * block_m * 2 <= SMEM_BUDGET:
            return (kv, qd)
    return (1, 1)


@gluon.constexpr_function
def _tmem_layout(rows, cols):
    return TensorMemoryLayout(block=(rows, cols), col_stride=1)


@gluon.constexpr_function
def _tmem_regs(rows, cols):
    """Register layout of a ``[rows, cols]`` float32 tensor-memory tile read by 4 warps."""
    return get_tmem_reg_layout(gl.float32, [rows, cols], _tmem_layout(rows, cols), 4)


@gluon.jit
def _tile(Sched, slots, num_seqs, block_size, t, kv_heads, INLINE_SEQS: gl.constexpr, WARPS: gl.constexpr):
    """``(start, n, first_row)`` (int32) of tile ``t``'s block."""
    start, n, first_row = _block_of(Sched, slots, num_seqs, block_size, t // kv_heads, INLINE_SEQS, WARPS)
    return start.to(gl.int32), n.to(gl.int32), first_row.to(gl.int32)


@gluon.jit
def _tma_tile(desc, a_s, b_s, start, col, bar, ROTARY: gl.constexpr, HALF: gl.constexpr):
    """TMA copy of a row tile (its rotary halves into ``a_s``, ``b_s`` where ``ROTARY``)."""
    tma.async_copy_global_to_shared(desc, [start, col], bar, a_s)
    if ROTARY:
        tma.async_copy_global_to_shared(desc, [start, col + HALF], bar, b_s)


@gluon.jit
def _loader(q_map, k_map, v_map, do_map, qa_s, qb_s, ka_s, kb_s, v_s, do_s, q_ready, q_empty, kv_ready, kv_empty,
            Sched, slots, num_seqs, block_size, kv_heads, lo, hi,
            HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, ROTARY: gl.constexpr,
            INLINE_SEQS: gl.constexpr, KV_STAGES: gl.constexpr, Q_STAGES: gl.constexpr, WITH_DO: gl.constexpr):
    """Loader partition (1 warp): per non-empty tile k and v into the next kv slot, per unit q
    (and dO, ``WITH_DO``) into the next q slot: by TMA for a full block, else a bare arrival (the
    default partition copies a ragged block's rows itself)."""
    HALF: gl.constexpr = HEAD_DIM // 2
    TILE_BYTES: gl.constexpr = BLOCK_M * HEAD_DIM * qa_s.dtype.primitive_bitwidth // 8
    c = 0
    u = 0
    for t in range(lo, hi):
        start, n, first_row = _tile(Sched, slots, num_seqs, block_size, t, kv_heads, INLINE_SEQS, 1)
        if n > 0:
            hk = t % kv_heads
            s = c % KV_STAGES
            mbarrier.wait(kv_empty.index(s), ((c // KV_STAGES) & 1) ^ 1)
            bar = kv_ready.index(s)
            if n == BLOCK_M:
                mbarrier.expect(bar, 2 * TILE_BYTES)
                _tma_tile(k_map, ka_s.index(s), kb_s.index(s), start, hk * HEAD_DIM, bar, ROTARY, HALF)
                tma.async_copy_global_to_shared(v_map, [start, hk * HEAD_DIM], bar, v_s.index(s))
            else:
                mbarrier.arrive(bar)
            for g in gl.static_range(GROUPS):
                qs = u % Q_STAGES
                mbarrier.wait(q_empty.index(qs), ((u // Q_STAGES) & 1) ^ 1)
                qbar = q_ready.index(qs)
                col = (hk * GROUPS + g) * HEAD_DIM
                if n == BLOCK_M:
                    if WITH_DO:
                        mbarrier.expect(qbar, 2 * TILE_BYTES)
                        tma.async_copy_global_to_shared(do_map, [start, col], qbar, do_s.index(qs))
                    else:
                        mbarrier.expect(qbar, TILE_BYTES)
                    _tma_tile(q_map, qa_s.index(qs), qb_s.index(qs), start, col, qbar, ROTARY, HALF)
                else:
                    mbarrier.arrive(qbar)
                u += 1
            c += 1


@gluon.jit
def _prepare_kv(ka, kb, vt, K, V, hk, start, n, sin, cos, stride_kt, stride_kh, stride_vt, stride_vh,
                BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROTARY: gl.constexpr):
    """A tile's k and v in their slot: a ragged block's rows copied with masks (rows past the
    block zero-filled), k's rotary halves rotated in place."""
    HALF: gl.constexpr = BLOCK_D // 2
    ld: gl.constexpr = _row_layout(BLOCK_D)
    if n < BLOCK_M:
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        rows = start + offs_m
        mask = gl.expand_dims(offs_m < n, 1)
        if ROTARY:
            _copy_halves(ka, kb, K + hk * stride_kh, rows, gl.arange(0, HALF, layout=gl.SliceLayout(0, ld)), mask,
                         stride_kt, BLOCK_D, BLOCK_D, False, HALF)
        else:
            _copy_rows(ka, K + hk * stride_kh, rows, gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld)), mask,
                       stride_kt)
        _copy_rows(vt, V + hk * stride_vh, rows, gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld)), mask, stride_vt)
        async_copy.commit_group()
        async_copy.wait_group(0)
    if ROTARY:
        gl.thread_barrier()
        rotate_in_place(ka, kb, sin, cos, _row_layout(HALF))


@gluon.jit
def _prepare_q(qa, qb, dot, Q, DO, h, start, n, sin, cos, stride_qt, stride_qh, stride_dot, stride_doh,
               BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROTARY: gl.constexpr, WITH_DO: gl.constexpr):
    """A unit's q (and dO) in its slot, as ``_prepare_kv``; then fenced for the MMA warp."""
    HALF: gl.constexpr = BLOCK_D // 2
    ld: gl.constexpr = _row_layout(BLOCK_D)
    if n < BLOCK_M:
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        rows = start + offs_m
        mask = gl.expand_dims(offs_m < n, 1)
        if ROTARY:
            _copy_halves(qa, qb, Q + h * stride_qh, rows, gl.arange(0, HALF, layout=gl.SliceLayout(0, ld)), mask,
                         stride_qt, BLOCK_D, BLOCK_D, False, HALF)
        else:
            _copy_rows(qa, Q + h * stride_qh, rows, gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld)), mask,
                       stride_qt)
        if WITH_DO:
            _copy_rows(dot, DO + h * stride_doh, rows, gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld)), mask,
                       stride_dot)
        async_copy.commit_group()
        async_copy.wait_group(0)
    if ROTARY:
        gl.thread_barrier()
        rotate_in_place(qa, qb, sin, cos, _row_layout(HALF))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _sin_cos_cols(Pos, start, n, first_row, log2_theta, COL0: gl.constexpr, COLS: gl.constexpr,
                  BLOCK_M: gl.constexpr, HALF: gl.constexpr, HAS_POS: gl.constexpr, LAYOUT: gl.constexpr):
    """``sm90.rotary.sin_cos`` of the rotary pairs ``COL0 .. COL0 + COLS`` only (the same values)."""
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
    offs_r = (COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))).to(gl.float32)
    inv_freq = gl.exp2(offs_r * (log2_theta * (-1.0 / HALF)))
    if HAS_POS:
        pos = gl.load(Pos + start + offs_m, mask=offs_m < n, other=0).to(gl.float32)
        angle = _reduced(gl.expand_dims(pos, 1) * gl.expand_dims(inv_freq, 0))
    else:
        base = _reduced(first_row.to(gl.float32) * inv_freq)
        angle = gl.expand_dims(base, 0) + gl.expand_dims(offs_m.to(gl.float32), 1) * gl.expand_dims(inv_freq, 0)
    sin = gl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [angle], dtype=gl.float32, is_pure=True, pack=1)
    cos = gl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [angle], dtype=gl.float32, is_pure=True, pack=1)
    return sin, cos


@gluon.jit
def _angles_again(Pos, start, n, first_row, log2_theta, BLOCK_M: gl.constexpr, HALF: gl.constexpr,
                  HAS_POS: gl.constexpr, LAYOUT: gl.constexpr):
    """``sin_cos`` computed again, ``first_row`` and ``log2_theta`` through an opaque copy: the
    compiler would otherwise reuse the first computation's values and keep them live (implicit
    positions only: with given ones the plain recomputation spills less)."""
    if HAS_POS:
        return sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, HALF, HAS_POS, LAYOUT)
    first_row = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [first_row], dtype=gl.int32, is_pure=False,
                                          pack=1)
    log2_theta = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [log2_theta], dtype=gl.float32, is_pure=False,
                                           pack=1)
    return sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, HALF, HAS_POS, LAYOUT)


@gluon.jit
def _flush(buf, desc, ptr, start, n, col, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr):
    """Store the filled shared tile ``buf`` to rows ``start .. start + n``: a TMA store (waited for)
    for a full block, else 16-byte row chunks with a row mask."""
    if n == BLOCK_M:
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(desc, [start, col], buf)
        tma.store_wait(0)
    else:
        gl.thread_barrier()
        _store_buffer(buf, ptr, start, n, stride_t, BLOCK_M, WIDTH)
    gl.thread_barrier()


@gluon.jit
def _store_unrotated(a_buf, b_buf, whole, desc, ptr, acc, Pos, start, n, first_row, col, log2_theta, scale,
                     stride_t, BLOCK_M: gl.constexpr, HALF: gl.constexpr, HAS_POS: gl.constexpr, JOINED: gl.constexpr):
    """Store the gradient whose rotary halves are the columns ``[0, HALF)`` and ``[HALF, 2 HALF)``
    of the tensor-memory accumulator ``acc``, rotated back and scaled, ``((a cos + b sin) scale,
    (b cos - a sin) scale)``, 32 pairs at a time (their angles with them): through the half tiles
    ``a_buf``, ``b_buf`` (``desc``: half-width boxes), or, ``JOINED``, through the column halves
    ``a_buf``, ``b_buf`` of the tile ``whole`` (``desc``: full-width boxes)."""
    CW: gl.constexpr = 32
    regs: gl.constexpr = _tmem_regs(BLOCK_M, CW)
    gl.thread_barrier()  # every warp is done with the tiles
    for j in gl.static_range(HALF // CW):
        a = acc.slice(j * CW, CW).load(regs)
        b = acc.slice(HALF + j * CW, CW).load(regs)
        sin, cos = _sin_cos_cols(Pos, start, n, first_row, log2_theta, j * CW, CW, BLOCK_M, HALF, HAS_POS, regs)
        a_buf.slice(j * CW, CW, 1).store(((a * cos + b * sin) * scale).to(a_buf.dtype))
        b_buf.slice(j * CW, CW, 1).store(((b * cos - a * sin) * scale).to(b_buf.dtype))
    if JOINED:
        _flush(whole, desc, ptr, start, n, col, stride_t, BLOCK_M, 2 * HALF)
    else:
        _flush(a_buf, desc, ptr, start, n, col, stride_t, BLOCK_M, HALF)
        _flush(b_buf, desc, ptr + HALF, start, n, col + HALF, stride_t, BLOCK_M, HALF)


@gluon.jit
def _store_acc(buf, desc, ptr, acc, scale, start, n, col, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr):
    """Store the tensor-memory accumulator ``acc`` (``[BLOCK_M, WIDTH]``) times ``scale`` through
    the shared tile ``buf``, 64 columns at a time."""
    CW: gl.constexpr = 64 if WIDTH > 64 else WIDTH
    regs: gl.constexpr = _tmem_regs(BLOCK_M, CW)
    gl.thread_barrier()  # every warp is done with buf
    for j in gl.static_range(WIDTH // CW):
        buf.slice(j * CW, CW, 1).store((acc.slice(j * CW, CW).load(regs) * scale).to(buf.dtype))
    _flush(buf, desc, ptr, start, n, col, stride_t, BLOCK_M, WIDTH)


# ----------------------------------------------------------------------------- forward
@gluon.jit
def _fwd_default(qa_s, qb_s, ka_s, kb_s, v_s, p_s, s_tm, q_ready, kv_ready, opnd, s_ready, p_ready, p_free,
                 Q, K, V, Sched, Pos, slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads, lo, hi,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROTARY: gl.constexpr,
                 HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr, STAGES: gl.constexpr):
    """Default partition of the forward (4 warps): prepare each unit's operands, then its softmax."""
    HALF: gl.constexpr = BLOCK_D // 2
    s_regs: gl.constexpr = _tmem_regs(BLOCK_M, BLOCK_M)
    rot_l: gl.constexpr = _row_layout(HALF)
    c = 0
    u = 0
    for t in range(lo, hi):
        start, n, first_row = _tile(Sched, slots, num_seqs, block_size, t, kv_heads, INLINE_SEQS, 4)
        if n > 0:
            hk = t % kv_heads
            s = c % STAGES
            if ROTARY:
                # Angles while the loads are in flight.
                sin, cos = sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, HALF, HAS_POS, rot_l)
            else:
                sin = 0.0  # (unused without rotary)
                cos = 0.0
            mbarrier.wait(kv_ready.index(s), (c // STAGES) & 1)
            _prepare_kv(ka_s.index(s), kb_s.index(s), v_s.index(s), K, V, hk, start, n, sin, cos, stride_kt, stride_kh,
                        stride_vt, stride_vh, BLOCK_M, BLOCK_D, ROTARY)
            for g in gl.static_range(GROUPS):
                qs = u % STAGES
                if ROTARY:
                    if g > 0:  # (again, cheaper than keeping them live through the softmax)
                        sin, cos = _angles_again(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, HAS_POS, rot_l)
                mbarrier.wait(q_ready.index(qs), (u // STAGES) & 1)
                _prepare_q(qa_s.index(qs), qb_s.index(qs), qa_s.index(qs), Q, Q, hk * GROUPS + g, start, n, sin, cos,
                           stride_qt, stride_qh, stride_qt, stride_qh, BLOCK_M, BLOCK_D, ROTARY, False)
                mbarrier.arrive(opnd)
                mbarrier.wait(s_ready, u & 1)
                p, inv = _probs(s_tm.load(s_regs), n, qk_scale, IS_CAUSAL, BLOCK_M, s_regs)
                p = p * gl.expand_dims(inv, 1)
                mbarrier.wait(p_free, (u & 1) ^ 1)  # the previous unit's PV product is done with P
                p_s.store(p.to(p_s.dtype))
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p_ready)
                u += 1
            c += 1


@gluon.jit
def _fwd_mma(qa_s, qb_s, ka_s, kb_s, v_s, p_s, s_tm, o_tm, opnd, s_ready, p_ready, p_free, o_ready, o_free,
             Sched, slots, num_seqs, block_size, kv_heads, lo, hi,
             GROUPS: gl.constexpr, ROTARY: gl.constexpr, INLINE_SEQS: gl.constexpr, STAGES: gl.constexpr):
    """MMA partition of the forward (1 warp): S = Q K^T, then O = P V into O buffer ``u % 2``."""
    c = 0
    u = 0
    for t in range(lo, hi):
        start, n, first_row = _tile(Sched, slots, num_seqs, block_size, t, kv_heads, INLINE_SEQS, 1)
        if n > 0:
            s = c % STAGES
            for g in gl.static_range(GROUPS):
                qs = u % STAGES
                b = u % 2
                mbarrier.wait(opnd, u & 1)
                tcgen05_mma(qa_s.index(qs), ka_s.index(s).permute((1, 0)), s_tm, use_acc=False)
                if ROTARY:
                    tcgen05_mma(qb_s.index(qs), kb_s.index(s).permute((1, 0)), s_tm, use_acc=True)
                tcgen05_commit(s_ready)
                mbarrier.wait(o_free.index(b), ((u // 2) & 1) ^ 1)  # the epilogue read this O buffer
                mbarrier.wait(p_ready, u & 1)
                tcgen05_mma(p_s, v_s.index(s), o_tm.index(b), use_acc=False)
                tcgen05_commit(o_ready.index(b))
                tcgen05_commit(p_free)
                u += 1
            c += 1


@gluon.jit
def _fwd_epilogue(o_map, qa_s, qb_s, o_tm, q_empty, kv_empty, o_ready, o_free, O, Sched, slots, num_seqs, block_size,
                  kv_heads, lo, hi, stride_ot, stride_oh,
                  HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
                  ROTARY: gl.constexpr, INLINE_SEQS: gl.constexpr, STAGES: gl.constexpr):
    """Epilogue partition of the forward (4 warps): O through the unit's dead q slot; frees the
    q slot, the kv slot after the tile's last unit, and the O buffer."""
    HALF: gl.constexpr = BLOCK_D // 2
    c = 0
    u = 0
    for t in range(lo, hi):
        start, n, first_row = _tile(Sched, slots, num_seqs, block_size, t, kv_heads, INLINE_SEQS, 4)
        if n > 0:
            s = c % STAGES
            hk = t % kv_heads
            for g in gl.static_range(GROUPS):
                qs = u % STAGES
                b = u % 2
                h = hk * GROUPS + g
                mbarrier.wait(o_ready.index(b), (u // 2) & 1)
                o_acc = o_tm.index(b)
                o_ptr = O + h * stride_oh
                if ROTARY:
                    _store_acc(qa_s.index(qs), o_map, o_ptr, o_acc.slice(0, HALF), 1.0, start, n, h * HEAD_DIM,
                               stride_ot, BLOCK_M, HALF)
                    _store_acc(qb_s.index(qs), o_map, o_ptr + HALF, o_acc.slice(HALF, HALF), 1.0, start, n,
                               h * HEAD_DIM + HALF, stride_ot, BLOCK_M, HALF)
                else:
                    _store_acc(qa_s.index(qs), o_map, o_ptr, o_acc, 1.0, start, n, h * HEAD_DIM, stride_ot, BLOCK_M,
                               BLOCK_D)
                mbarrier.arrive(o_free.index(b))
                mbarrier.arrive(q_empty.index(qs))
                if g == GROUPS - 1:
                    mbarrier.arrive(kv_empty.index(s))
                u += 1
            c += 1


@gluon.jit(do_not_specialize=["slots", "num_seqs", "block_size", "qk_scale", "log2_theta", "kv_heads"])
def _sm100_fwd_kernel(
    Q, K, V, O, Sched, Pos,
    slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
    HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
    ROT_DIM: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
):
    ROTARY: gl.constexpr = ROT_DIM > 0
    WIDTH: gl.constexpr = BLOCK_D // 2 if ROTARY else BLOCK_D
    STAGES: gl.constexpr = fwd_stages(BLOCK_M, BLOCK_D)
    dtype: gl.constexpr = Q.dtype.element_ty
    lo, hi = tile_range(slots, kv_heads)
    q_map = row_map(Q, kv_heads * GROUPS, stride_qt, BLOCK_M, WIDTH, HEAD_DIM)
    k_map = row_map(K, kv_heads, stride_kt, BLOCK_M, WIDTH, HEAD_DIM)
    v_map = row_map(V, kv_heads, stride_vt, BLOCK_M, BLOCK_D, HEAD_DIM)
    o_map = row_map(O, kv_heads * GROUPS, stride_ot, BLOCK_M, WIDTH, HEAD_DIM)
    qa_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    ka_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    if ROTARY:
        qb_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
        kb_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    else:
        qb_s = qa_s
        kb_s = ka_s
    v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], _smem_layout(BLOCK_D))
    p_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_M], _smem_layout(BLOCK_M))
    s_tm = allocate_tensor_memory(gl.float32, [BLOCK_M, BLOCK_M], _tmem_layout(BLOCK_M, BLOCK_M))
    o_tm = allocate_tensor_memory(gl.float32, [2, BLOCK_M, BLOCK_D], _tmem_layout(BLOCK_M, BLOCK_D))
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    o_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    o_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    hand = gl.allocate_shared_memory(gl.int64, [4, 1], bar_l)  # opnd, s_ready, p_ready, p_free
    init_ring(q_ready, q_empty, STAGES, 1)
    init_ring(kv_ready, kv_empty, STAGES, 1)
    init_ring(o_ready, o_free, 2, 1)
    for i in gl.static_range(4):
        mbarrier.init(hand.index(i), count=1)
    opnd, s_ready, p_ready, p_free = hand.index(0), hand.index(1), hand.index(2), hand.index(3)
    gl.warp_specialize([
        (_fwd_default, (qa_s, qb_s, ka_s, kb_s, v_s, p_s, s_tm, q_ready, kv_ready, opnd, s_ready, p_ready, p_free,
                        Q, K, V, Sched, Pos, slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads, lo, hi,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        GROUPS, BLOCK_M, BLOCK_D, ROTARY, HAS_POS, IS_CAUSAL, INLINE_SEQS, STAGES)),
        (_fwd_epilogue, (o_map, qa_s, qb_s, o_tm, q_empty, kv_empty, o_ready, o_free, O, Sched, slots, num_seqs,
                         block_size, kv_heads, lo, hi, stride_ot, stride_oh,
                         HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, ROTARY, INLINE_SEQS, STAGES)),
        (_loader, (q_map, k_map, v_map, v_map, qa_s, qb_s, ka_s, kb_s, v_s, v_s, q_ready, q_empty, kv_ready, kv_empty,
                   Sched, slots, num_seqs, block_size, kv_heads, lo, hi,
                   HEAD_DIM, GROUPS, BLOCK_M, ROTARY, INLINE_SEQS, STAGES, STAGES, False)),
        (_fwd_mma, (qa_s, qb_s, ka_s, kb_s, v_s, p_s, s_tm, o_tm, opnd, s_ready, p_ready, p_free, o_ready, o_free,
                    Sched, slots, num_seqs, block_size, kv_heads, lo, hi, GROUPS, ROTARY, INLINE_SEQS, STAGES)),
    ], [4, 1, 1], [EPILOGUE_REGS, LOADER_REGS, MMA_REGS])
    drop_ring(q_ready, q_empty, STAGES)
    drop_ring(kv_ready, kv_empty, STAGES)
    drop_ring(o_ready, o_free, 2)
    for i in gl.static_range(4):
        mbarrier.invalidate(hand.index(i))


# ----------------------------------------------------------------------------- backward
@gluon.jit
def _bwd_default(dq_map, dk_map, dv_map, qa_s, qb_s, ka_s, kb_s, v_s, do_s, pds_s, sq_tm, dp_tm, dk_tm, dv_tm,
                 q_ready, q_empty, kv_ready, kv_empty, opnd, s_ready, p_ready, p_free, ds_ready, dq_ready, unit_done,
                 dkv_ready, Q, K, V, DO, DQ, DK, DV, Sched, Pos, slots, num_seqs, block_size, scale, qk_scale,
                 log2_theta, kv_heads, lo, hi, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                 HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
                 ROTARY: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
                 KV_STAGES: gl.constexpr, Q_STAGES: gl.constexpr):
    """Default partition of the backward (4 warps): prepare, P, dS, and the stores."""
    HALF: gl.constexpr = BLOCK_D // 2
    CW: gl.constexpr = 64
    s_regs: gl.constexpr = _tmem_regs(BLOCK_M, BLOCK_M)
    c_regs: gl.constexpr = _tmem_regs(BLOCK_M, CW)
    rot_l: gl.constexpr = _row_layout(HALF)
    c = 0
    u = 0
    for t in range(lo, hi):
        start, n, first_row = _tile(Sched, slots, num_seqs, block_size, t, kv_heads, INLINE_SEQS, 4)
        if n > 0:
            hk = t % kv_heads
            s = c % KV_STAGES
            if ROTARY:
                sin, cos = sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, HALF, HAS_POS, rot_l)
            else:
                sin = 0.0  # (unused without rotary)
                cos = 0.0
            mbarrier.wait(kv_ready.index(s), (c // KV_STAGES) & 1)
            _prepare_kv(ka_s.index(s), kb_s.index(s), v_s.index(s), K, V, hk, start, n, sin, cos, stride_kt, stride_kh,
                        stride_vt, stride_vh, BLOCK_M, BLOCK_D, ROTARY)
            for g in gl.static_range(GROUPS):
                qs = u % Q_STAGES
                h = hk * GROUPS + g
                if ROTARY:
                    if g > 0:  # (again, cheaper than keeping them live through the softmax)
                        sin, cos = _angles_again(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, HAS_POS, rot_l)
                mbarrier.wait(q_ready.index(qs), (u // Q_STAGES) & 1)
                _prepare_q(qa_s.index(qs), qb_s.index(qs), do_s.index(qs), Q, DO, h, start, n, sin, cos,
                           stride_qt, stride_qh, stride_dot, stride_doh, BLOCK_M, BLOCK_D, ROTARY, True)
                mbarrier.arrive(opnd)
                mbarrier.wait(s_ready, u & 1)
                p, inv = _probs(sq_tm.slice(0, BLOCK_M).load(s_regs), n, qk_scale, IS_CAUSAL, BLOCK_M, s_regs)
                p = p * gl.expand_dims(inv, 1)
                pds_s.store(p.to(pds_s.dtype))
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p_ready)
                # dS = P (dP - rowsum(P dP)), 64 columns at a time, P read back from its tile.
                delta = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, c_regs))
                mbarrier.wait(p_free, u & 1)  # dV's product is done reading P
                for j in gl.static_range(BLOCK_M // CW):
                    pj = pds_s.slice(j * CW, CW, 1).load(c_regs).to(gl.float32)
                    delta += gl.sum(pj * dp_tm.slice(j * CW, CW).load(c_regs), 1)
                gl.thread_barrier()  # every warp has read P
                for j in gl.static_range(BLOCK_M // CW):
                    pj = pds_s.slice(j * CW, CW, 1).load(c_regs).to(gl.float32)
                    dsj = pj * (dp_tm.slice(j * CW, CW).load(c_regs) - gl.expand_dims(delta, 1))
                    pds_s.slice(j * CW, CW, 1).store(dsj.to(pds_s.dtype))
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ds_ready)
                # dQ through the dead dO slot (dP's and dV's products are done with it).
                mbarrier.wait(dq_ready, u & 1)
                dq_ptr = DQ + h * stride_dqh
                dob = do_s.index(qs)
                if ROTARY:
                    _store_unrotated(dob.slice(0, HALF, 1), dob.slice(HALF, HALF, 1), dob, dq_map, dq_ptr, sq_tm, Pos,
                                     start, n, first_row, h * HEAD_DIM, log2_theta, scale, stride_dqt, BLOCK_M, HALF,
                                     HAS_POS, True)
                else:
                    _store_acc(dob, dq_map, dq_ptr, sq_tm.slice(0, BLOCK_D), scale, start, n, h * HEAD_DIM,
                               stride_dqt, BLOCK_M, BLOCK_D)
                mbarrier.wait(unit_done, u & 1)  # dK's product is done with q and dS
                mbarrier.arrive(q_empty.index(qs))
                u += 1
            # dK and dV of the group through the dead k and v slots.
            mbarrier.wait(dkv_ready, c & 1)
            dk_ptr = DK + hk * stride_dkh
            if ROTARY:
                _store_unrotated(ka_s.index(s), kb_s.index(s), ka_s.index(s), dk_map, dk_ptr, dk_tm, Pos, start, n,
                                 first_row, hk * HEAD_DIM, log2_theta, scale, stride_dkt, BLOCK_M, HALF, HAS_POS, False)
            else:
                _store_acc(ka_s.index(s), dk_map, dk_ptr, dk_tm, scale, start, n, hk * HEAD_DIM, stride_dkt, BLOCK_M,
                           BLOCK_D)
            _store_acc(v_s.index(s), dv_map, DV + hk * stride_dvh, dv_tm, 1.0, start, n, hk * HEAD_DIM, stride_dvt,
                       BLOCK_M, BLOCK_D)
            mbarrier.arrive(kv_empty.index(s))
            c += 1


@gluon.jit
def _bwd_mma(qa_s, qb_s, ka_s, kb_s, v_s, do_s, pds_s, sq_tm, dp_tm, dk_tm, dv_tm, opnd, s_ready, p_ready, p_free,
             ds_ready, dq_ready, unit_done, dkv_ready, Sched, slots, num_seqs, block_size, kv_heads, lo, hi,
             GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROTARY: gl.constexpr,
             INLINE_SEQS: gl.constexpr, KV_STAGES: gl.constexpr, Q_STAGES: gl.constexpr):
    """MMA partition of the backward (1 warp)."""
    HALF: gl.constexpr = BLOCK_D // 2
    c = 0
    u = 0
    for t in range(lo, hi):
        start, n, first_row = _tile(Sched, slots, num_seqs, block_size, t, kv_heads, INLINE_SEQS, 1)
        if n > 0:
            s = c % KV_STAGES
            ka, kb, vt = ka_s.index(s), kb_s.index(s), v_s.index(s)
            for g in gl.static_range(GROUPS):
                qs = u % Q_STAGES
                qa, qb, dot = qa_s.index(qs), qb_s.index(qs), do_s.index(qs)
                mbarrier.wait(opnd, u & 1)
                s_acc = sq_tm.slice(0, BLOCK_M)
                tcgen05_mma(qa, ka.permute((1, 0)), s_acc, use_acc=False)
                if ROTARY:
                    tcgen05_mma(qb, kb.permute((1, 0)), s_acc, use_acc=True)
                tcgen05_mma(dot, vt.permute((1, 0)), dp_tm, use_acc=False)
                tcgen05_commit(s_ready)
                mbarrier.wait(p_ready, u & 1)
                tcgen05_mma(pds_s.permute((1, 0)), dot, dv_tm, use_acc=g > 0)
                tcgen05_commit(p_free)
                mbarrier.wait(ds_ready, u & 1)
                if ROTARY:
                    tcgen05_mma(pds_s, ka, sq_tm.slice(0, HALF), use_acc=False)
                    tcgen05_mma(pds_s, kb, sq_tm.slice(HALF, HALF), use_acc=False)
                    tcgen05_commit(dq_ready)
                    tcgen05_mma(pds_s.permute((1, 0)), qa, dk_tm.slice(0, HALF), use_acc=g > 0)
                    tcgen05_mma(pds_s.permute((1, 0)), qb, dk_tm.slice(HALF, HALF), use_acc=g > 0)
                else:
                    tcgen05_mma(pds_s, ka, sq_tm.slice(0, BLOCK_D), use_acc=False)
                    tcgen05_commit(dq_ready)
                    tcgen05_mma(pds_s.permute((1, 0)), qa, dk_tm, use_acc=g > 0)
                tcgen05_commit(unit_done)
                u += 1
            tcgen05_commit(dkv_ready)
            c += 1


@gluon.jit(do_not_specialize=["slots", "num_seqs", "block_size", "scale", "qk_scale", "log2_theta", "kv_heads"])
def _sm100_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, Sched, Pos,
    slots, num_seqs, block_size, scale, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
    ROT_DIM: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
):
    ROTARY: gl.constexpr = ROT_DIM > 0
    WIDTH: gl.constexpr = BLOCK_D // 2 if ROTARY else BLOCK_D
    STAGES: gl.constexpr = bwd_stages(BLOCK_M, BLOCK_D)
    KV_STAGES: gl.constexpr = STAGES[0]
    Q_STAGES: gl.constexpr = STAGES[1]
    SQ_COLS: gl.constexpr = BLOCK_M if BLOCK_M > BLOCK_D else BLOCK_D
    dtype: gl.constexpr = Q.dtype.element_ty
    heads = kv_heads * GROUPS
    lo, hi = tile_range(slots, kv_heads)
    q_map = row_map(Q, heads, stride_qt, BLOCK_M, WIDTH, HEAD_DIM)
    k_map = row_map(K, kv_heads, stride_kt, BLOCK_M, WIDTH, HEAD_DIM)
    v_map = row_map(V, kv_heads, stride_vt, BLOCK_M, BLOCK_D, HEAD_DIM)
    do_map = row_map(DO, heads, stride_dot, BLOCK_M, BLOCK_D, HEAD_DIM)
    dq_map = row_map(DQ, heads, stride_dqt, BLOCK_M, BLOCK_D, HEAD_DIM)  # (dQ leaves through dO's tile)
    dk_map = row_map(DK, kv_heads, stride_dkt, BLOCK_M, WIDTH, HEAD_DIM)
    dv_map = row_map(DV, kv_heads, stride_dvt, BLOCK_M, BLOCK_D, HEAD_DIM)
    qa_s = gl.allocate_shared_memory(dtype, [Q_STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    ka_s = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    if ROTARY:
        qb_s = gl.allocate_shared_memory(dtype, [Q_STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
        kb_s = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_M, WIDTH], _smem_layout(WIDTH))
    else:
        qb_s = qa_s
        kb_s = ka_s
    v_s = gl.allocate_shared_memory(dtype, [KV_STAGES, BLOCK_M, BLOCK_D], _smem_layout(BLOCK_D))
    do_s = gl.allocate_shared_memory(dtype, [Q_STAGES, BLOCK_M, BLOCK_D], _smem_layout(BLOCK_D))
    pds_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_M], _smem_layout(BLOCK_M))
    # S and later dQ share columns (S is read before dQ's product is issued).
    sq_tm = allocate_tensor_memory(gl.float32, [BLOCK_M, SQ_COLS], _tmem_layout(BLOCK_M, SQ_COLS))
    dp_tm = allocate_tensor_memory(gl.float32, [BLOCK_M, BLOCK_M], _tmem_layout(BLOCK_M, BLOCK_M))
    dk_tm = allocate_tensor_memory(gl.float32, [BLOCK_M, BLOCK_D], _tmem_layout(BLOCK_M, BLOCK_D))
    dv_tm = allocate_tensor_memory(gl.float32, [BLOCK_M, BLOCK_D], _tmem_layout(BLOCK_M, BLOCK_D))
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], bar_l)
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], bar_l)
    kv_ready = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], bar_l)
    kv_empty = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], bar_l)
    # opnd, s_ready, p_ready, p_free, ds_ready, dq_ready, unit_done, dkv_ready
    hand = gl.allocate_shared_memory(gl.int64, [8, 1], bar_l)
    init_ring(q_ready, q_empty, Q_STAGES, 1)
    init_ring(kv_ready, kv_empty, KV_STAGES, 1)
    for i in gl.static_range(8):
        mbarrier.init(hand.index(i), count=1)
    gl.warp_specialize([
        (_bwd_default, (dq_map, dk_map, dv_map, qa_s, qb_s, ka_s, kb_s, v_s, do_s, pds_s, sq_tm, dp_tm, dk_tm, dv_tm,
                        q_ready, q_empty, kv_ready, kv_empty, hand.index(0), hand.index(1), hand.index(2),
                        hand.index(3), hand.index(4), hand.index(5), hand.index(6), hand.index(7),
                        Q, K, V, DO, DQ, DK, DV, Sched, Pos, slots, num_seqs, block_size, scale, qk_scale, log2_theta,
                        kv_heads, lo, hi, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                        HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, ROTARY, HAS_POS, IS_CAUSAL, INLINE_SEQS, KV_STAGES,
                        Q_STAGES)),
        (_loader, (q_map, k_map, v_map, do_map, qa_s, qb_s, ka_s, kb_s, v_s, do_s, q_ready, q_empty, kv_ready,
                   kv_empty, Sched, slots, num_seqs, block_size, kv_heads, lo, hi,
                   HEAD_DIM, GROUPS, BLOCK_M, ROTARY, INLINE_SEQS, KV_STAGES, Q_STAGES, True)),
        (_bwd_mma, (qa_s, qb_s, ka_s, kb_s, v_s, do_s, pds_s, sq_tm, dp_tm, dk_tm, dv_tm, hand.index(0), hand.index(1),
                    hand.index(2), hand.index(3), hand.index(4), hand.index(5), hand.index(6), hand.index(7),
                    Sched, slots, num_seqs, block_size, kv_heads, lo, hi,
                    GROUPS, BLOCK_M, BLOCK_D, ROTARY, INLINE_SEQS, KV_STAGES, Q_STAGES)),
    ], [1, 1], [BWD_WORKER_REGS, BWD_WORKER_REGS])
    drop_ring(q_ready, q_empty, Q_STAGES)
    drop_ring(kv_ready, kv_empty, KV_STAGES)
    for i in gl.static_range(8):
        mbarrier.invalidate(hand.index(i))


launch_fwd = Launcher(_sm100_fwd_kernel, scratch=True)
launch_bwd = Launcher(_sm100_bwd_kernel, scratch=True)
