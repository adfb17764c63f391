"""Block-attention forward of e4m3 q, k, v with float32 descale factors (inference only).

One program per (block, kv head) and its ``GROUPS`` query heads, as the simple forward
(``block.fwd``): q, k and v are read as e4m3 (one byte per element), multiplied by their
descale factors in float32 (per kv head, and per sequence where ``QD_BATCH`` / ``KD_BATCH`` /
``VD_BATCH``: the block's sequence is found by ``common.schedule.search_prefix`` over the
offsets), rotated there where rotary is on, and rounded to ``DOT_DTYPE`` (bfloat16 or float16)
for the two products; the softmax is exact over the block, and the output is stored in its own
dtype. Bytes moved per token and head: 3 read (q, k, v) + the output's 2 or 4 written, against
bfloat16's 6 + 2.

On sm_90 the warp-specialized Gluon kernel (``sm90.fp8_fwd``) takes the calls it admits (head dims 64
and 128, blocks of 33-64 tokens, no rotary or split-halves rotary over every channel at D 128, a
16-bit output): 3-13 % faster than this one there (2-3 % with rotary).

Descale pointers always point at a float32 tensor (``QD``, ``KD``, ``VD``; ones ``[H_kv]`` stand
in for factors not given).

Measured on the H200 at prod lengths (2026-12-02) and not taken:
- v entering the second product as stored (e4m3 is exact in 16 bits), its factor applied to the
  output: the kernel's error against the descaled oracle 3.05e-3 -> 2.36e-3 at D128, but 0.6-0.8 %
  slower without rotary and 6.4-6.8 % slower with it (one process, A/B);
- the same kernel in Gluon for sm_90 (``cp.async`` copies, e4m3 ``wgmma`` scores, output through
  shared memory), one program per item or persistent with the next item's copies in flight:
  D128 H2 0.834-0.839 ms against this kernel's 0.842, D64 H4 0.944-1.057 against 0.933. ncu, D128:
  both keep DRAM 68 % busy at 25 % occupancy (four programs per SM: registers and shared memory),
  36-45 % of their stall cycles waiting on shared memory.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..common.launch import Launcher
from ..common.meta import LOG2E, MAX_TILE, needs_int64, num_warps, sm_count, tile_extent
from ..common.rotary import block_sin_cos, rotate_pair
from ..common.schedule import Schedule, block_of_program, search_prefix
from ..common.tiles import block_positions, block_probs, load_cols, pair_cols, pass_cols, store_cols
from .variants import gluon_import_error, taken_on

FP8_DTYPE = torch.float8_e4m3fn
# The generations whose GPU tests this kernel passed (the H200, 2026-12-01); elsewhere (sm_89,
# sm_100: compile-checked only) it runs only with ``variants.allow_unverified``.
VERIFIED_ON = frozenset({9})
# ... and those where its e4m3 score products (``e4m3_scores``) passed them (the H200, 2026-12-01:
# prod D128 forward 0.962 -> 0.840 ms); elsewhere the scores come from 16-bit copies unless
# ``variants.allow_unverified``.
E4M3_SCORES_VERIFIED_ON = frozenset({9})


@triton.jit
def _descaled(ptr, rows, row_ok, cols, col_ok, stride_t, factor, INT64: tl.constexpr):
    return load_cols(ptr, rows, row_ok, cols, col_ok, stride_t, 1, INT64).to(tl.float32) * factor


@triton.jit(do_not_specialize=["slots", "num_seqs", "block_size", "qk_scale", "log2_theta", "search_top",
                               "search_steps"])
def _fp8_fwd_kernel(
    Q, K, V, O, Sched, Pos, Offsets, QD, KD, VD,
    slots, num_seqs, block_size, qk_scale, log2_theta, search_top, search_steps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    INLINE_SEQS: tl.constexpr, QD_BATCH: tl.constexpr, KD_BATCH: tl.constexpr, VD_BATCH: tl.constexpr,
    DOT_DTYPE: tl.constexpr, E4M3_SCORES: tl.constexpr,
):
    hk = tl.program_id(1)
    kv_heads = tl.num_programs(1)
    start, n, first_row = block_of_program(Sched, slots, num_seqs, block_size, tl.program_id(0), INLINE_SEQS)
    if n > 0:
        offs_m = tl.arange(0, BLOCK_M)
        row_ok = offs_m < n
        rows = start + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        seq = 0
        if QD_BATCH or KD_BATCH or VD_BATCH:
            # The block's sequence: the last whose start is at or before the block's (offsets[B] = T
            # lies past it; empty sequences share their neighbour's start and are skipped).
            seq = search_prefix(Offsets, start, start >= 0, num_seqs, search_top, search_steps)
        kd = tl.load(KD + (seq * kv_heads if KD_BATCH else 0) + hk)
        vd = tl.load(VD + (seq * kv_heads if VD_BATCH else 0) + hk)
        qd = tl.load(QD + (seq * kv_heads if QD_BATCH else 0) + hk)
        k_ptr = K + hk * stride_kh
        v = _descaled(V + hk * stride_vh, rows, row_ok, offs_d, d_ok, stride_vt, vd, INT64).to(DOT_DTYPE)
        if ROT_DIM > 0:
            offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
            pos = block_positions(Pos, start, first_row, offs_m, row_ok, HAS_POS)
            sin, cos = block_sin_cos(pos, first_row, offs_m, offs_r, log2_theta, ROT_DIM, HAS_POS, FAST_TRIG, False)
            ka, kb = rotate_pair(_descaled(k_ptr, rows, row_ok, cols_a, r_ok, stride_kt, kd, INT64),
                                 _descaled(k_ptr, rows, row_ok, cols_b, r_ok, stride_kt, kd, INT64), sin, cos, False)
            ka, kb = ka.to(DOT_DTYPE), kb.to(DOT_DTYPE)
        if E4M3_SCORES:  # the stored e4m3 k, its factor applied to the scores
            cols_p, p_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
            kp = load_cols(k_ptr, rows, row_ok, cols_p, p_ok, stride_kt, 1, INT64)
        elif ROT_DIM < HEAD_DIM:
            cols_p, p_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
            kp = _descaled(k_ptr, rows, row_ok, cols_p, p_ok, stride_kt, kd, INT64).to(DOT_DTYPE)
        for g in range(GROUPS):
            h = hk * GROUPS + g
            q_ptr = Q + h * stride_qh
            s = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
            if ROT_DIM > 0:
                qa, qb = rotate_pair(_descaled(q_ptr, rows, row_ok, cols_a, r_ok, stride_qt, qd, INT64),
                                     _descaled(q_ptr, rows, row_ok, cols_b, r_ok, stride_qt, qd, INT64), sin, cos,
                                     False)
                s = tl.dot(qa.to(DOT_DTYPE), tl.trans(ka), s)
                s = tl.dot(qb.to(DOT_DTYPE), tl.trans(kb), s)
            if E4M3_SCORES:
                s = tl.dot(load_cols(q_ptr, rows, row_ok, cols_p, p_ok, stride_qt, 1, INT64), tl.trans(kp), s)
                p = block_probs(s, offs_m, row_ok, qk_scale * qd * kd, IS_CAUSAL, True)
            else:
                if ROT_DIM < HEAD_DIM:
                    qp = _descaled(q_ptr, rows, row_ok, cols_p, p_ok, stride_qt, qd, INT64).to(DOT_DTYPE)
                    s = tl.dot(qp, tl.trans(kp), s)
                p = block_probs(s, offs_m, row_ok, qk_scale, IS_CAUSAL, True)
            o = tl.dot(p.to(DOT_DTYPE), v)
            store_cols(O + h * stride_oh, o, rows, row_ok, offs_d, d_ok, stride_ot, 1, INT64)


launch = Launcher(_fp8_fwd_kernel)


def e4m3_scores(rot: int, dim: int) -> bool:
    """Whether the scores are the product of the stored e4m3 q and k (their factors applied to the
    scores, no 16-bit copy of either in registers): without rotary (which rotates descaled
    values) and for products of at least 32 channels (e4m3 MMAs reduce over 32)."""
    return rot == 0 and tile_extent(dim) >= 32
_TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def fp8_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, block_size: int, scale: float,
    causal: bool, rope_theta: Optional[float], positions: Optional[torch.Tensor], rotary_dim: int,
    rotary_interleaved: bool, cpu_offsets: Optional[torch.Tensor], q_descale: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], out_dtype: torch.dtype,
) -> torch.Tensor:
    """``o [T, H, D]`` in ``out_dtype`` of e4m3 ``q, k, v`` (``[T, H, D]`` / ``[T, H_kv, D]``, unit
    channel stride) with descales ``[H_kv]`` / ``[B, H_kv]`` or None; blocks of up to 128 tokens."""
    if block_size > MAX_TILE:
        raise ValueError(f"the fp8 kernels take blocks of up to {MAX_TILE} tokens, got block_size={block_size}")
    total, heads, dim = q.shape
    kv_heads = k.shape[1]
    o = torch.empty((total, heads, dim), dtype=out_dtype, device=q.device)
    if total == 0:
        return o
    sched = Schedule(offsets, total, block_size, cpu_offsets)
    if sched.programs == 0:
        return o
    one = torch.ones(kv_heads, dtype=torch.float32, device=q.device)
    qd, kd, vd = (one if d is None else d.contiguous() for d in (q_descale, k_descale, v_descale))
    batched = [d is not None and d.dim() == 2 for d in (q_descale, k_descale, v_descale)]
    num_seqs = offsets.numel() - 1
    rot = rotary_dim if rope_theta is not None else 0
    int64 = needs_int64(q, k, v, o)
    if not int64 and _ws_taken(q, k, v, block_size, rot, rotary_interleaved, out_dtype):
        _fp8_ws(q, k, v, o, sched, offsets, positions, qd, kd, vd, batched, block_size, scale, causal, rot,
                rope_theta)
        return o
    dot = out_dtype if out_dtype in _TORCH_TO_TL else torch.bfloat16
    meta = dict(
        HEAD_DIM=dim, GROUPS=heads // kv_heads, BLOCK_M=tile_extent(block_size), BLOCK_D=tile_extent(dim),
        BLOCK_R=tile_extent(rot // 2), BLOCK_P=tile_extent(dim - rot), ROT_DIM=rot, INTERLEAVED=rotary_interleaved,
        HAS_POS=positions is not None, IS_CAUSAL=causal, FAST_TRIG=q.is_cuda, INT64=int64,
        INLINE_SEQS=sched.inline_seqs, QD_BATCH=batched[0], KD_BATCH=batched[1], VD_BATCH=batched[2],
        DOT_DTYPE=_TORCH_TO_TL[dot],
        E4M3_SCORES=e4m3_scores(rot, dim) and taken_on(q.device, E4M3_SCORES_VERIFIED_ON),
        num_warps=num_warps(tile_extent(block_size), tile_extent(dim), False), num_stages=1,
    )
    pos = positions if positions is not None else sched.table
    args = (q, k, v, o, sched.table, pos, offsets, qd, kd, vd, sched.programs, num_seqs, block_size,
            scale * LOG2E, math.log2(rope_theta) if rope_theta is not None else 0.0,
            1 << (num_seqs.bit_length() - 1), num_seqs.bit_length(),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1))
    launch((sched.programs, kv_heads), args, meta, q)
    return o


def _ws_taken(q, k, v, block_size: int, rot: int, interleaved: bool, out_dtype: torch.dtype) -> bool:
    """Whether the warp-specialized sm_90 kernel (``sm90.fp8_fwd``) takes a call whose tensors, the
    output's included, take 32-bit offsets (the caller's check): it admits it, and it is verified on
    this GPU generation (for rotary calls: ``ROTARY_VERIFIED_ON``) or unverified kernels are allowed,
    and for rotary calls it is not the slower kernel at their head dim (``ROTARY_SLOWER_AT``)."""
    if not q.is_cuda or gluon_import_error() is not None:
        return False
    from ..sm90 import fp8_fwd as ws

    if rot and q.shape[-1] in ws.ROTARY_SLOWER_AT:
        return False
    return (not ws.fp8_ws_reasons(q, k, v, block_size, rot, interleaved, out_dtype)
            and taken_on(q.device, ws.ROTARY_VERIFIED_ON if rot else ws.VERIFIED_ON))


def _fp8_ws(q, k, v, o, sched: Schedule, offsets, positions, qd, kd, vd, batched, block_size: int, scale: float,
            causal: bool, rot: int, rope_theta: Optional[float]) -> None:
    """The forward by the warp-specialized sm_90 kernel, into ``o``."""
    from ..sm90 import fp8_fwd as ws

    total, heads, dim = q.shape
    kv_heads = k.shape[1]
    num_seqs = offsets.numel() - 1
    items = sched.programs * heads
    meta = dict(HEAD_DIM=dim, GROUPS=heads // kv_heads, STAGES=ws.stages(dim, rot > 0), ROTARY=rot > 0,
                HAS_POS=rot > 0 and positions is not None, IS_CAUSAL=causal, INLINE_SEQS=sched.inline_seqs,
                QD_BATCH=batched[0], KD_BATCH=batched[1], VD_BATCH=batched[2], OUT_TMA=ws.OUT_TMA,
                CONSUMERS=ws.CONSUMERS, F16_ROTATION=ws.F16_ROTATION, num_warps=4)
    pos = positions if positions is not None else sched.table
    log2_theta = math.log2(rope_theta) if rot else 0.0
    args = (q, k, v, o, sched.table, offsets, pos, qd, kd, vd, sched.programs, num_seqs, block_size, total, heads,
            kv_heads, items, scale * LOG2E, log2_theta, 1 << (num_seqs.bit_length() - 1), num_seqs.bit_length(),
            q.stride(0), k.stride(0), v.stride(0), o.stride(0), o.stride(1))
    ws.launch((min(items, sm_count(q.device)),), args, meta, q)


def fp8_kernel_reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: Optional[int]) -> list:
    """Why the fp8 kernel cannot take this call (empty: it can)."""
    reasons = []
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        reasons.append("an sm_89 or newer GPU (e4m3 conversions)")
    if not taken_on(q.device, VERIFIED_ON):
        reasons.append("no hardware run recorded on this GPU generation: taken only with BLOCKATTN_UNVERIFIED_KERNELS=1")
    if block_size is None or block_size > MAX_TILE:
        reasons.append(f"blocks of up to {MAX_TILE} tokens (got block_size={block_size})")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        reasons.append("unit channel stride")
    return reasons
