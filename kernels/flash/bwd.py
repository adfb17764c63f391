"""Multi-tile ("jagged flash") attention backward, FA2-style: deterministic, or fast with atomic dQ.

The deterministic backward: two launches (besides the tile tables) after the forward has saved
``O`` and ``lse [H, T]``:

1. dQ: one program per query tile (``BLOCK_M`` rows) of a block and kv head, each query head
   in turn: it computes ``delta = rowsum(dO * O)`` of its rows (float32 ``[H, T]``, stored for
   the next pass), loops over the key tiles of the block (causal: up to the diagonal) and
   accumulates ``dQ += dS K`` (``dS = P (dP - delta)``, ``P = exp(S - lse)``).
2. dK/dV: one program per key tile (``BLOCK_N`` rows) of a block and kv head: it loops over
   the ``GROUPS`` query heads and the query tiles of the block (causal: from the diagonal on),
   recomputes ``P`` and accumulates ``dV += P^T dO`` and ``dK += dS^T Q`` in registers; each
   dK, dV row is written once. (A separate delta kernel before both cost 69 us at seed3; the
   dQ pass reads each query tile once anyway.)

Masks only where they matter: tiles crossing the causal diagonal (both passes) and, in the
dQ pass, the last key tile of a block; padding query rows load q = dO = 0 and add nothing,
padding key rows of the dK/dV pass are never stored. Every gradient element is written by
exactly one program in a fixed order, so the backward is bitwise deterministic. Rotary
gradients are rotated back by the transpose rotation before dq and dk are stored
(``rotate_pair(..., INVERSE=True)``).

The fast backward's Triton form (``deterministic=False`` with ``TRITON_FAST_TAKEN``) computes each
score tile once instead of twice: a
delta pass (``rowsum(dO * O)``), then the dK/dV pass, which also adds each (query tile, key tile)
term ``dS K`` of dQ to float32 sums ``[T, H, D]`` by atomic adds, then a pass that scales, rotates
back and casts those sums into dQ. dK and dV are as deterministic as above; dQ's float32 sums
depend on the order of the adds, so dQ can differ between runs in its last bits. It measured slower
than the deterministic backward everywhere, so a fast backward runs a one-pass form only where the
Gluon kernel below takes it (``fast_form_taken``) and is the deterministic backward elsewhere.

On sm_90, where ``sm90.flash_bwd`` takes the call (``sm90.flash_bwd.taken``: full attention with D
128, both backwards), the backward is the fast one's three passes
with the dK/dV pass by its warp-specialized Gluon kernel (dQ's terms by TMA reduce-adds); the
deterministic form has that kernel add each query tile's dQ terms in a fixed order (key tile by key
tile, each waiting for its turn on a counter and for its adds' writes), so its float32 sums, and
dQ, are bitwise the same run to run. At full attention with D 64 (``sm90.flash_bwd.dkdv_only``) the
deterministic backward keeps its Triton dQ pass and runs the Gluon kernel as its dK/dV pass without
dQ's terms (bitwise deterministic as well).

Loads: as in ``flash.fwd``, whole tiles of the inner loops (query tiles in the dK/dV pass, key
tiles in the dQ pass) through tensor maps where ``tma_loads`` allows; then the dK/dV pass leaves
the partial last query tile to its masked loop (seed3 backward on the H200: 4.18 -> 3.72 ms).

Requirements: as ``flash.fwd``; ``o`` and ``lse`` from ``flash_attention_fwd`` of the same call.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..common.meta import LOG2E, kernel_meta, major_of, needs_int64
from .schedule import (
    FlashSchedule, add_split, allowed, flash_tiles, load_acc_split, load_row_tiles, program_rows, row_tiles,
    tile_sin_cos, tma_loads,
)
from ..common.launch import Launcher
from ..common.split import load_split, split_acc, split_scores, store_split
from ..common.tiles import load_cols, row_ptrs, store_cols

# Whether the fast backward may run its Triton one-pass form (dQ's terms by atomic adds in the Triton
# dK/dV pass) where the Gluon kernel does not take it. Measured slower than the deterministic
# backward wherever it runs (seed3: 5.01 ms against 3.84 on the H200, session 17; 5.07 against 3.84 on
# an H100, causal 3.07 / 2.23, GQA 4.81 / 3.87, prod_full 56.6 / 43.5, blocks of 256 10.3 / 7.33, of
# 512 14.6 / 10.8, session 40), so off: the fast backward runs the deterministic one there. Set by the
# tests of that form and the benchmark's ``triton_flash[triton_fast_bwd]`` row.
TRITON_FAST_TAKEN = [False]

_LOG2E = tl.constexpr(LOG2E)


def bwd_launch_options(block: int, head_dim: int, device_type: str, inner: int = 64, dq_atomic: bool = False) -> dict:
    """8 warps for 128-row tiles at D > 64 and for D > 128, else 4 (the fast dK/dV pass: 8 at
    D > 64, where its dQ term's accumulator spilled 748 bytes per thread at 4 warps, 228 at 8, in
    ptxas for sm_90 at D128); 2 stages to overlap inner-loop loads, except over 32-row inner
    tiles: there Triton 3.6's pipelined dK/dV loop gave wrong, run-to-run different dK on the H200
    (measured; 1 stage and 64-row inner tiles were right)."""
    warps = 8 if (block > 64 and head_dim > 64) or head_dim > 128 or (dq_atomic and head_dim > 64) else 4
    return dict(num_warps=warps, num_stages=2 if device_type == "cuda" and inner >= 64 else 1)


@triton.jit
def _dkdv_query_tiles(
    dka, dkb, dkp, dv, ka, kb, kp, v, Q, DO, QD, DOD, Lse, Delta, DQA, DQD, Pos, hk, start, first_row, n, offs_n, n_ok,
    offs_d, d_ok, m_lo, m_tiles, spread, qk_scale, log2_theta, stride_qt, stride_qh, stride_qd,
    stride_dot, stride_doh, stride_dod, stride_lh, stride_qat, stride_qah,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr,
    INT64: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr,
):
    """Accumulate ``dK`` (as ``a, b, p`` tiles) and ``dV`` of one key tile over ``m_tiles`` query
    tiles from row ``m_lo``, for every query head of the group; with ``DQ_ATOMIC`` also add each
    query tile's share of ``dQ`` (``dS K``, rotated, unscaled) to the float32 ``DQA``, starting
    ``spread`` tiles in and wrapping round, so that the key tiles of a block, running at once, add
    to different query tiles' sums at any one time."""
    dtype = ka.dtype
    # One flat loop over (query head, query tile): nested loops that carry the dK, dV
    # accumulators across the outer loop break the software pipeliner on sm_100.
    for it in range(0, GROUPS * m_tiles):
        h = hk * GROUPS + it // m_tiles
        j = it % m_tiles
        if DQ_ATOMIC:
            j = (j + spread) % m_tiles
        m0 = m_lo + j * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n
        rows_m = start + offs_m
        qa, qb, qp, do = load_row_tiles(
            Q + h * stride_qh, DO + h * stride_doh, QD, DOD, h, start, m0, offs_m, m_ok, offs_d, d_ok, Pos,
            first_row, log2_theta, stride_qt, stride_qd, stride_dot, stride_dod,
            TMA and not MASKED, BLOCK_M, HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, FAST_TRIG, INT64,
        )
        lse = tl.load(row_ptrs(Lse, h, stride_lh, rows_m, INT64), mask=m_ok, other=0.0) * _LOG2E
        delta = tl.load(row_ptrs(Delta, h, stride_lh, rows_m, INT64), mask=m_ok, other=0.0)
        if DQ_ATOMIC:
            # Scores as [key rows, query rows]: the (128-row) key tile is the M side of every
            # product but dQ's, so 8 warps split it between two m64 warpgroups (in ptxas for sm_90
            # at 128 x 64 tiles: 488 bytes spilled against 2628 the other way round).
            st = split_scores(ka, kb, kp, qa, qb, qp, BLOCK_N, BLOCK_M, HEAD_DIM, ROT_DIM, PRECISION)
            pt = tl.exp2(st * qk_scale - lse[None, :])
            if MASKED:
                pt = tl.where(tl.trans(allowed(offs_m, offs_n, n_ok, IS_CAUSAL) & m_ok[:, None]), pt, 0.0)
            dv = tl.dot(pt.to(dtype), do, dv, input_precision=PRECISION)
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dst = (pt * (dpt - delta[None, :])).to(dtype)
            dka, dkb, dkp = split_acc(dst, qa, qb, qp, dka, dkb, dkp, HEAD_DIM, ROT_DIM, PRECISION)
            dqa, dqb, dqp = split_acc(tl.trans(dst), ka, kb, kp, tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32),
                                      tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32),
                                      tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32), HEAD_DIM, ROT_DIM, PRECISION)
            if DQ_TMA and not MASKED:
                DQD.atomic_add([start + m0, h * HEAD_DIM], dqp)
            else:
                add_split(DQA + h * stride_qah, dqa, dqb, dqp, rows_m, m_ok, stride_qat,
                          HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
        else:
            s = split_scores(qa, qb, qp, ka, kb, kp, BLOCK_M, BLOCK_N, HEAD_DIM, ROT_DIM, PRECISION)
            p = tl.exp2(s * qk_scale - lse[:, None])
            if MASKED:
                p = tl.where(allowed(offs_m, offs_n, n_ok, IS_CAUSAL) & m_ok[:, None], p, 0.0)
            dv = tl.dot(tl.trans(p.to(dtype)), do, dv, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = (p * (dp - delta[:, None])).to(dtype)
            dka, dkb, dkp = split_acc(tl.trans(ds), qa, qb, qp, dka, dkb, dkp, HEAD_DIM, ROT_DIM, PRECISION)
    return dka, dkb, dkp, dv


@triton.jit
def _dq_key_tiles(
    dqa, dqb, dqp, qa, qb, qp, do, lse, delta, K, V, KD, VD, Pos, hk, start, first_row, n, offs_m, m_ok,
    offs_d, d_ok, n_lo, n_hi, qk_scale, log2_theta, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    """Accumulate ``dQ`` (as ``a, b, p`` tiles) of one query tile and head over the key tiles
    starting in ``[n_lo, n_hi)``."""
    dtype = do.dtype
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n
        ka, kb, kp, v = load_row_tiles(
            K + hk * stride_kh, V + hk * stride_vh, KD, VD, hk, start, n0, offs_n, n_ok, offs_d, d_ok, Pos,
            first_row, log2_theta, stride_kt, stride_kd, stride_vt, stride_vd,
            TMA and not MASKED, BLOCK_N, HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, FAST_TRIG, INT64,
        )
        s = split_scores(qa, qb, qp, ka, kb, kp, BLOCK_M, BLOCK_N, HEAD_DIM, ROT_DIM, PRECISION)
        p = tl.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            # Padding key columns must be zeroed here: exp2 of an unbounded score times k = 0
            # could otherwise make inf * 0 in dS K.
            p = tl.where(allowed(offs_m, offs_n, n_ok, IS_CAUSAL) & m_ok[:, None], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = (p * (dp - delta[:, None])).to(dtype)
        dqa, dqb, dqp = split_acc(ds, ka, kb, kp, dqa, dqb, dqp, HEAD_DIM, ROT_DIM, PRECISION)
    return dqa, dqb, dqp


@triton.jit(do_not_specialize=["slots", "kv_heads", "scale", "qk_scale", "log2_theta", "stride_lh"])
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, QD, DOD, Lse, Delta, DK, DV, DQA, DQD, Table, Pos,
    slots, kv_heads, scale, qk_scale, log2_theta,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dkt, stride_dkh, stride_dkd, stride_dvt, stride_dvh, stride_dvd, stride_lh, stride_qat, stride_qah,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr,
    INT64: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    DQ_TMA: tl.constexpr,
):
    hk, start, n, first_row, tile_row, offs_n, n_ok, rows_n = program_rows(Table, slots, kv_heads, BLOCK_N)
    if n == 0:
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k_sin, k_cos = tile_sin_cos(Pos, start, first_row, offs_n, n_ok, log2_theta,
                                BLOCK_N, BLOCK_R, ROT_DIM, INTERLEAVED, HAS_POS, FAST_TRIG)
    ka, kb, kp = load_split(K + hk * stride_kh, rows_n, n_ok, k_sin, k_cos, stride_kt, stride_kd,
                            BLOCK_N, HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
    v = load_cols(V + hk * stride_vh, rows_n, n_ok, offs_d, d_ok, stride_vt, stride_vd, INT64)
    dka = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    dkp = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # Query tiles from the diagonal on (causal) or all of them; only those that cross the
    # diagonal need the causal mask. Padding query rows load q = dO = 0 and contribute 0;
    # padding key rows are never stored, so unmasked tiles need no mask at all.
    m_begin = 0
    masked_tiles = 0
    if IS_CAUSAL:
        m_begin = (tile_row // BLOCK_M) * BLOCK_M
        masked_tiles = tl.cdiv(tl.minimum(n, tile_row + BLOCK_N) - m_begin, BLOCK_M)
    m_free = m_begin + masked_tiles * BLOCK_M
    spread = tile_row // BLOCK_N  # this key tile's index in its block (the fast pass's first query tile)
    # Pointer loads give zeros past the block, so the unmasked loop may take its partial last
    # tile; tensor-map loads take whole tiles only and leave that one to a masked tail.
    m_full = n
    if TMA:
        m_full = (n // BLOCK_M) * BLOCK_M
    dka, dkb, dkp, dv = _dkdv_query_tiles(
        dka, dkb, dkp, dv, ka, kb, kp, v, Q, DO, QD, DOD, Lse, Delta, DQA, DQD, Pos, hk, start, first_row, n, offs_n, n_ok,
        offs_d, d_ok, m_begin, masked_tiles, spread, qk_scale, log2_theta, stride_qt, stride_qh, stride_qd,
        stride_dot, stride_doh, stride_dod, stride_lh, stride_qat, stride_qah,
        True, HEAD_DIM, GROUPS, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL,
        FAST_TRIG, INT64, PRECISION, TMA, DQ_ATOMIC, DQ_TMA,
    )
    dka, dkb, dkp, dv = _dkdv_query_tiles(
        dka, dkb, dkp, dv, ka, kb, kp, v, Q, DO, QD, DOD, Lse, Delta, DQA, DQD, Pos, hk, start, first_row, n, offs_n, n_ok,
        offs_d, d_ok, m_free, tl.cdiv(m_full - m_free, BLOCK_M), spread, qk_scale, log2_theta, stride_qt, stride_qh,
        stride_qd, stride_dot, stride_doh, stride_dod, stride_lh, stride_qat, stride_qah,
        False, HEAD_DIM, GROUPS, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL,
        FAST_TRIG, INT64, PRECISION, TMA, DQ_ATOMIC, DQ_TMA,
    )
    if TMA:
        tail = tl.maximum(m_free, m_full)
        dka, dkb, dkp, dv = _dkdv_query_tiles(
            dka, dkb, dkp, dv, ka, kb, kp, v, Q, DO, QD, DOD, Lse, Delta, DQA, DQD, Pos, hk, start, first_row, n, offs_n,
            n_ok, offs_d, d_ok, tail, tl.cdiv(n - tail, BLOCK_M), spread, qk_scale, log2_theta, stride_qt, stride_qh,
            stride_qd, stride_dot, stride_doh, stride_dod, stride_lh, stride_qat, stride_qah,
            True, HEAD_DIM, GROUPS, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL,
            FAST_TRIG, INT64, PRECISION, TMA, DQ_ATOMIC, DQ_TMA,
        )
    store_split(DK + hk * stride_dkh, dka, dkb, dkp, scale, k_sin, k_cos, rows_n, n_ok, stride_dkt, stride_dkd,
                HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
    store_cols(DV + hk * stride_dvh, dv, rows_n, n_ok, offs_d, d_ok, stride_dvt, stride_dvd, INT64)


@triton.jit(do_not_specialize=["slots", "kv_heads", "scale", "qk_scale", "log2_theta", "stride_lh"])
def _flash_bwd_dq_kernel(
    Q, K, V, KD, VD, O, DO, Lse, Delta, DQ, Table, Pos,
    slots, kv_heads, scale, qk_scale, log2_theta,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_lh,
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
        do = load_cols(DO + h * stride_doh, rows_m, m_ok, offs_d, d_ok, stride_dot, stride_dod, INT64)
        lse = tl.load(row_ptrs(Lse, h, stride_lh, rows_m, INT64), mask=m_ok, other=0.0) * _LOG2E
        # delta = rowsum(dO * O) of this tile's rows, stored for the dK/dV pass that follows.
        o = load_cols(O + h * stride_oh, rows_m, m_ok, offs_d, d_ok, stride_ot, stride_od, INT64)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(row_ptrs(Delta, h, stride_lh, rows_m, INT64), delta, mask=m_ok)
        dqa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        dqb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        dqp = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        # Unmasked key tiles first (wholly inside the block and left of the diagonal), then
        # the diagonal / block-end tiles with the mask.
        dqa, dqb, dqp = _dq_key_tiles(
            dqa, dqb, dqp, qa, qb, qp, do, lse, delta, K, V, KD, VD, Pos, hk, start, first_row, n, offs_m, m_ok,
            offs_d, d_ok, 0, full_end, qk_scale, log2_theta, stride_kt, stride_kh, stride_kd,
            stride_vt, stride_vh, stride_vd,
            False, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL,
            FAST_TRIG, INT64, PRECISION, TMA,
        )
        dqa, dqb, dqp = _dq_key_tiles(
            dqa, dqb, dqp, qa, qb, qp, do, lse, delta, K, V, KD, VD, Pos, hk, start, first_row, n, offs_m, m_ok,
            offs_d, d_ok, full_end, n_end, qk_scale, log2_theta, stride_kt, stride_kh, stride_kd,
            stride_vt, stride_vh, stride_vd,
            True, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL,
            FAST_TRIG, INT64, PRECISION, TMA,
        )
        store_split(DQ + h * stride_dqh, dqa, dqb, dqp, scale, q_sin, q_cos, rows_m, m_ok, stride_dqt, stride_dqd,
                    HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)


@triton.jit(do_not_specialize=["total", "stride_lh"])
def _flash_bwd_delta_kernel(
    O, DO, Delta, total, stride_ot, stride_oh, stride_od, stride_dot, stride_doh, stride_dod, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, INT64: tl.constexpr,
):
    """``delta[h, t] = rowsum(dO * O)`` of ``BLOCK_M`` rows of one head (the fast backward's first pass)."""
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < total
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    o = load_cols(O + h * stride_oh, rows, ok, offs_d, d_ok, stride_ot, stride_od, INT64)
    do = load_cols(DO + h * stride_doh, rows, ok, offs_d, d_ok, stride_dot, stride_dod, INT64)
    tl.store(row_ptrs(Delta, h, stride_lh, rows, INT64), tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit(do_not_specialize=["slots", "kv_heads", "scale", "log2_theta"])
def _flash_bwd_dq_store_kernel(
    DQA, DQ, Table, Pos, slots, kv_heads, scale, log2_theta, stride_qat, stride_qah, stride_dqt, stride_dqh, stride_dqd,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr,
    FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
):
    """The fast backward's last pass: ``dQ`` of one query tile and kv head's query heads from the
    float32 sums, times ``scale``, rotated back where rotary is on, in dQ's dtype."""
    hk, start, n, first_row, tile_row, offs_m, m_ok, rows_m = program_rows(Table, slots, kv_heads, BLOCK_M)
    if n == 0:
        return
    q_sin, q_cos = tile_sin_cos(Pos, start, first_row, offs_m, m_ok, log2_theta,
                                BLOCK_M, BLOCK_R, ROT_DIM, INTERLEAVED, HAS_POS, FAST_TRIG)
    for g in range(GROUPS):
        h = hk * GROUPS + g
        a, b, p = load_acc_split(DQA + h * stride_qah, rows_m, m_ok, stride_qat,
                                 HEAD_DIM, BLOCK_M, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
        store_split(DQ + h * stride_dqh, a, b, p, scale, q_sin, q_cos, rows_m, m_ok, stride_dqt, stride_dqd,
                    HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)


def flash_attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    offsets: torch.Tensor, block_size: int, scale: float, causal: bool, rope_theta: Optional[float],
    positions: Optional[torch.Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[torch.Tensor], tiles: Optional[dict] = None, deterministic: bool = True,
    unrotate: Optional[tuple] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels; returns ``(dq, dk, dv)``, contiguous, dtypes of the inputs.

    ``block_size == 0``: full attention; ``tiles``: ``{"dkv": (key, query), "dq": (query, key)}``
    tile rows, and ``"dkv_fast"`` for the fast backward's dK/dV pass (else ``"dkv"``), default
    ``flash_tiles``. ``deterministic=False``: the fast backward (module
    docstring): no dQ pass, dQ summed by atomic adds in the dK/dV pass. ``unrotate`` (a call without rotary
    on q and k that the caller rotated, where :func:`stored_dq_unrotates`): ``(rope_theta, positions,
    rotary_dim, interleaved)`` of that rotation, which the Gluon kernel with dQ stored applies back to dq and dk.
    """
    total, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
    if total == 0:
        return q.new_empty(q.shape), dk, dv
    tiles = tiles or flash_tiles(head_dim, q.device.type, q.element_size(), major_of(q), block_size,
                                 rope_theta is not None)
    gluon, gluon_adds_dq = _gluon_dkdv(do, q, k, v, rope_theta, deterministic, block_size)
    if not deterministic and not fast_form_taken(gluon_adds_dq):
        deterministic = True
        gluon, gluon_adds_dq = _gluon_dkdv(do, q, k, v, rope_theta, deterministic, block_size)
    dkv_n, dkv_m = tiles["dkv"] if deterministic else tiles.get("dkv_fast", tiles["dkv"])
    dq_m, dq_n = tiles["dq"]
    if gluon is not None:
        dkv_n = gluon.TILE_N
    longest_first = block_size == 0
    dkv_sched = FlashSchedule(offsets, total, block_size, dkv_n, cpu_offsets, longest_first)
    if dkv_sched.programs == 0:
        return q.new_empty(q.shape), dk, dv
    dq_sched = dkv_sched if dq_m == dkv_n else FlashSchedule(
        offsets, total, block_size, dq_m, cpu_offsets, longest_first)
    lse = lse.contiguous()
    tma = tma_loads(q, k, v, do, rope_theta=rope_theta)
    delta = q.new_empty((num_heads, total), dtype=torch.float32)
    common = dict(rope_theta=rope_theta, rotary_dim=rotary_dim, interleaved=rotary_interleaved,
                  positions=positions, causal=causal, backward=True)
    log2_theta = math.log2(rope_theta) if rope_theta is not None else 0.0

    def pass_meta(tensors, block_m: int, block_n: int, options: dict) -> dict:
        meta = kernel_meta(q, *tensors, block_size=block_m, **common)
        meta.pop("log2_theta")
        meta.update(options, GROUPS=num_heads // kv_heads, BLOCK_N=block_n)
        meta["TMA"] = tma and not meta["INT64"]
        return meta

    if gluon_adds_dq or not deterministic:
        ws = None if gluon is None else functools.partial(
            gluon.dkdv_pass_ws, do, q, k, v, sched=dkv_sched, scale=scale, causal=causal, deterministic=deterministic)
        stores_dq = ws is not None and gluon_adds_dq and gluon.stores_dq(block_size, head_dim)
        own_delta = stores_dq and gluon.computes_delta(block_size, head_dim, causal, num_heads // kv_heads)
        if unrotate is not None:
            if not stores_dq or rope_theta is not None:
                raise ValueError("unrotate: a call without rotary that the Gluon kernel with dQ stored takes")
            ws = functools.partial(ws, unrotate=unrotate)
        return _fast_bwd(do, q, k, v, o, lse, delta, dk, dv, dkv_sched, dq_sched, dq_m, dkv_m, dkv_n, positions, scale,
                         log2_theta, pass_meta, ws, stores_dq, own_delta)
    if unrotate is not None:
        raise ValueError("unrotate: a call without rotary that the Gluon kernel with dQ stored takes")
    # The dQ pass first: it computes delta (for its own rows) as well, which the dK/dV pass reads.
    dq = q.new_empty(q.shape)
    meta = pass_meta((k, v, o, do, dq), dq_m, dq_n, bwd_launch_options(dq_m, head_dim, q.device.type))
    table = dq_sched.table(late_first=True)
    kd, vd = row_tiles(k, dq_n, meta["TMA"]), row_tiles(v, dq_n, meta["TMA"])
    (_launch_dq_tma if meta["TMA"] else _launch_dq)((dq_sched.programs * kv_heads,), (
        q, k, v, kd, vd, o, do, lse, delta, dq, table, positions if positions is not None else table,
        dq_sched.programs, kv_heads, scale, scale * LOG2E, log2_theta,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(), lse.stride(0),
    ), meta, q)

    if gluon is not None:
        gluon.dkdv_pass_ws(do, q, k, v, lse, delta, dk, dv, None, dkv_sched, scale, causal)
    else:
        _dkdv_pass(do, q, k, v, lse, delta, dk, dv, None, dkv_sched, dkv_m, dkv_n, positions, scale, log2_theta,
                   pass_meta)
    return dq, dk, dv


def fast_form_taken(gluon_adds_dq: bool) -> bool:
    """Whether a fast backward (``deterministic=False``) runs a one-pass form: the Gluon kernel's where
    it adds dQ's terms (``gluon_adds_dq``: ``sm90.flash_bwd.taken``), the Triton one only while
    ``TRITON_FAST_TAKEN`` is set; else it runs the deterministic backward, measured faster."""
    return gluon_adds_dq or TRITON_FAST_TAKEN[0]


def _dkdv_pass(do, q, k, v, lse, delta, dk, dv, dq_sums, sched, block_m, block_n, positions, scale, log2_theta,
               pass_meta) -> None:
    """The dK/dV pass; with ``dq_sums`` (float32 ``[T, H, D]``, zeroed) it also adds dQ's terms there."""
    kv_heads = k.shape[1]
    options = bwd_launch_options(block_n, q.shape[-1], q.device.type, inner=block_m, dq_atomic=dq_sums is not None)
    meta = pass_meta((k, v, do, dk, dv), block_m, block_n, options)
    meta["DQ_ATOMIC"] = dq_sums is not None
    table = sched.table(late_first=False)
    qd, dod = row_tiles(q, block_m, meta["TMA"]), row_tiles(do, block_m, meta["TMA"])
    sums = dq_sums if dq_sums is not None else dk
    # Whole query tiles' dQ terms go by tensor-map reductions on the GPU (the interpreter has
    # none), in 16-bit types (float32 tiles would stage 32 KB more than sm_90's shared memory).
    meta["DQ_TMA"] = meta["TMA"] and dq_sums is not None and q.is_cuda and q.element_size() == 2
    sums_tiles = row_tiles(sums, block_m, meta["DQ_TMA"])
    launch = _launch_dkdv_fast_tma if meta["DQ_TMA"] else _launch_dkdv_tma if meta["TMA"] else _launch_dkdv
    launch((sched.programs * kv_heads,), (
        q, k, v, do, qd, dod, lse, delta, dk, dv, sums, sums_tiles, table, positions if positions is not None else table,
        sched.programs, kv_heads, scale, scale * LOG2E, log2_theta,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), lse.stride(0),
        sums.stride(0), sums.stride(1),
    ), meta, q)


def _gluon_dkdv(do, q, k, v, rope_theta, deterministic: bool, block_size: int):
    """``(module, with_dq)``: the module of the warp-specialized Gluon dK/dV pass (``sm90.flash_bwd``)
    where it is chosen and its kernel takes the call, and whether it adds dQ's terms (``taken``: the
    fast backward; the deterministic one at full attention, D 128) or only computes dK and dV beside
    the Triton dQ pass (``dkdv_only``: the deterministic one at full attention, D 64); else
    ``(None, False)``."""
    from ..block import variants

    if variants.gluon_import_error() is not None or not q.is_cuda:
        return None, False
    from ..sm90 import flash_bwd

    if not flash_bwd.runs(deterministic, block_size, q.shape[-1]) or flash_bwd.flash_ws_bwd_reasons(
            do, q, k, v, rope_theta, block_size):
        return None, False
    return flash_bwd, flash_bwd.taken(deterministic, block_size, q.shape[-1])


def stored_dq_reasons(major: Optional[int], dtype: torch.dtype, block_size: int, head_dim: int, rotary: bool,
                      int64: bool) -> list:
    """Why the warp-specialized Gluon backward with dQ stored (``sm90.flash_bwd.stores_dq``: blocks one key tile
    holds whole) cannot take calls of these facts (empty: it can; ``major`` the CUDA device's compute-capability
    major, None off CUDA; ``int64``: 64-bit offsets). Its tensors' layout is :func:`stored_dq_takes`' to check."""
    from ..block import variants

    error = variants.gluon_import_error()
    if error is not None:
        return [f"the sm_90 Gluon kernels ({error})"]
    from ..sm90 import flash_bwd
    from ..sm90.flash_fwd import flash_ws_fact_reasons

    reasons = flash_ws_fact_reasons(major, dtype, head_dim, rotary, flash_bwd.head_dims(block_size))
    if not flash_bwd.stores_dq(block_size, head_dim):
        reasons.append(f"blocks of 1-{flash_bwd.TILE_N} tokens at head dims {sorted(flash_bwd.DQ_STORE_HEAD_DIMS)}")
    if int64:
        reasons.append("32-bit offsets")
    if major is not None and major not in flash_bwd.VERIFIED_ON and not variants.unverified_allowed():
        reasons.append("a GPU its tests passed on (unverified kernels allowed)")
    return reasons


def stored_dq_takes(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                    rope_theta: Optional[float]) -> bool:
    """Whether :func:`flash_attention_bwd` of this call runs the Gluon backward with dQ stored (in either mode:
    ``sm90.flash_bwd.taken`` hands it such calls in both), by the same check it makes (``_gluon_dkdv``)."""
    gluon, with_dq = _gluon_dkdv(do, q, k, v, rope_theta, True, block_size)
    return with_dq and gluon.stores_dq(block_size, q.shape[-1])


def stored_dq_unrotates(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                        rotary_dim: int, interleaved: bool) -> bool:
    """Whether the backward without rotary of this call on rotated q and k runs the Gluon kernel with dQ stored
    (:func:`stored_dq_takes`) and that kernel rotates dq and dk back itself (``sm90.flash_bwd.unrotates``), so
    that :func:`flash_attention_bwd` takes ``unrotate``."""
    if not stored_dq_takes(do, q, k, v, block_size, None):
        return False
    return stored_dq_unrotates_facts(block_size, q.shape[-1], rotary_dim, interleaved)


def _gluon_flash_bwd():
    """The ``sm90.flash_bwd`` module where the Gluon kernels import, else None."""
    from ..block import variants

    if variants.gluon_import_error() is not None:
        return None
    from ..sm90 import flash_bwd

    return flash_bwd


def stored_dq_unrotates_facts(block_size: int, head_dim: int, rotary_dim: int, interleaved: bool) -> bool:
    """``sm90.flash_bwd.unrotates`` where the Gluon kernels import (False where they do not)."""
    gluon = _gluon_flash_bwd()
    return gluon is not None and gluon.unrotates(block_size, head_dim, rotary_dim, interleaved)


def stored_dq_pair_chunk(head_dim: int, rotary_dim: int, interleaved: bool) -> int:
    """``sm90.flash_bwd.pair_chunk`` where the Gluon kernels import (0 where they do not): the channel chunk of the
    paired-chunk order in which that kernel takes q and k to rotate dQ and dK back itself."""
    gluon = _gluon_flash_bwd()
    return 0 if gluon is None else gluon.pair_chunk(head_dim, rotary_dim, interleaved)


def _fast_bwd(do, q, k, v, o, lse, delta, dk, dv, dkv_sched, dq_sched, dq_m, dkv_m, dkv_n, positions, scale,
              log2_theta, pass_meta, ws=None, stores_dq=False, own_delta=False):
    """The fast backward: delta, then the dK/dV pass (``ws``: by the Gluon kernel) adding dQ's terms
    to float32 sums, then dQ from them; ``stores_dq`` (``sm90.flash_bwd.stores_dq``): the Gluon kernel
    stores dQ itself, no sums; ``own_delta`` (``sm90.flash_bwd.computes_delta``): and computes delta
    itself from ``o``, no delta pass."""
    total, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if not own_delta:
        delta_meta = dict(HEAD_DIM=head_dim, BLOCK_M=64, BLOCK_D=triton.next_power_of_2(head_dim),
                          INT64=needs_int64(o, do), num_warps=4)
        _launch_delta((triton.cdiv(total, 64), num_heads), (
            o, do, delta, total, *o.stride(), *do.stride(), delta.stride(0)), delta_meta, q)
    if stores_dq:
        dq = q.new_empty(q.shape)
        ws(lse, delta, dk, dv, None, dq=dq, o=o if own_delta else None)
        return dq, dk, dv
    sums = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if ws is not None:
        ws(lse, delta, dk, dv, sums)
    else:
        _dkdv_pass(do, q, k, v, lse, delta, dk, dv, sums, dkv_sched, dkv_m, dkv_n, positions, scale, log2_theta,
                   pass_meta)
    dq = q.new_empty(q.shape)
    meta = pass_meta((sums, dq), dq_m, dq_m, dict(num_warps=4))
    store_meta = {name: meta[name] for name in _STORE_CONSTEXPRS + ("num_warps",)}
    table = dq_sched.table(late_first=False)
    _launch_dq_store((dq_sched.programs * kv_heads,), (
        sums, dq, table, positions if positions is not None else table, dq_sched.programs, kv_heads, scale,
        log2_theta, sums.stride(0), sums.stride(1), *dq.stride(),
    ), store_meta, q)
    return dq, dk, dv


_STORE_CONSTEXPRS = ("HEAD_DIM", "GROUPS", "BLOCK_M", "BLOCK_R", "BLOCK_P", "ROT_DIM", "INTERLEAVED", "HAS_POS",
                     "FAST_TRIG", "INT64")


_launch_dkdv = Launcher(_flash_bwd_dkdv_kernel)
_launch_dq = Launcher(_flash_bwd_dq_kernel)
_launch_delta = Launcher(_flash_bwd_delta_kernel)
_launch_dq_store = Launcher(_flash_bwd_dq_store_kernel)
# A launcher keys its cache by the kinds of arguments at each position: tensor-map launches,
# which pass descriptors where the others pass tensors, have their own.
_launch_dkdv_tma = Launcher(_flash_bwd_dkdv_kernel)
_launch_dkdv_fast_tma = Launcher(_flash_bwd_dkdv_kernel)  # and a tensor map of the dQ sums
_launch_dq_tma = Launcher(_flash_bwd_dq_kernel)
