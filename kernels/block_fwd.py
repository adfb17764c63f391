"""Block-attention forward for blocks that fit one tile (``block_size <= 128``).

Per program: one block of one kv head, and the ``GROUPS`` query heads that share it (GQA).
Each query head does ``S = QK^T`` once, an exact softmax over the whole block (no running
max, no correction factors) and ``O = PV``; only ``O`` is written, no logsumexp. Rotary is
applied to the q and k tiles right after loading. Rows past the block are masked, so
memory beyond valid rows is never read.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import LOG2E, fast_trig, input_precision, needs_int64, rotary_args, tile_config
from ._rotary import rotary_tables, rotate
from ._schedule import Schedule, block_of_program


@triton.jit
def load_tile(ptr, rows, offs_d, stride_t, stride_d, mask, INT64: tl.constexpr):
    if INT64:
        rows = rows.to(tl.int64)
    return tl.load(ptr + rows[:, None] * stride_t + offs_d[None, :] * stride_d, mask=mask, other=0.0)


@triton.jit
def store_tile(ptr, x, rows, offs_d, stride_t, stride_d, mask, INT64: tl.constexpr):
    if INT64:
        rows = rows.to(tl.int64)
    tl.store(ptr + rows[:, None] * stride_t + offs_d[None, :] * stride_d, x, mask=mask)


@triton.jit
def block_positions(Pos, block_start, first_row, offs_m, row_ok, HAS_POS: tl.constexpr):
    """Rotary positions of the block's rows: given, or the index inside the sequence."""
    if HAS_POS:
        return tl.load(Pos + block_start + offs_m, mask=row_ok, other=0).to(tl.float32)
    return (first_row + offs_m).to(tl.float32)


@triton.jit
def block_probs(q, k, offs_m, row_ok, qk_scale, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Softmax of the block's scores, normalized, float32 ``[M, M]``."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    valid = row_ok[None, :]
    if IS_CAUSAL:
        valid = valid & (offs_m[:, None] >= offs_m[None, :])
    s = tl.where(valid, s, float("-inf"))
    p = tl.exp2(s - tl.max(s, 1)[:, None])
    return p / tl.sum(p, 1)[:, None]


@triton.jit(do_not_specialize=["slots", "qk_scale", "rotary_dim", "log2_theta"])
def _block_fwd_kernel(
    Q, K, V, O, Table, Pos,
    slots, qk_scale, rotary_dim, log2_theta,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_ROTARY: tl.constexpr, HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    start, n, first_row = block_of_program(Table, slots, pid)
    if n == 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < n
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = start + offs_m
    k = load_tile(K + hk * stride_kh, rows, offs_d, stride_kt, stride_kd, mask, INT64)
    v = load_tile(V + hk * stride_vh, rows, offs_d, stride_vt, stride_vd, mask, INT64)
    if HAS_ROTARY:
        pos = block_positions(Pos, start, first_row, offs_m, row_ok, HAS_POS)
        cos, sin, partner = rotary_tables(pos, offs_d, rotary_dim, log2_theta, INTERLEAVED, FAST_TRIG)
        k = rotate(k.to(tl.float32), cos, sin, partner, False).to(K.dtype.element_ty)
    for g in tl.static_range(GROUPS):
        h = hk * GROUPS + g
        q = load_tile(Q + h * stride_qh, rows, offs_d, stride_qt, stride_qd, mask, INT64)
        if HAS_ROTARY:
            q = rotate(q.to(tl.float32), cos, sin, partner, False).to(Q.dtype.element_ty)
        p = block_probs(q, k, offs_m, row_ok, qk_scale, IS_CAUSAL, PRECISION)
        o = tl.dot(p.to(V.dtype.element_ty), v, input_precision=PRECISION)
        store_tile(O + h * stride_oh, o.to(O.dtype.element_ty), rows, offs_d, stride_ot, stride_od, mask, INT64)


def block_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, block_size: int,
    scale: float, causal: bool, rope_theta: Optional[float], positions: Optional[torch.Tensor],
    rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[torch.Tensor],
) -> torch.Tensor:
    """Launch the forward kernel; returns ``o [T, H, D]`` (contiguous, dtype of ``q``)."""
    total, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    o = torch.empty((total, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if total == 0:
        return o
    sched = Schedule(offsets, total, block_size, cpu_offsets)
    if sched.programs == 0:
        return o
    cfg = tile_config(block_size, head_dim, backward=False)
    has_rotary, rotary_dim, log2_theta = rotary_args(rope_theta, rotary_dim)
    _block_fwd_kernel[(sched.programs, kv_heads)](
        q, k, v, o, sched.table, positions if positions is not None else sched.table,
        sched.programs, scale * LOG2E, rotary_dim, log2_theta,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        HEAD_DIM=head_dim, GROUPS=num_heads // kv_heads, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_d, IS_CAUSAL=causal, HAS_ROTARY=has_rotary,
        HAS_POS=positions is not None, INTERLEAVED=rotary_interleaved, FAST_TRIG=fast_trig(q),
        INT64=needs_int64(q, k, v, o), PRECISION=input_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o
