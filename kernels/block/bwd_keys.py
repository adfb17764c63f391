"""Block-attention backward over key rows: the ``keys`` variant (Triton, backward only).

Per program: one block (up to 128 tokens) of one kv head. The program holds the block's k and v
and the float32 dK, dV of all its keys, and walks the ``GROUPS`` query heads in 64-row query
tiles. Per (query head, query tile) the scores are computed transposed, ``S^T = K Q_t^T`` (keys x
queries), so that every product but dQ's has the key rows as its M side:

- ``P^T``: the softmax of each column over the block's keys (all of them are in the program, so
  the column maximum and sum are exact: nothing is saved by the forward but q, k, v);
- ``dV += P^T dO_t``, ``dP^T = V dO_t^T``, ``delta = colsum(P^T * dP^T)`` (= rowsum(dO * O)),
  ``dS^T = P^T (dP^T - delta)``, ``dK += dS^T Q_t``;
- ``dQ_t = (dS^T)^T K``: the tile's dQ is whole (the program has every key of the block) and is
  stored once, so the gradients are bitwise deterministic, as the other variants'.

Against the query-row kernels at 128-token blocks (``simple``, ``hopper``: the 128 x 128 scores,
dP, dK and dV at once), the scores and dP here are 128 x 64: half the registers, beside the dK and
dV accumulators that grouped query heads keep live across the heads. Rotary: q and k rotated in
float32 as they are loaded (split halves, interleaved pairs, partial ``rotary_dim``, given or
implicit positions), dQ and dK rotated back before they are stored. Rows past the block are
masked on every load and store, so no other block's data is used.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..common.launch import Launcher
from ..common.rotary import load_rotated_pair, rotate_pair, tile_sin_cos
from ..common.schedule import block_of_program
from ..common.split import load_split, store_split
from ..common.tiles import load_cols, pair_cols, pass_cols, store_cols, store_pairs

# Rows of a query tile: the N side of the transposed scores.
QUERY_TILE = tl.constexpr(64)


@triton.jit
def _column_probs(st, offs_n, offs_m, n, qk_scale, IS_CAUSAL: tl.constexpr):
    """Probabilities ``P^T`` of raw transposed scores ``st [keys, queries]``: each column's softmax
    over the block's ``n`` keys (and the causal triangle, key <= query). Columns of padding
    queries (no key) are zero, not NaN."""
    valid = (offs_n < n)[:, None] & (offs_m < n)[None, :]
    if IS_CAUSAL:
        valid = valid & (offs_n[:, None] <= offs_m[None, :])
    st = tl.where(valid, st * qk_scale, float("-inf"))
    pt = tl.exp2(st - tl.maximum(tl.max(st, 0), -1e30)[None, :])
    # (A column with keys sums to at least 1: its maximum's term.)
    return pt * (1.0 / tl.maximum(tl.sum(pt, 0), 1.0))[None, :]


@triton.jit
def _bwd_keys_block(
    Q, K, V, DO, DQ, DK, DV, Pos, start, n, first_row, hk, scale, qk_scale, log2_theta,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Gradients of the block at ``start`` (``n`` tokens, its first row ``first_row`` in its
    sequence) for kv head ``hk`` and its query heads."""
    dtype = Q.dtype.element_ty
    offs_n = tl.arange(0, BLOCK_M)
    n_ok = offs_n < n
    rows_n = start + offs_n
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k_ptr = K + hk * stride_kh
    v = load_cols(V + hk * stride_vh, rows_n, n_ok, offs_d, d_ok, stride_vt, stride_vd, INT64)
    dv = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if ROT_DIM > 0:
        offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
        k_sin, k_cos = tile_sin_cos(Pos, start, first_row, offs_n, rows_n, offs_n, n_ok, offs_r, log2_theta,
                                    ROT_DIM, HAS_POS, FAST_TRIG, True, 0)
    else:
        k_sin = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_cos = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # (Zero tiles for the parts a call does not have: ``common.split``.)
    ka, kb, kp = load_split(k_ptr, rows_n, n_ok, k_sin, k_cos, stride_kt, stride_kd,
                            BLOCK_M, HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
    dka = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    dkp = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    if ROT_DIM < HEAD_DIM:
        cols_p, p_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
    q_tiles = tl.cdiv(n, QUERY_TILE)
    # One flat loop over (query head, query tile), as the flash dK/dV pass's. Its body keeps its
    # own order, column tile by column tile, as ``block.bwd``'s loop (which says why).
    for it in range(0, GROUPS * q_tiles):
        h = hk * GROUPS + it // q_tiles
        offs_m = (it % q_tiles) * QUERY_TILE + tl.arange(0, QUERY_TILE)
        m_ok = offs_m < n
        rows_m = start + offs_m
        q_ptr = Q + h * stride_qh
        dq_ptr = DQ + h * stride_dqh
        do = load_cols(DO + h * stride_doh, rows_m, m_ok, offs_d, d_ok, stride_dot, stride_dod, INT64)
        st = tl.zeros((BLOCK_M, QUERY_TILE), dtype=tl.float32)
        if ROT_DIM > 0:
            q_sin, q_cos = tile_sin_cos(Pos, start, first_row, offs_m, rows_m, offs_m, m_ok, offs_r, log2_theta,
                                        ROT_DIM, HAS_POS, FAST_TRIG, True, 0)
            qa, qb = load_rotated_pair(q_ptr, rows_m, m_ok, cols_a, cols_b, r_ok, q_sin, q_cos, stride_qt,
                                       stride_qd, BLOCK_R, ROT_DIM, INTERLEAVED, INT64)
            st = tl.dot(ka, tl.trans(qa), st, input_precision=PRECISION)
            st = tl.dot(kb, tl.trans(qb), st, input_precision=PRECISION)
        if ROT_DIM < HEAD_DIM:
            qp = load_cols(q_ptr, rows_m, m_ok, cols_p, p_ok, stride_qt, stride_qd, INT64)
            st = tl.dot(kp, tl.trans(qp), st, input_precision=PRECISION)
        pt = _column_probs(st, offs_n, offs_m, n, qk_scale, IS_CAUSAL)
        dv = tl.dot(pt.to(dtype), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = (pt * (dpt - tl.sum(pt * dpt, 0)[None, :])).to(dtype)
        ds = tl.trans(dst)
        if ROT_DIM > 0:
            dqa = tl.dot(ds, ka, input_precision=PRECISION) * scale
            dqb = tl.dot(ds, kb, input_precision=PRECISION) * scale
            dqa, dqb = rotate_pair(dqa, dqb, q_sin, q_cos, True)
            store_pairs(dq_ptr, dqa, dqb, rows_m, m_ok, cols_a, cols_b, r_ok, stride_dqt, stride_dqd, BLOCK_R,
                        ROT_DIM, INTERLEAVED, INT64)
            dka = tl.dot(dst, qa, dka, input_precision=PRECISION)
            dkb = tl.dot(dst, qb, dkb, input_precision=PRECISION)
        if ROT_DIM < HEAD_DIM:
            dqp = tl.dot(ds, kp, input_precision=PRECISION) * scale
            store_cols(dq_ptr, dqp, rows_m, m_ok, cols_p, p_ok, stride_dqt, stride_dqd, INT64)
            dkp = tl.dot(dst, qp, dkp, input_precision=PRECISION)
    store_split(DK + hk * stride_dkh, dka, dkb, dkp, scale, k_sin, k_cos, rows_n, n_ok, stride_dkt, stride_dkd,
                HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
    store_cols(DV + hk * stride_dvh, dv, rows_n, n_ok, offs_d, d_ok, stride_dvt, stride_dvd, INT64)


@triton.jit(do_not_specialize=["slots", "num_seqs", "block_size", "scale", "qk_scale", "log2_theta", "kv_heads"])
def _block_bwd_keys_kernel(
    Q, K, V, DO, DQ, DK, DV, Sched, Pos,
    slots, num_seqs, block_size, scale, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, INLINE_SEQS: tl.constexpr,
):
    """Same arguments as ``block.bwd``'s kernel (one program per (block, kv head))."""
    start, n, first_row = block_of_program(Sched, slots, num_seqs, block_size, tl.program_id(0), INLINE_SEQS)
    if n > 0:
        _bwd_keys_block(Q, K, V, DO, DQ, DK, DV, Pos, start, n, first_row, tl.program_id(1), scale, qk_scale,
                        log2_theta, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                        stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
                        stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
                        stride_dvt, stride_dvh, stride_dvd,
                        HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
                        HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION)


launch_bwd = Launcher(_block_bwd_keys_kernel)
