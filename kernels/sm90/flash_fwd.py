"""Warp-specialized flash-attention forward for Hopper (sm_90) in Gluon: the forward the
``triton_flash`` backend takes at D 128 and D 64, full attention and blocks over 128 tokens
(``ops.backends.triton_flash.gluon_forward_taken``; with unverified kernels allowed, for every call it
admits).

One program per 128-row query tile of a block (the flash tile table, longest blocks first) and
query head. Three partitions share the program's shared memory:

- a one-warp loader: the query tile (two 64-row halves) once, then each key tile's k and v into
  a ring of ``STAGES`` slots, all by TMA;
- two consumer warpgroups, one per 64-row half of the query tile: per key tile ``S = Q K^T``
  by wgmma from the shared tiles, the online softmax in registers (running max and sum in
  float32), ``O += P V`` with ``P`` from registers; each releases the slot after its product,
  and the loader refills it once both have. ``CONSUMER_LOOP`` can have the consumers overlap
  their products with their softmax (``OVERLAP``) and take turns (``PINGPONG``), as
  FlashAttention-3 does: GPU-tested, but slower on the H200, so off.

Every tensor map is made in the kernel over the rows of the program's own block
(``tma.make_tensor_descriptor`` on ``[n, heads * D]`` from the block's first row), so a box
past the block's end is zero-filled on load and clipped on store: no tile reads or writes
another block's rows, and a key tile at the block's end needs only its score columns masked.
The output leaves through the dead query tile by a TMA store; the natural-log logsumexp of
each row's scaled scores goes to ``lse [H, T]`` for the backward, as ``flash.fwd`` writes it.

Admitted calls (``kernels.flash.gluon_fwd_reasons``): sm_90, bf16 / fp16, head dims 64 and
128, no rotary, rows of ``H * D`` contiguous elements, 32-bit offsets. Compile-checked and run
on CPU tensors through ``tests/gluon_shim.py``; GPU tests passed on the H200 (2026-12-01), where it
is 1.02-1.06x faster than the Triton forward on full attention and 1.1-1.4x slower at blocks of
256 and 512 (BENCHMARKS.md, session 16).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from ..common.launch import Launcher
from ..common.meta import LOG2E, empty_contiguous, needs_int64
from ..flash.schedule import FlashSchedule
from .block import _acc_layout, _smem_layout
from .persistent import drop_ring, init_ring, release_slot

STAGES = gl.constexpr(2)
LOADER_REGS = gl.constexpr(40)
CONSUMER_REGS = gl.constexpr(232)
# The overlapped consumers hold two score tiles: at 232 registers ptxas spilled 44-68 bytes for
# sm_90 at D 128, at 240 (the loader at 24, FA3's split) none.
OVERLAP_LOADER_REGS = gl.constexpr(24)
OVERLAP_CONSUMER_REGS = gl.constexpr(240)
HALF_M = gl.constexpr(64)  # query rows per consumer warpgroup
TILE_M = 128  # query rows per program: two consumer warpgroups of 64
TILE_N = 128  # key rows per ring slot
_LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def block_map(ptr, start, n, heads, stride_t, BOX_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Tensor map of the block's rows ``[start, start + n)`` of the ``[T, heads * HEAD_DIM]`` view,
    ``[BOX_ROWS, HEAD_DIM]`` boxes (past row ``n``: zeros on load, dropped on store)."""
    return tma.make_tensor_descriptor(ptr + start * stride_t, [n, heads * HEAD_DIM], [stride_t, 1],
                                      [BOX_ROWS, HEAD_DIM], _smem_layout(HEAD_DIM))


@gluon.jit
def table_tile(Table, slots, per_slot):
    """``(start, n, tile_row, inner)`` of this program's entry of a flash tile table (its block's
    first token and length, the tile's first row in the block), the programs taking each entry
    ``per_slot`` times in a row (``inner``: which time, e.g. a head)."""
    pid = gl.program_id(0)
    slot = pid // per_slot
    return gl.load(Table + slot), gl.load(Table + slots + slot), gl.load(Table + 3 * slots + slot), pid % per_slot


