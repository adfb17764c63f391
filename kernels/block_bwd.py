"""Block-attention backward for blocks that fit one tile (``block_size <= 128``).

Per program: one block of one kv head and its ``GROUPS`` query heads. ``S`` and ``P`` are
recomputed from q and k (nothing but q, k, v is saved by the forward); ``dK`` and ``dV``
are summed over the query heads in registers and written once, ``dQ`` once per head:
no atomics, so gradients are bitwise deterministic. ``Di = rowsum(dO * O)`` is computed
inline as ``rowsum(P * dP)`` (equal, since ``dP = dO V^T`` and ``O = P V``): no
preprocessing kernel and no extra ``PV`` product. Rotary gradients are rotated back by
the transpose rotation before dq and dk are stored.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import LOG2E, fast_trig, input_precision, needs_int64, rotary_args, tile_config
from ._rotary import rotary_tables, rotate
from ._schedule import Schedule, block_of_program
from .block_fwd import block_positions, block_probs, load_tile, store_tile


@triton.jit(do_not_specialize=["slots", "scale", "qk_scale", "rotary_dim", "log2_theta"])
def _block_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, Table, Pos,
    slots, scale, qk_scale, rotary_dim, log2_theta,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
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
    dk = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for g in tl.static_range(GROUPS):
        h = hk * GROUPS + g
        q = load_tile(Q + h * stride_qh, rows, offs_d, stride_qt, stride_qd, mask, INT64)
        do = load_tile(DO + h * stride_doh, rows, offs_d, stride_dot, stride_dod, mask, INT64)
        if HAS_ROTARY:
            q = rotate(q.to(tl.float32), cos, sin, partner, False).to(Q.dtype.element_ty)
        p = block_probs(q, k, offs_m, row_ok, qk_scale, IS_CAUSAL, PRECISION)
        dv += tl.dot(tl.trans(p.to(DO.dtype.element_ty)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - tl.sum(p * dp, 1)[:, None])
        ds_lo = ds.to(Q.dtype.element_ty)
        dq = tl.dot(ds_lo, k, input_precision=PRECISION) * scale
        if HAS_ROTARY:
            dq = rotate(dq, cos, sin, partner, True)
        store_tile(DQ + h * stride_dqh, dq.to(DQ.dtype.element_ty), rows, offs_d, stride_dqt, stride_dqd, mask, INT64)
        dk += tl.dot(tl.trans(ds_lo), q, input_precision=PRECISION)
    dk = dk * scale
    if HAS_ROTARY:
        dk = rotate(dk, cos, sin, partner, True)
    store_tile(DK + hk * stride_dkh, dk.to(DK.dtype.element_ty), rows, offs_d, stride_dkt, stride_dkd, mask, INT64)
    store_tile(DV + hk * stride_dvh, dv.to(DV.dtype.element_ty), rows, offs_d, stride_dvt, stride_dvd, mask, INT64)


def block_attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
    block_size: int, scale: float, causal: bool, rope_theta: Optional[float],
    positions: Optional[torch.Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns ``(dq, dk, dv)``, contiguous, dtypes of the inputs."""
    total, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    dq = torch.empty((total, num_heads, head_dim), dtype=q.dtype, device=q.device)
    dk = torch.empty((total, kv_heads, head_dim), dtype=k.dtype, device=k.device)
    dv = torch.empty((total, kv_heads, head_dim), dtype=v.dtype, device=v.device)
    if total == 0:
        return dq, dk, dv
    sched = Schedule(offsets, total, block_size, cpu_offsets)
    if sched.programs == 0:
        return dq, dk, dv
    cfg = tile_config(block_size, head_dim, backward=True)
    has_rotary, rotary_dim, log2_theta = rotary_args(rope_theta, rotary_dim)
    _block_bwd_kernel[(sched.programs, kv_heads)](
        q, k, v, do, dq, dk, dv, sched.table, positions if positions is not None else sched.table,
        sched.programs, scale, scale * LOG2E, rotary_dim, log2_theta,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
        HEAD_DIM=head_dim, GROUPS=num_heads // kv_heads, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_d, IS_CAUSAL=causal, HAS_ROTARY=has_rotary,
        HAS_POS=positions is not None, INTERLEAVED=rotary_interleaved, FAST_TRIG=fast_trig(q),
        INT64=needs_int64(q, k, v, do, dq, dk, dv), PRECISION=input_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dq, dk, dv
