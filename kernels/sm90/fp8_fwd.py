"""Warp-specialized e4m3 block-attention forward for Hopper (sm_90) in Gluon (inference only).

The Triton fp8 forward (``block.fp8_fwd``) runs one program per (block, kv head): each copies,
multiplies and stores in turn, and at four programs per SM the H200 keeps its memory only 68 %
busy (1.18x the floor at prod D128). Here the copies run on their own:

- ``min(#SMs, items)`` persistent programs; an item is a (block, query head) pair, the head
  fastest, so a block's grouped query heads are taken together and read its k and v from L2.
  Program ``p`` takes the items ``p, p + P, p + 2P, ...``;
- in each program a one-warp loader copies each item's q, k and v tiles (``BLOCK_M`` rows from
  the block's first, one byte per element) by TMA into a ring of ``STAGES`` slots, from tensor
  maps over the whole ``[T, heads * D]`` row views made in the kernel (rows past ``T`` read as
  zeros; rows past a ragged block are the next block's and are masked below);
- three consumer warpgroups (``CONSUMERS``) take the
  program's items in turn (consumer ``c`` its items ``c, c + 3, ...``; each ring slot serves one
  consumer, ``stages``).
  Per item: ``S = Q K^T`` by an e4m3 ``wgmma`` straight from the slot; v converted to float16
  (exact for e4m3, one instruction per pair) into the consumer's own tile with the rows past the
  block zeroed (so a NaN or infinity in the next block cannot reach this one through ``0 * x``);
  the slot released; the exact softmax over the block's keys with ``scale * q_descale *
  k_descale`` on the scores; ``O = P V`` (float16 ``wgmma``, ``P`` from registers with float16's
  10 mantissa bits) times ``v_descale / rowsum``; the output stored through the consumer's tile
  (dead by then, read back as the output dtype): a 64-token block's by a TMA store (``OUT_TMA``), a
  shorter one's in 16-byte row chunks, rows past the block masked.

With rotary (split halves over every channel, ``ROTARY``) each consumer first rotates the item's
stored q and k in float16 arithmetic into its own float16 half tiles (``F16_ROTATION``; off: in float32
into halves of the output dtype), 32 rows at a time with those rows' angles
(implicit positions from the block's first row in its sequence, or given ones), releases the slot,
and takes the scores as the sum of two 16-bit products of the halves; the factors stay on the
scores (the rotation is linear and they are per kv head or per sequence).

v enters the product as stored (e4m3 values are exact in 16 bits), its factor applied to the
output. Descales are ``[H_kv]`` or ``[B, H_kv]`` (``*_BATCH``: the block's sequence is found by a
binary search over the offsets, ``_sequence_of``).

Admitted calls (``fp8_ws_reasons``): sm_90, head dims 64 and 128, blocks of 33-64 tokens, no
rotary or rotary over every channel in split halves, a 16-bit output, rows of ``H * D``
contiguous elements that do not overlap, 16-byte aligned, 32-bit offsets. Rotary calls are taken
where ``ROTARY_VERIFIED_ON`` says, except at the head dims of ``ROTARY_SLOWER_AT``.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma,
)

from ..common.launch import Launcher
from ..common.meta import needs_int64
from .block import _acc_layout, _block_of, _probs, _row_layout, _smem_layout, _store_via
from .persistent import drop_ring, init_ring
from .rotary import sin_cos_rows

# The generations whose GPU tests this kernel passed; elsewhere it runs only with
# ``variants.allow_unverified`` / BLOCKATTN_UNVERIFIED_KERNELS=1, the Triton fp8 forward otherwise.
VERIFIED_ON = frozenset({9})  # the H200, 2026-12-04 (tests/test_fp8.py, with two and three consumers)
# ... and those where its rotary calls passed them (the H200, 2026-12-04, on one program per SM and
# on two).
ROTARY_VERIFIED_ON = frozenset({9})
# Head dims whose rotary calls the Triton fp8 forward takes although this kernel admits them, as it
# is slower there: none since q and k rotate in float16 (``F16_ROTATION``). H100, 2026-12-06, prod
# lengths, rope_theta 1e4, one process, ms, this kernel / the Triton one: D 64 H4 1.126 / 1.336; D 128
# H2 1.135 / 1.386. (Before, rotating in float32, H200: D 64 1.581-1.593 / 1.248-1.257, so D 64 went
# to the Triton kernel.)
ROTARY_SLOWER_AT = ()
BLOCK_M = 64  # rows per item: one consumer warpgroup's wgmma tile
HEAD_DIMS = (64, 128)
BLOCKS = (33, 64)
# Consumer warpgroups per program. H200, prod lengths, one process, ms, two / three consumers (outputs
# bitwise equal; the Triton fp8 forward beside): D 64 H4 1.014-1.026 / 0.860-0.868 (0.947), D 128 H2
# 0.806-0.812 / 0.815 (0.840-0.845): three, within 1 % of two at D 128. Four at D 64 (112 registers
# each) were slower on an H100 (2026-12-06: 1.259 against 1.110 ms).
CONSUMERS = 3
LOADER_REGS = gl.constexpr(40)
# Registers of each consumer warpgroup: three of them and the loader in 64 K registers.
CONSUMER_REGS = gl.constexpr(160)
# Whether 64-token blocks' outputs leave by TMA stores (``OUT_TMA``). H200, prod lengths, one process,
# ms, masked stores / TMA stores (two rounds, outputs bitwise equal): D 128 H2 0.822-0.824 /
# 0.816; D 64 H4 0.860-0.871 / 0.834-0.837; rotary D 128 H2 1.238-1.246 / 1.223-1.231.
OUT_TMA = True
# v and P enter ``P V`` in float16, not the output dtype (H100, 2026-12-06, prod lengths, ms, error
# against the float32 reference of the descaled inputs, bfloat16 / float16 P V): D 128 H2 1.113 /
# 1.113, 2.12e-3 / 1.68e-3; D 64 H4 1.110 / 1.120, 2.11e-3 / 1.67e-3; rotary D 128 H2 1.213 / 1.158,
# 3.07e-3 / 2.79e-3. The scores' e4m3 product issued before v's conversion and waited for after it
# gained nothing there (1.115 / 1.118 ms) and was removed.

# Rotary: q and k rotated in float16 arithmetic into float16 halves (``F16_ROTATION``: e4m3 converts to
# float16 exactly, and the sines' and products' float16 roundings, about 5e-4 of a value, sit far under
# e4m3's own 6 %), not in float32 into halves of the output dtype. The rotary forward is bound by its
# instructions (H100, 2026-12-06: 1.16 ms alone, 1.25-1.35 in the sub-layer as the clock drops; the plain
# forward 1.08 throughout); float16 math leaves out the conversions to and from float32. H100,
# 2026-12-06, prod lengths, one process, ms, error against the float32 reference of the descaled
# inputs, float32 rotation into bfloat16 halves / float16 rotation (``bench.fp8 --ws-options``):
# D 128 H2 1.159 / 1.135, 2.79e-3 / 1.71e-3; D 64 H4 1.495 / 1.126, 2.82e-3 / 1.72e-3 (float16
# halves carry three more mantissa bits than bfloat16 ones).
F16_ROTATION = True


SLOT_BYTES = 96 * 1024  # the ring's shared memory (q, k and v of STAGES items, one byte each)
SHARED_BYTES = 220 * 1024  # the ring and the consumers' 16-bit tiles together


def consumer_tile_bytes(head_dim: int, rotary: bool) -> int:
    """The consumers' 16-bit tiles: each one's output tile (v's 16-bit copy first), and with
    rotary its rotated q and k halves."""
    return CONSUMERS * BLOCK_M * head_dim * 2 * (3 if rotary else 1)


def stages(head_dim: int, rotary: bool = False) -> int:
    """Ring slots: about ``SLOT_BYTES`` of items in flight (less where the consumers' tiles leave less
    of ``SHARED_BYTES``), a multiple of the consumers: 3 at D 128, 9 at D 64, with rotary too.
    Consumer ``c`` takes the items ``c, c + CONSUMERS, ...``, so each slot serves one consumer.
    That is the form that passed on the H200: a first build with three consumers on a 4-slot ring
    failed there ("unspecified launch failure", session 34). Why is not established: with the
    loader copying items in order, no parity wait on a shared slot can pass a phase early (a
    consumer at item ``j`` has seen item ``j - CONSUMERS`` loaded, hence every earlier one; a
    simulation of the ring with random interleavings agrees, session 35)."""
    ring = min(SLOT_BYTES, SHARED_BYTES - consumer_tile_bytes(head_dim, rotary))
    return max(round(ring / (3 * BLOCK_M * head_dim) / CONSUMERS), 1) * CONSUMERS


@gluon.constexpr_function
def _e4m3_layout(width):
    """Shared layout of e4m3 tiles ``width`` bytes wide, as TMA writes and ``wgmma`` reads them."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(width, 128), element_bitwidth=8, rank=2)


@gluon.constexpr_function
def _e4m3_acc_layout(width):
    """Accumulator layout of an e4m3 ``wgmma`` product ``[64, width]`` (its instructions reduce
    over 32 channels, 16-bit ones over 16: ``block._acc_layout``)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, width, 32])


@gluon.constexpr_function
def _scores_layout(rotary):
    """The scores' accumulator layout: e4m3 products of the stored q and k, or with rotary 16-bit
    products of the rotated halves."""
    return _acc_layout(64) if rotary else _e4m3_acc_layout(64)


@gluon.constexpr_function
def _byte_rows(width, warps=4):
    """Register layout of an e4m3 row tile ``width`` wide in 16-byte row chunks."""
    return gl.BlockedLayout([1, 16], [32 // (width // 16), width // 16], [warps, 1], [1, 0])


@gluon.jit
def _rows_map(ptr, total, heads, stride_t, HEAD_DIM: gl.constexpr):
    """Tensor map of the ``[total, heads * HEAD_DIM]`` e4m3 row view, ``[BLOCK_M, HEAD_DIM]`` boxes."""
    return tma.make_tensor_descriptor(ptr, [total, heads * HEAD_DIM], [stride_t, 1], [64, HEAD_DIM],
                                      _e4m3_layout(HEAD_DIM))


@gluon.jit
def _sequence_of(Offsets, row, num_seqs, search_top, search_steps):
    """The sequence holding token ``row``: the largest ``s < num_seqs`` with ``offsets[s] <= row``
    (empty sequences share their neighbour's offset and are passed over; ``common.schedule.search_prefix``)."""
    s = row * 0
    for i in range(search_steps):
        cand = s + (search_top >> i)
        c = gl.load(Offsets + gl.minimum(cand, num_seqs))
        s = gl.where((cand < num_seqs) & (c <= row), cand, s)
    return s


@gluon.jit
def _items_of_program(items):
    """How many items this program takes (``p, p + P, ...`` below ``items``)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    return (items - pid + nprog - 1) // nprog


@gluon.jit
def _block_of_item(Sched, slots, num_seqs, block_size, heads, items, j, INLINE_SEQS: gl.constexpr,
                   WARPS: gl.constexpr):
    """``(start, n, first_row, h)`` of this program's item ``j``: its block's first token, length and
    first row in its sequence, and its query head (past the program's last item: the last item's, unused)."""
    item = gl.minimum(gl.program_id(0) + j * gl.num_programs(0), items - 1)
    start, n, first_row = _block_of(Sched, slots, num_seqs, block_size, item // heads, INLINE_SEQS, WARPS)
    return start.to(gl.int32), n.to(gl.int32), first_row.to(gl.int32), item % heads


@gluon.jit
def _loader(q_s, k_s, v_s, ready, empty, Q, K, V, Sched, slots, num_seqs, block_size, total, heads, kv_heads, items,
            stride_qt, stride_kt, stride_vt, HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, STAGES: gl.constexpr,
            INLINE_SEQS: gl.constexpr):
    """Loader partition (one warp): each item's q, k, v tiles into the next free slot; an empty
    block's slot gets a bare arrival. The next item's block is read from the table while this
    one waits for its slot (one item ahead: the table's latency off the copies' path)."""
    q_map = _rows_map(Q, total, heads, stride_qt, HEAD_DIM)
    k_map = _rows_map(K, total, kv_heads, stride_kt, HEAD_DIM)
    v_map = _rows_map(V, total, kv_heads, stride_vt, HEAD_DIM)
    start, n, first_row, h = _block_of_item(Sched, slots, num_seqs, block_size, heads, items, 0, INLINE_SEQS, 1)
    for j in range(_items_of_program(items)):
        next_start, next_n, next_first_row, next_h = _block_of_item(Sched, slots, num_seqs, block_size, heads,
                                                                    items, j + 1, INLINE_SEQS, 1)
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        if n > 0:
            mbarrier.expect(bar, 3 * 64 * HEAD_DIM)
            tma.async_copy_global_to_shared(q_map, [start, h * HEAD_DIM], bar, q_s.index(s))
            tma.async_copy_global_to_shared(k_map, [start, (h // GROUPS) * HEAD_DIM], bar, k_s.index(s))
            tma.async_copy_global_to_shared(v_map, [start, (h // GROUPS) * HEAD_DIM], bar, v_s.index(s))
        else:
            mbarrier.arrive(bar)
        start, n, first_row, h = next_start, next_n, next_first_row, next_h


@gluon.jit
def _descale(D, seq, hk, kv_heads, BATCH: gl.constexpr):
    if BATCH:
        return gl.load(D + seq * kv_heads + hk)
    else:
        return gl.load(D + hk)


@gluon.jit
def _item_of_consumer(Offsets, QD, KD, VD, Sched, slots, num_seqs, block_size, heads, kv_heads, items, qk_scale,
                      search_top, search_steps, j, GROUPS: gl.constexpr, INLINE_SEQS: gl.constexpr,
                      QD_BATCH: gl.constexpr, KD_BATCH: gl.constexpr, VD_BATCH: gl.constexpr):
    """``(start, n, first_row, h, score_scale, out_scale)`` of this program's item ``j``: its block,
    query head, the scores' factor (``qk_scale`` times q's and k's descales) and the output's (v's descale)."""
    start, n, first_row, h = _block_of_item(Sched, slots, num_seqs, block_size, heads, items, j, INLINE_SEQS, 4)
    hk = h // GROUPS
    seq = 0
    if QD_BATCH or KD_BATCH or VD_BATCH:
        seq = _sequence_of(Offsets, start, num_seqs, search_top, search_steps)
    score_scale = qk_scale * _descale(QD, seq, hk, kv_heads, QD_BATCH) * _descale(KD, seq, hk, kv_heads, KD_BATCH)
    return start, n, first_row, h, score_scale, _descale(VD, seq, hk, kv_heads, VD_BATCH)


@gluon.jit
def _rotate_rows(src, dst_a, dst_b, sin, cos, ROW0: gl.constexpr, HALF: gl.constexpr, LAYOUT: gl.constexpr):
    """Rows ``ROW0 .. ROW0 + 32`` of the stored e4m3 tile ``src`` (split halves of ``HALF`` channels)
    rotated into the 16-bit half tiles ``dst_a``, ``dst_b``, in the arithmetic of ``sin`` and ``cos``
    (float32, or float16: ``F16_ROTATION``)."""
    rows = src.slice(ROW0, 32, 0)
    a = rows.slice(0, HALF, 1).load(LAYOUT).to(sin.dtype)
    b = rows.slice(HALF, HALF, 1).load(LAYOUT).to(sin.dtype)
    dst_a.slice(ROW0, 32, 0).store((a * cos - b * sin).to(dst_a.dtype))
    dst_b.slice(ROW0, 32, 0).store((a * sin + b * cos).to(dst_b.dtype))


@gluon.jit
def _rotate_item(q, k, qa, qb, ka, kb, Pos, start, n, first_row, log2_theta, HALF: gl.constexpr,
                 HAS_POS: gl.constexpr, F16_ROTATION: gl.constexpr):
    """The item's stored q and k tiles rotated into the consumer's 16-bit halves ``qa, qb, ka, kb``,
    32 rows at a time with those rows' angles (``rotary.sin_cos_rows``): in float16 arithmetic with
    ``F16_ROTATION`` (the halves float16 then), else in float32."""
    layout: gl.constexpr = _row_layout(HALF)
    for c in gl.static_range(2):
        sin, cos = sin_cos_rows(Pos, start, n, first_row, log2_theta, c * 32, 32, HALF, HALF, HAS_POS, layout)
        if F16_ROTATION:
            sin, cos = sin.to(gl.float16), cos.to(gl.float16)
        _rotate_rows(q, qa, qb, sin, cos, c * 32, HALF, layout)
        _rotate_rows(k, ka, kb, sin, cos, c * 32, HALF, layout)


@gluon.jit
def _consumer(c, q_s, k_s, v_s, ready, empty, o_s, r_s, O, Offsets, QD, KD, VD, Sched, Pos, slots, num_seqs,
              block_size, total, heads, kv_heads, items, qk_scale, log2_theta, search_top, search_steps, stride_ot,
              stride_oh,
              HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, STAGES: gl.constexpr, ROTARY: gl.constexpr,
              HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr, QD_BATCH: gl.constexpr,
              KD_BATCH: gl.constexpr, VD_BATCH: gl.constexpr, OUT_TMA: gl.constexpr, CONSUMERS: gl.constexpr,
              F16_ROTATION: gl.constexpr):
    """Consumer partition ``c`` (one warpgroup) of ``CONSUMERS``: its items' scores, softmax, product
    and store (through its tile of ``o_s``; with ``ROTARY`` q and k rotated first into its halves of
    ``r_s``, the scores their 16-bit products); each next item's block and factors read while this
    one is computed. ``OUT_TMA``: a 64-token block's output leaves by a TMA store from the tile (waited
    for before the tile's next use), a ragged one's by masked stores. v and P enter ``P V`` in float16,
    the tile read back as the output dtype for the store."""
    HALF: gl.constexpr = HEAD_DIM // 2
    o_s = o_s.index(c)
    o_out = o_s._reinterpret(O.dtype.element_ty, [64, HEAD_DIM], _smem_layout(HEAD_DIM))
    qa, qb, ka, kb = r_s.index(4 * c), r_s.index(4 * c + 1), r_s.index(4 * c + 2), r_s.index(4 * c + 3)
    dtype: gl.constexpr = O.dtype.element_ty
    acc_s: gl.constexpr = _scores_layout(ROTARY)
    acc_d: gl.constexpr = _acc_layout(HEAD_DIM)
    a_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_d, k_width=2)
    vl: gl.constexpr = _byte_rows(HEAD_DIM)
    offs_m = gl.arange(0, 64, layout=gl.SliceLayout(1, vl))
    zero_s = gl.zeros([64, 64], gl.float32, acc_s)
    zero_d = gl.zeros([64, HEAD_DIM], gl.float32, acc_d)
    if OUT_TMA:
        o_map = tma.make_tensor_descriptor(O, [total, heads * HEAD_DIM], [stride_ot, 1], [64, HEAD_DIM],
                                           _smem_layout(HEAD_DIM))
    start, n, first_row, h, score_scale, out_scale = _item_of_consumer(
        Offsets, QD, KD, VD, Sched, slots, num_seqs, block_size, heads, kv_heads, items, qk_scale, search_top,
        search_steps, c, GROUPS, INLINE_SEQS, QD_BATCH, KD_BATCH, VD_BATCH)
    for j in range(c, _items_of_program(items), CONSUMERS):
        next_start, next_n, next_first_row, next_h, next_score_scale, next_out_scale = _item_of_consumer(
            Offsets, QD, KD, VD, Sched, slots, num_seqs, block_size, heads, kv_heads, items, qk_scale, search_top,
            search_steps, j + CONSUMERS, GROUPS, INLINE_SEQS, QD_BATCH, KD_BATCH, VD_BATCH)
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        if n > 0:
            if ROTARY:
                _rotate_item(q_s.index(s), k_s.index(s), qa, qb, ka, kb, Pos, start, n, first_row, log2_theta, HALF,
                             HAS_POS, F16_ROTATION)
            else:
                scores = warpgroup_mma(q_s.index(s), k_s.index(s).permute((1, 0)), zero_s)
            v = gl.where(gl.expand_dims(offs_m < n, 1), v_s.index(s).load(vl).to(gl.float16), 0.0)
            if OUT_TMA:
                tma.store_wait(0)  # the tile's last output has left (waited for by the warps that issued it)
            gl.thread_barrier()  # every warp is done with the slot, and with o_s's last store
            mbarrier.arrive(empty.index(s))
            o_s.store(v)
            fence_async_shared()
            gl.thread_barrier()
            if ROTARY:
                scores = warpgroup_mma(qa, ka.permute((1, 0)), zero_s)
                scores = warpgroup_mma(qb, kb.permute((1, 0)), scores)
            p, inv = _probs(scores, n, score_scale, IS_CAUSAL, 64, acc_s)
            o = warpgroup_mma(gl.convert_layout(p.to(gl.float16), a_d), o_s, zero_d)
            o = o * gl.expand_dims(gl.convert_layout(inv * out_scale, gl.SliceLayout(1, acc_d)), 1)
            if OUT_TMA and n == 64:
                o_out.store(o.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
                tma.async_copy_shared_to_global(o_map, [start, h * HEAD_DIM], o_out)
            else:
                _store_via(o_out, O + h * stride_oh, o, start, n, stride_ot, 64, HEAD_DIM)
        else:
            gl.thread_barrier()
            mbarrier.arrive(empty.index(s))
        start, n, first_row, h = next_start, next_n, next_first_row, next_h
        score_scale, out_scale = next_score_scale, next_out_scale
    if OUT_TMA:
        tma.store_wait(0)


@gluon.jit(do_not_specialize=["slots", "num_seqs", "block_size", "total", "heads", "kv_heads", "items", "qk_scale",
                              "log2_theta", "search_top", "search_steps"])
def _fp8_ws_fwd_kernel(
    Q, K, V, O, Sched, Offsets, Pos, QD, KD, VD,
    slots, num_seqs, block_size, total, heads, kv_heads, items, qk_scale, log2_theta, search_top, search_steps,
    stride_qt, stride_kt, stride_vt, stride_ot, stride_oh,
    HEAD_DIM: gl.constexpr, GROUPS: gl.constexpr, STAGES: gl.constexpr, ROTARY: gl.constexpr, HAS_POS: gl.constexpr,
    IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr, QD_BATCH: gl.constexpr, KD_BATCH: gl.constexpr,
    VD_BATCH: gl.constexpr, OUT_TMA: gl.constexpr, CONSUMERS: gl.constexpr, F16_ROTATION: gl.constexpr,
):
    gl.static_assert(STAGES % CONSUMERS == 0, "each ring slot serves one consumer (stages())")
    HALF: gl.constexpr = HEAD_DIM // 2
    dtype: gl.constexpr = O.dtype.element_ty
    e4m3: gl.constexpr = Q.dtype.element_ty
    tiles: gl.constexpr = _e4m3_layout(HEAD_DIM)
    q_s = gl.allocate_shared_memory(e4m3, [STAGES, 64, HEAD_DIM], tiles)
    k_s = gl.allocate_shared_memory(e4m3, [STAGES, 64, HEAD_DIM], tiles)
    v_s = gl.allocate_shared_memory(e4m3, [STAGES, 64, HEAD_DIM], tiles)
    o_s = gl.allocate_shared_memory(gl.float16, [CONSUMERS, 64, HEAD_DIM], _smem_layout(HEAD_DIM))
    if ROTARY:
        r_dtype: gl.constexpr = gl.float16 if F16_ROTATION else dtype
        r_s = gl.allocate_shared_memory(r_dtype, [4 * CONSUMERS, 64, HALF], _smem_layout(HALF))
    else:
        r_s = gl.allocate_shared_memory(dtype, [4 * CONSUMERS, 8, 16], _smem_layout(16))  # (unused)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    init_ring(ready, empty, STAGES, 1)
    gl.static_assert(CONSUMERS == 3, "three consumer warpgroups")
    gl.warp_specialize([
        (_consumer, (0, q_s, k_s, v_s, ready, empty, o_s, r_s, O, Offsets, QD, KD, VD, Sched, Pos, slots, num_seqs,
                   block_size, total, heads, kv_heads, items, qk_scale, log2_theta, search_top, search_steps,
                   stride_ot, stride_oh, HEAD_DIM, GROUPS, STAGES, ROTARY, HAS_POS, IS_CAUSAL, INLINE_SEQS,
                   QD_BATCH, KD_BATCH, VD_BATCH, OUT_TMA, CONSUMERS, F16_ROTATION)),
        (_consumer, (1, q_s, k_s, v_s, ready, empty, o_s, r_s, O, Offsets, QD, KD, VD, Sched, Pos, slots, num_seqs,
                   block_size, total, heads, kv_heads, items, qk_scale, log2_theta, search_top, search_steps,
                   stride_ot, stride_oh, HEAD_DIM, GROUPS, STAGES, ROTARY, HAS_POS, IS_CAUSAL, INLINE_SEQS,
                   QD_BATCH, KD_BATCH, VD_BATCH, OUT_TMA, CONSUMERS, F16_ROTATION)),
        (_consumer, (2, q_s, k_s, v_s, ready, empty, o_s, r_s, O, Offsets, QD, KD, VD, Sched, Pos, slots, num_seqs,
                   block_size, total, heads, kv_heads, items, qk_scale, log2_theta, search_top, search_steps,
                   stride_ot, stride_oh, HEAD_DIM, GROUPS, STAGES, ROTARY, HAS_POS, IS_CAUSAL, INLINE_SEQS,
                   QD_BATCH, KD_BATCH, VD_BATCH, OUT_TMA, CONSUMERS, F16_ROTATION)),
        (_loader, (q_s, k_s, v_s, ready, empty, Q, K, V, Sched, slots, num_seqs, block_size, total, heads,
                   kv_heads, items, stride_qt, stride_kt, stride_vt, HEAD_DIM, GROUPS, STAGES, INLINE_SEQS)),
    ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    drop_ring(ready, empty, STAGES)


launch = Launcher(_fp8_ws_fwd_kernel, scratch=True)


def fp8_ws_reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: Optional[int], rot: int,
                   interleaved: bool, out_dtype: torch.dtype) -> List[str]:
    """Why this kernel cannot take the call (empty: it can); the Triton fp8 forward takes it then."""
    reasons = []
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        reasons.append("an sm_90 GPU")
    if q.shape[-1] not in HEAD_DIMS:
        reasons.append(f"head dim 64 or 128 (got {q.shape[-1]})")
    if block_size is None or not BLOCKS[0] <= block_size <= BLOCKS[1]:
        reasons.append(f"blocks of {BLOCKS[0]}-{BLOCKS[1]} tokens (got {block_size})")
    if rot and (rot != q.shape[-1] or interleaved):
        reasons.append("no rotary, or rotary over every channel in split halves (rotary_dim equal to the head "
                       "dim, rotary_interleaved=False)")
    if out_dtype not in (torch.bfloat16, torch.float16):
        reasons.append("a bf16 or fp16 output")
    if any(x.stride(-1) != 1 or x.stride(1) != x.shape[-1] for x in (q, k, v)):
        reasons.append("rows of H * D contiguous elements")
    if any(x.stride(0) % 16 or x.data_ptr() % 16 for x in (q, k, v)):
        reasons.append("16-byte aligned rows")
    if any(x.stride(0) < x.shape[1] * x.shape[2] for x in (q, k, v)):
        reasons.append("rows that do not overlap (a token stride of at least H * D)")
    if needs_int64(q, k, v):
        reasons.append("32-bit offsets")
    return reasons