@gluon.jit
def key_tiles(n, tile_row, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """``(tiles, unmasked)``: the key tiles a query tile from row ``tile_row`` visits, and how many of
    the first ones need no mask (wholly inside the block and, causal, left of the tile's first row)."""
    end = n
    unmasked = n // BLOCK_N
    if IS_CAUSAL:
        end = gl.minimum(n, tile_row + BLOCK_M)
        unmasked = gl.minimum(unmasked, tile_row // BLOCK_N)
    return (end + BLOCK_N - 1) // BLOCK_N, unmasked


@gluon.jit
def _loader(q_s, k_s, v_s, q_bar, kv_ready, kv_empty, Q, K, V, start, n, tile_row, h, hk, heads, kv_heads, tiles,
            stride_qt, stride_kt, stride_vt, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Loader partition: the two query halves, then k and v of each key tile into the ring."""
    q_map = block_map(Q, start, n, heads, stride_qt, HALF_M, HEAD_DIM)
    k_map = block_map(K, start, n, kv_heads, stride_kt, BLOCK_N, HEAD_DIM)
    v_map = block_map(V, start, n, kv_heads, stride_vt, BLOCK_N, HEAD_DIM)
    nbytes: gl.constexpr = HEAD_DIM * q_s.dtype.primitive_bitwidth // 8
    mbarrier.expect(q_bar, 2 * HALF_M * nbytes)
    tma.async_copy_global_to_shared(q_map, [tile_row, h * HEAD_DIM], q_bar, q_s.index(0))
    tma.async_copy_global_to_shared(q_map, [tile_row + HALF_M, h * HEAD_DIM], q_bar, q_s.index(1))
    for j in range(tiles):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        bar = kv_ready.index(s)
        mbarrier.expect(bar, 2 * BLOCK_N * nbytes)
        tma.async_copy_global_to_shared(k_map, [j * BLOCK_N, hk * HEAD_DIM], bar, k_s.index(s))
        tma.async_copy_global_to_shared(v_map, [j * BLOCK_N, hk * HEAD_DIM], bar, v_s.index(s))


@gluon.jit
def last_tile_row(j, n, BLOCK_N: gl.constexpr):
    """The first key of key tile ``j`` of an ``n``-key block when a tile reaching past the block is
    shifted back to end at its last key (blocks of at least ``BLOCK_N`` keys; a shorter block's one
    tile stays at 0)."""
    return gl.minimum(j * BLOCK_N, gl.maximum(n - BLOCK_N, 0))


@gluon.jit
def _online_softmax(scores, j, unmasked, rows, n, m_i, l_i, qk_scale, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr,
                    SHIFT_LAST: gl.constexpr = False):
    """Key tile ``j``'s raw scores -> ``(p, alpha, m_new, l_new)``: its probabilities against the
    running row maxima ``m_new`` (log2 units), the factor ``alpha`` that rescales what came before,
    and the running sums. ``SHIFT_LAST``: a tile reaching past the block holds its last ``BLOCK_N``
    keys instead (``last_tile_row``), its columns before key ``j * BLOCK_N`` masked."""
    acc_s: gl.constexpr = _acc_layout(BLOCK_N)
    if j >= unmasked:
        # Columns past the block (zero-filled keys) and, causal, right of each row's diagonal.
        if SHIFT_LAST:
            cols = last_tile_row(j, n, BLOCK_N) + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_s))
            valid = gl.expand_dims((cols < n) & (cols >= j * BLOCK_N), 0)
        else:
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_s))
            valid = gl.expand_dims(cols < n, 0)
        if IS_CAUSAL:
            valid = valid & (gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0))
        scores = gl.where(valid, scores, float("-inf"))
    # Every row has an allowed column in the first key tile (column 0; padding rows too), so
    # m_new is finite from the first tile on and no row divides by zero.
    m_new = gl.maximum(m_i, gl.max(scores, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(scores * qk_scale - gl.expand_dims(m_new, 1))
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _release(kv_empty, s, BY_THREADS: gl.constexpr = False):
    release_slot(kv_empty.index(s), BY_THREADS)


@gluon.jit
def _consumer(half, q_s, k_s, v_s, q_bar, kv_ready, kv_empty, turn, O, Lse, start, n, tile_row, h, heads, tiles,
              unmasked, qk_scale, stride_ot, stride_lh, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              IS_CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr):
    """Consumer partition (one warpgroup): rows ``tile_row + 64 * half`` onwards of the query tile.

    ``OVERLAP`` (as FlashAttention-3 orders it): per key tile ``j``, issue ``S = Q K^T`` of tile
    ``j + 1`` and ``O += P V`` of tile ``j`` asynchronously, wait for ``S`` only, and run tile
    ``j + 1``'s softmax while ``P V`` is still on the tensor cores. ``PINGPONG`` (with
    ``OVERLAP``): the two warpgroups take turns to issue their products (the ``turn`` mbarriers),
    so one's softmax runs under the other's products."""
    dtype: gl.constexpr = q_s.dtype
    acc_s: gl.constexpr = _acc_layout(BLOCK_N)
    acc_d: gl.constexpr = _acc_layout(HEAD_DIM)
    a_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_d, k_width=2)
    first = tile_row + half * HALF_M
    rows = first + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc_s))
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, gl.SliceLayout(1, acc_s))
    l_i = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, acc_s))
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, acc_d)
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_s)
    q = q_s.index(half)
    mbarrier.wait(q_bar, 0)
    if OVERLAP:
        mbarrier.wait(kv_ready.index(0), 0)
        scores = warpgroup_mma(q, k_s.index(0).permute((1, 0)), zero_s, use_acc=False)
        p, alpha, m_i, l_i = _online_softmax(scores, 0, unmasked, rows, n, m_i, l_i, qk_scale, BLOCK_N, IS_CAUSAL)
        for j in range(tiles - 1):
            s = j % STAGES
            t = (j + 1) % STAGES
            if PINGPONG:
                # Warpgroup 0 goes first; each waits for the other's previous turn.
                if half == 0:
                    if j > 0:
                        mbarrier.wait(turn.index(0), (j - 1) & 1)
                else:
                    mbarrier.wait(turn.index(1), j & 1)
            mbarrier.wait(kv_ready.index(t), ((j + 1) // STAGES) & 1)
            scores = warpgroup_mma(q, k_s.index(t).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), v_s.index(s), acc, is_async=True)
            if PINGPONG:
                gl.thread_barrier()  # the whole warpgroup has issued its products
                mbarrier.arrive(turn.index(1 - half))
            scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
            p, alpha, m_i, l_i = _online_softmax(scores, j + 1, unmasked, rows, n, m_i, l_i, qk_scale, BLOCK_N,
                                                 IS_CAUSAL)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release(kv_empty, s)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_d)), 1)
        last = (tiles - 1) % STAGES
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), v_s.index(last), acc)
        _release(kv_empty, last)
    else:
        for j in range(tiles):
            s = j % STAGES
            mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
            scores = warpgroup_mma(q, k_s.index(s).permute((1, 0)), zero_s)
            p, alpha, m_i, l_i = _online_softmax(scores, j, unmasked, rows, n, m_i, l_i, qk_scale, BLOCK_N, IS_CAUSAL)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc_d)), 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), v_s.index(s), acc)
            _release(kv_empty, s)
    o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, acc_d)), 1)
    o_map = block_map(O, start, n, heads, stride_ot, HALF_M, HEAD_DIM)
    q.store(o.to(dtype))  # the query half is dead: its tile stages the output
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(o_map, [first, h * HEAD_DIM], q)
    gl.store(Lse + h * stride_lh + start + rows, (m_i + gl.log2(l_i)) * _LN2, mask=rows < n)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["slots", "heads", "kv_heads", "qk_scale", "stride_lh"])
def _flash_fwd_ws_kernel(
    Q, K, V, O, Lse, Table, slots, heads, kv_heads, qk_scale, stride_qt, stride_kt, stride_vt, stride_ot, stride_lh,
    HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    IS_CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
):
    start, n, tile_row, h = table_tile(Table, slots, heads)
    if n > 0:
        dtype: gl.constexpr = Q.dtype.element_ty
        layout: gl.constexpr = _smem_layout(HEAD_DIM)
        q_s = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], layout)
        k_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
        v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar.index(0), count=1)
        if PINGPONG:
            mbarrier.init(turn.index(0), count=1)
            mbarrier.init(turn.index(1), count=1)
        init_ring(kv_ready, kv_empty, STAGES, 2)  # a slot is free once both consumers are done with it
        tiles, unmasked = key_tiles(n, tile_row, BLOCK_M, BLOCK_N, IS_CAUSAL)
        gl.warp_specialize([
            (_consumer, (0, q_s, k_s, v_s, q_bar.index(0), kv_ready, kv_empty, turn, O, Lse, start, n, tile_row,
                         h, heads, tiles, unmasked, qk_scale, stride_ot, stride_lh, BLOCK_N, HEAD_DIM, IS_CAUSAL,
                         OVERLAP, PINGPONG)),
            (_consumer, (1, q_s, k_s, v_s, q_bar.index(0), kv_ready, kv_empty, turn, O, Lse, start, n, tile_row,
                         h, heads, tiles, unmasked, qk_scale, stride_ot, stride_lh, BLOCK_N, HEAD_DIM, IS_CAUSAL,
                         OVERLAP, PINGPONG)),
            (_loader, (q_s, k_s, v_s, q_bar.index(0), kv_ready, kv_empty, Q, K, V, start, n, tile_row, h,
                       h // GROUPS, heads, kv_heads, tiles, stride_qt, stride_kt, stride_vt, BLOCK_N, HEAD_DIM)),
        ], [4, 1], [OVERLAP_CONSUMER_REGS if OVERLAP else CONSUMER_REGS,
                    OVERLAP_LOADER_REGS if OVERLAP else LOADER_REGS])
        mbarrier.invalidate(q_bar.index(0))
        if PINGPONG:
            mbarrier.invalidate(turn.index(0))
            mbarrier.invalidate(turn.index(1))
        drop_ring(kv_ready, kv_empty, STAGES)


launch_fwd = Launcher(_flash_fwd_ws_kernel, scratch=True)


def flash_ws_fact_reasons(major, dtype, head_dim: int, rotary: bool, head_dims: tuple = (64, 128)) -> list:
    """Why the warp-specialized forward (or a kernel admitting ``head_dims``) cannot take calls of these facts
    (empty: it can; ``major`` the CUDA device's compute capability major, None off CUDA)."""
    reasons = []
    if major != 9:
        reasons.append("an sm_90 GPU")
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append("fp16 or bf16 q, k, v")
    if head_dim not in head_dims:
        dims = ", ".join(str(d) for d in head_dims[:-1])
        reasons.append(f"head dim {dims} or {head_dims[-1]} (got {head_dim})")
    if rotary:
        reasons.append("no rotary")
    return reasons


def flash_ws_call_reasons(device, dtype, head_dim: int, rope_theta, head_dims: tuple = (64, 128)) -> list:
    """:func:`flash_ws_fact_reasons` on ``device`` (``rope_theta`` None: no rotary)."""
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None
    return flash_ws_fact_reasons(major, dtype, head_dim, rope_theta is not None, head_dims)


def flash_ws_reasons(q, k, v, rope_theta, head_dims: tuple = (64, 128)) -> list:
    """:func:`flash_ws_call_reasons` of a call, and what its tensors' layout must be."""
    reasons = flash_ws_call_reasons(q.device, q.dtype, q.shape[-1], rope_theta, head_dims)
    if not (q.dtype == k.dtype == v.dtype):
        reasons.append("q, k, v of one dtype")
    if any(x.stride(-1) != 1 or x.stride(1) != x.shape[-1] for x in (q, k, v)):
        reasons.append("rows of H * D contiguous elements")
    if any(x.stride(0) * x.element_size() % 16 or x.data_ptr() % 16 for x in (q, k, v)):
        reasons.append("16-byte aligned rows")
    if needs_int64(q, k, v):
        reasons.append("32-bit offsets")
    return reasons


# The consumers' loop: "serial" (one product after the other), "overlap" (``OVERLAP``) or
# "pingpong" (``OVERLAP`` and ``PINGPONG``). All three passed the GPU tests on the H200
# (2026-12-02); the FlashAttention-3 loops were slower there (ms, serial / overlap / pingpong:
# seed3 1.424 / 1.538 / 1.472, seed3 causal 0.823 / 0.926 / 0.884, blocks of 512 3.97 / 4.18 /
# 4.14; BENCHMARKS.md, session 17), so the serial loop is the one taken.
CONSUMER_LOOP = "serial"


def overlap_taken() -> bool:
    """Whether the consumers overlap one key tile's ``Q K^T`` with the previous one's softmax
    (``OVERLAP``): ``CONSUMER_LOOP`` "overlap" or "pingpong"."""
    return CONSUMER_LOOP in ("overlap", "pingpong")


def pingpong_taken() -> bool:
    """Whether the overlapped consumers also take turns (``PINGPONG``): ``CONSUMER_LOOP`` "pingpong"."""
    return CONSUMER_LOOP == "pingpong"


def outputs_and_table(q, offsets, block_size: int, cpu_offsets, tile_m: int = TILE_M):
    """``(o, lse, sched, table)`` of a forward call: its outputs (unwritten), and the flash tile
    schedule and table of its ``tile_m``-row query tiles (``table`` None where there is no tile)."""
    total, heads, _ = q.shape
    o = empty_contiguous(q)
    lse = torch.empty((heads, total), dtype=torch.float32, device=q.device)
    if total == 0:
        return o, lse, None, None
    sched = FlashSchedule(offsets, total, block_size, tile_m, cpu_offsets, longest_first=block_size == 0)
    if sched.programs == 0:
        return o, lse, sched, None
    return o, lse, sched, sched.table(late_first=True)


def flash_attention_fwd_ws(q, k, v, offsets, block_size: int, scale: float, causal: bool, cpu_offsets=None):
    """``(o [T, H, D], lse [H, T])`` of full attention (``block_size == 0``) or blocks over 128
    tokens, by the warp-specialized kernel (module docstring), or its persistent form where
    ``flash_persistent.taken`` says; the caller checks :func:`flash_ws_reasons` first."""
    from . import flash_persistent

    if flash_persistent.taken(q.device):
        return flash_persistent.flash_attention_fwd_persistent(q, k, v, offsets, block_size, scale, causal,
                                                               cpu_offsets)
    o, lse, sched, table = outputs_and_table(q, offsets, block_size, cpu_offsets)
    if table is None:
        return o, lse
    total, heads, dim = q.shape
    meta = dict(HEAD_DIM=dim, GROUPS=heads // k.shape[1], BLOCK_M=TILE_M, BLOCK_N=TILE_N, IS_CAUSAL=causal,
                OVERLAP=overlap_taken(), PINGPONG=pingpong_taken(), num_warps=4)
    args = (q, k, v, o, lse, table, sched.programs, heads, k.shape[1], scale * LOG2E,
            q.stride(0), k.stride(0), v.stride(0), o.stride(0), lse.stride(0))
    launch_fwd((sched.programs * heads,), args, meta, q)
    return o, lse

