"""Multi-tile ("jagged flash") attention forward: blocks longer than one tile and full attention.

Per program: one query tile (``BLOCK_M`` rows) of one block of one kv head, and the
``GROUPS`` query heads that share it (GQA, looped). Each head runs over the key tiles of
its block (causal: only up to the tile's diagonal) with an online softmax: a running max
and running sum in float32, the accumulator rescaled when the max grows. It writes ``O``
and the natural-log logsumexp ``lse [H, T]`` (float32, of the scaled scores) that the
backward needs. Rotary is applied to the q and k tiles right after loading (see
``common.rotary``); positions are the index in the sequence or the given ones.

Requirements: ``q [T, H, D]``, ``k, v [T, H_kv, D]`` with ``H % H_kv == 0``, any strides;
``offsets [B+1]`` int32/int64; ``block_size`` >= 1, or 0 for full per-sequence attention.
Programs come from a device tile table (``_flash_common.FlashSchedule``): no host sync.
Rows past the block are masked, so memory beyond valid rows is never read. Whole key tiles
(every row inside the block) come through tensor-map (TMA) loads where ``tma_loads`` allows
(sm_90+, plain heads, rows of ``H * D`` contiguous elements); the masked tiles keep pointer loads.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..common.meta import LOG2E, kernel_meta, major_of
from .schedule import (
    FlashSchedule, allowed, flash_tiles, load_row_tiles, program_rows, row_tiles, tile_sin_cos, tma_loads,
)
from ..common.launch import Launcher
from ..common.split import load_split, split_scores
from ..common.tiles import row_ptrs, store_cols

_LN2 = tl.constexpr(0.6931471805599453)


def fwd_launch_options(block_m: int, head_dim: int, device_type: str, major: int = 9, block_size: int = 0) -> dict:
    """8 warps for 128-row tiles at D > 64 and for D > 128, else 4, except for the short blocks
    of ``flash_tiles`` on sm_90 (8 warps up to 256 rows, 4 up to 512: H200 sweep); key-tile loads
    pipelined 3 deep on sm_90 and sm_100 (H200, seed3: 1.56 -> 1.31 ms against 2 stages), 2 deep
    on the others (sm_8x and sm_120 have about 100 KB of shared memory per block, too little for
    a third stage of 128-row tiles)."""
    warps = 8 if (block_m > 64 and head_dim > 64) or head_dim > 128 else 4
    if major == 9 and head_dim <= 128 and 0 < block_size <= 512:
        warps = 8 if block_size <= 256 else 4
    if device_type != "cuda":
        return dict(num_warps=warps, num_stages=1)
    return dict(num_warps=warps, num_stages=3 if major in (9, 10) else 2)


@triton.jit
def _fwd_key_tiles(
    acc, l_i, m_i, qa, qb, qp, k_ptr, v_ptr, KD, VD, hk, Pos, start, first_row, n, offs_m, offs_d, d_ok,
    n_lo, n_hi, qk_scale, log2_theta, stride_kt, stride_kd, stride_vt, stride_vd,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
    IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """Online-softmax update of ``(acc, l_i, m_i)`` over the key tiles starting in ``[n_lo, n_hi)``."""
    dtype = qa.dtype
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n
        ka, kb, kp, v = load_row_tiles(
            k_ptr, v_ptr, KD, VD, hk, start, n0, offs_n, n_ok, offs_d, d_ok, Pos, first_row, log2_theta,
            stride_kt, stride_kd, stride_vt, stride_vd,
            TMA and not MASKED, BLOCK_N, HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, FAST_TRIG, INT64,
        )
        s = split_scores(qa, qb, qp, ka, kb, kp, BLOCK_M, BLOCK_N, HEAD_DIM, ROT_DIM, PRECISION)
        if MASKED:
            s = tl.where(allowed(offs_m, offs_n, n_ok, IS_CAUSAL), s, float("-inf"))
        # The first key tile of a row tile has a column allowed for every row (padding rows
        # included: unmasked tiles, or the diagonal tile's first column), so m_new is finite
        # from the first tile on and no row divides by zero. The scale (> 0) is applied in
        # one multiply-add with the max subtraction.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["slots", "kv_heads", "qk_scale", "log2_theta", "stride_lh"])
def _flash_fwd_kernel(
    Q, K, V, KD, VD, O, Lse, Table, Pos,
    slots, kv_heads, qk_scale, log2_theta,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr,
    INT64: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    hk, start, n, first_row, tile_row, offs_m, m_ok, rows_m = program_rows(Table, slots, kv_heads, BLOCK_M)
    if n == 0:
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k_ptr = K + hk * stride_kh
    v_ptr = V + hk * stride_vh
    q_sin, q_cos = tile_sin_cos(Pos, start, first_row, offs_m, m_ok, log2_theta,
                                BLOCK_M, BLOCK_R, ROT_DIM, INTERLEAVED, HAS_POS, FAST_TRIG)
    n_end = n
    full_end = (n // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        n_end = tl.minimum(n, tile_row + BLOCK_M)
        full_end = (tile_row // BLOCK_N) * BLOCK_N
    for g in range(GROUPS):
        h = hk * GROUPS + g
        qa, qb, qp = load_split(Q + h * stride_qh, rows_m, m_ok, q_sin, q_cos, stride_qt, stride_qd,
                                BLOCK_M, HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        # Key tiles wholly inside the block (and, causal, wholly left of this query tile's
        # first row) need no mask; only the tiles on the diagonal or at the block end do.
        acc, l_i, m_i = _fwd_key_tiles(
            acc, l_i, m_i, qa, qb, qp, k_ptr, v_ptr, KD, VD, hk, Pos, start, first_row, n, offs_m, offs_d, d_ok,
            0, full_end, qk_scale, log2_theta, stride_kt, stride_kd, stride_vt, stride_vd,
            False, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, FAST_TRIG,
            INT64, PRECISION, TMA,
        )
        acc, l_i, m_i = _fwd_key_tiles(
            acc, l_i, m_i, qa, qb, qp, k_ptr, v_ptr, KD, VD, hk, Pos, start, first_row, n, offs_m, offs_d, d_ok,
            full_end, n_end, qk_scale, log2_theta, stride_kt, stride_kd, stride_vt, stride_vd,
            True, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, FAST_TRIG,
            INT64, PRECISION, TMA,
        )
        o = acc / l_i[:, None]
        store_cols(O + h * stride_oh, o, rows_m, m_ok, offs_d, d_ok, stride_ot, stride_od, INT64)
        tl.store(row_ptrs(Lse, h, stride_lh, rows_m, INT64), (m_i + tl.log2(l_i)) * _LN2, mask=m_ok)


def flash_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, block_size: int,
    scale: float, causal: bool, rope_theta: Optional[float], positions: Optional[torch.Tensor],
    rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[torch.Tensor],
    tiles: Optional[Tuple[int, int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns ``o [T, H, D]`` (contiguous, dtype of ``q``) and
    ``lse [H, T]`` float32. ``block_size == 0``: full attention; ``tiles``: (query, key) tile
    rows, default ``flash_tiles``.
    """
    total, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    o = q.new_empty((total, num_heads, head_dim))
    lse = q.new_empty((num_heads, total), dtype=torch.float32)
    if total == 0:
        return o, lse
    major = major_of(q)
    block_m, block_n = tiles or flash_tiles(head_dim, q.device.type, q.element_size(), major, block_size)["fwd"]
    sched = FlashSchedule(offsets, total, block_size, block_m, cpu_offsets, longest_first=block_size == 0)
    if sched.programs == 0:
        return o, lse
    table = sched.table(late_first=True)
    meta = kernel_meta(q, k, v, o, block_size=block_m, rope_theta=rope_theta, rotary_dim=rotary_dim,
                       interleaved=rotary_interleaved, positions=positions, causal=causal, backward=False)
    meta.update(fwd_launch_options(meta["BLOCK_M"], head_dim, q.device.type, major, block_size))
    tma = tma_loads(q, k, v, rope_theta=rope_theta) and not meta["INT64"]
    args = (
        q, k, v, row_tiles(k, block_n, tma), row_tiles(v, block_n, tma), o, lse, table,
        positions if positions is not None else table,
        sched.programs, kv_heads, scale * LOG2E, meta.pop("log2_theta"),
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), lse.stride(0),
    )
    meta.update(GROUPS=num_heads // kv_heads, BLOCK_N=block_n, TMA=tma)
    (_launch_fwd_tma if tma else _launch_fwd)((sched.programs * kv_heads,), args, meta, q)
    return o, lse


_launch_fwd = Launcher(_flash_fwd_kernel)
# A launcher keys its cache by the kinds of arguments at each position: tensor-map launches,
# which pass descriptors where the others pass tensors, have their own.
_launch_fwd_tma = Launcher(_flash_fwd_kernel)
