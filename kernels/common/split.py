"""``@triton.jit`` helpers for q and k (and dq, dk) held as split column tiles.

A row tile of q or k is held as up to three column tiles: ``a`` and ``b``, the first and second
channel of each rotary pair (columns from ``tiles.pair_cols``; rotated with ``rotary.rotate_pair``),
and ``p``, the pass-through channels past ``rotary_dim`` (``tiles.pass_cols``; all of them without
rotary). Scores and gradient products are then one dot per column tile. Where a call has no such
part (``ROT_DIM == 0``: no ``a``, ``b``; ``ROT_DIM == HEAD_DIM``: no ``p``) the helpers take and
return dummy zero tiles for it (and zero ``sin``, ``cos`` without rotary), which the constexpr
branches never use. Shared by the flash kernels and the block backward kernels.
"""
import triton
import triton.language as tl

from .rotary import rotate_pair
from .tiles import load_cols, load_pairs, pair_cols, pass_cols, store_cols, store_pairs


@triton.jit
def load_split(
    ptr, rows, ok, sin, cos, stride_t, stride_d,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, INT64: tl.constexpr,
):
    """Rows of q or k as ``(a, b, p)`` tiles in the input dtype, rotated by ``(sin, cos)``."""
    dtype = ptr.dtype.element_ty
    if ROT_DIM > 0:
        offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
        a, b = load_pairs(ptr, rows, ok, cols_a, cols_b, r_ok, stride_t, stride_d, BLOCK_R, ROT_DIM, INTERLEAVED, INT64)
        a, b = rotate_pair(a.to(tl.float32), b.to(tl.float32), sin, cos, False)
        a = a.to(dtype)
        b = b.to(dtype)
    else:
        a = tl.zeros((BLOCK, BLOCK_R), dtype=dtype)
        b = tl.zeros((BLOCK, BLOCK_R), dtype=dtype)
    if ROT_DIM < HEAD_DIM:
        cols_p, p_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
        p = load_cols(ptr, rows, ok, cols_p, p_ok, stride_t, stride_d, INT64)
    else:
        p = tl.zeros((BLOCK, BLOCK_P), dtype=dtype)
    return a, b, p


@triton.jit
def split_scores(
    qa, qb, qp, ka, kb, kp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Raw scores ``q k^T`` ``[BLOCK_M, BLOCK_N]`` float32: one dot per column tile."""
    s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ROT_DIM > 0:
        s = tl.dot(qa, tl.trans(ka), s, input_precision=PRECISION)
        s = tl.dot(qb, tl.trans(kb), s, input_precision=PRECISION)
    if ROT_DIM < HEAD_DIM:
        s = tl.dot(qp, tl.trans(kp), s, input_precision=PRECISION)
    return s


@triton.jit
def split_acc(
    x, a, b, p, acc_a, acc_b, acc_p,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, PRECISION: tl.constexpr,
):
    """``acc += x @ [a | b | p]`` per column tile (dq from dS and k, dk from dS^T and q)."""
    if ROT_DIM > 0:
        acc_a = tl.dot(x, a, acc_a, input_precision=PRECISION)
        acc_b = tl.dot(x, b, acc_b, input_precision=PRECISION)
    if ROT_DIM < HEAD_DIM:
        acc_p = tl.dot(x, p, acc_p, input_precision=PRECISION)
    return acc_a, acc_b, acc_p


@triton.jit
def store_split(
    ptr, a, b, p, scale, sin, cos, rows, ok, stride_t, stride_d,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, INT64: tl.constexpr,
):
    """Store a gradient held as ``(a, b, p)`` times ``scale``, rotated back (transpose rotation)."""
    if ROT_DIM > 0:
        offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
        a, b = rotate_pair(a * scale, b * scale, sin, cos, True)
        store_pairs(ptr, a, b, rows, ok, cols_a, cols_b, r_ok, stride_t, stride_d, BLOCK_R, ROT_DIM, INTERLEAVED, INT64)
    if ROT_DIM < HEAD_DIM:
        cols_p, p_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
        store_cols(ptr, p * scale, rows, ok, cols_p, p_ok, stride_t, stride_d, INT64)
