"""A rotation pass over jagged rows, and the backward that runs on rotated copies (the ``rotated``
variant, ``block.variants``).

The fused rotary backwards rotate q and k tiles inside the attention kernels. Where those kernels
run much slower with rotary than without (grouped query heads at head dims of 96 and more, where
the rotary tiles and angles cost registers that the group's dK and dV already hold), the backward
is cheaper as three steps: one pass writes rotated copies of q and k, the backward without rotary
runs on them (the variant ``auto`` takes for that call, or the flash kernels), and one pass rotates
dq and dk back in place (the transpose rotation). The two passes read and write q and k once
each: about 4 x (q + k) bytes more traffic, against the fused kernels' 1.2-2x slowdown.

One program per chunk of ``ROWS`` rows of one sequence (``common.schedule.Schedule`` of chunks)
rotates every head of two tensors (q and k, or dq and dk) with one computation of its rows'
angles: positions given, or each row's index inside its sequence, as the fused kernels take them.
The rotation is float32 math on the rotary pair tiles (``tiles.load_pairs``: split halves,
interleaved pairs, partial ``rotary_dim``); the result is rounded once to the tensor's dtype.
Channels past ``rotary_dim`` are copied where the output is a new tensor and left alone in place.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from blockattn_layers.reference import unpaired_chunks

from ..common.launch import Launcher
from ..common.meta import empty_contiguous, needs_int64, tile_extent
from ..common.rotary import rotary_sin_cos, rotate_pair
from ..common.schedule import Schedule, block_of_program
from ..common.tiles import block_positions, load_cols, load_pairs, pair_cols, pass_cols, store_cols, store_pairs

# Rows per program: 32 rows of up to 128 pairs keep a, b, sin and cos at 64 float32 registers per
# thread each over 8 warps.
ROWS = 32


@triton.jit
def _rotate_heads(X, Y, heads, rows, row_ok, sin, cos, cols_a, cols_b, r_ok, stride_xt, stride_xh, stride_xd,
                  stride_yt, stride_yh, stride_yd, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
                  COPY_PASS: tl.constexpr, INT64: tl.constexpr, PAIR_CHUNK: tl.constexpr):
    """Rotate the rows ``rows`` of every head of ``X`` into ``Y`` (the same tensor in place); ``PAIR_CHUNK``
    (split halves, into copies): ``Y``'s rotary channels in the paired-chunk order
    (``reference.paired_chunks``)."""
    out_a, out_b = cols_a, cols_b
    if PAIR_CHUNK > 0:
        out_a = cols_a % PAIR_CHUNK + 2 * PAIR_CHUNK * (cols_a // PAIR_CHUNK)
        out_b = out_a + PAIR_CHUNK
    for head in range(heads):
        a, b = load_pairs(X + head * stride_xh, rows, row_ok, cols_a, cols_b, r_ok, stride_xt, stride_xd, BLOCK_R,
                          ROT_DIM, INTERLEAVED, INT64)
        a, b = rotate_pair(a.to(tl.float32), b.to(tl.float32), sin, cos, INVERSE)
        dtype = Y.dtype.element_ty
        store_pairs(Y + head * stride_yh, a.to(dtype), b.to(dtype), rows, row_ok, out_a, out_b, r_ok, stride_yt,
                    stride_yd, BLOCK_R, ROT_DIM, INTERLEAVED, INT64)
        if COPY_PASS:
            if ROT_DIM < HEAD_DIM:
                cols, col_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
                x = load_cols(X + head * stride_xh, rows, row_ok, cols, col_ok, stride_xt, stride_xd, INT64)
                store_cols(Y + head * stride_yh, x, rows, row_ok, cols, col_ok, stride_yt, stride_yd, INT64)


@triton.jit(do_not_specialize=["slots", "num_seqs", "chunk", "log2_theta", "heads_a", "heads_b"])
def _rotation_kernel(
    XA, YA, XB, YB, Sched, Pos, slots, num_seqs, chunk, log2_theta, heads_a, heads_b,
    stride_xat, stride_xah, stride_xad, stride_yat, stride_yah, stride_yad,
    stride_xbt, stride_xbh, stride_xbd, stride_ybt, stride_ybh, stride_ybd,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr, INVERSE: tl.constexpr,
    COPY_PASS: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr, INLINE_SEQS: tl.constexpr,
    PAIR_CHUNK: tl.constexpr,
):
    """One chunk of rows: every head of ``XA`` into ``YA``, then of ``XB`` into ``YB``."""
    start, n, first_row = block_of_program(Sched, slots, num_seqs, chunk, tl.program_id(0), INLINE_SEQS)
    if INT64:
        start = start.to(tl.int64)
    if n > 0:
        offs_m = tl.arange(0, BLOCK_M)
        rows = start + offs_m
        row_ok = offs_m < n
        pos = block_positions(Pos, start, first_row, offs_m, row_ok, HAS_POS)
        offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
        sin, cos = rotary_sin_cos(pos, offs_r, log2_theta, ROT_DIM, FAST_TRIG)
        _rotate_heads(XA, YA, heads_a, rows, row_ok, sin, cos, cols_a, cols_b, r_ok,
                      stride_xat, stride_xah, stride_xad, stride_yat, stride_yah, stride_yad,
                      HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INVERSE, COPY_PASS, INT64, PAIR_CHUNK)
        _rotate_heads(XB, YB, heads_b, rows, row_ok, sin, cos, cols_a, cols_b, r_ok,
                      stride_xbt, stride_xbh, stride_xbd, stride_ybt, stride_ybh, stride_ybd,
                      HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INVERSE, COPY_PASS, INT64, PAIR_CHUNK)


launch_rotation = Launcher(_rotation_kernel)


def rotate_rows(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, cpu_offsets: Optional[torch.Tensor],
                rope_theta: float, positions: Optional[torch.Tensor], rotary_dim: int, interleaved: bool,
                inverse: bool, in_place: bool, *,
                sched: Optional[Schedule] = None, pair_chunk: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (``[T, heads, D]``, the same T and D) rotated by their rows' angles, the
    transpose rotation with ``inverse``: into new contiguous tensors, or in place (then only the
    first ``rotary_dim`` channels are written). ``sched``: the ``ROWS``-row chunks of ``offsets``
    where the caller has them (``row_chunks``). ``pair_chunk`` (split halves, into copies): the copies' first
    ``rotary_dim`` channels in that paired-chunk order (``reference.paired_chunks``), the rest after them."""
    total, _, head_dim = a.shape
    if pair_chunk and (in_place or interleaved or rotary_dim % (2 * pair_chunk)):
        raise ValueError("pair_chunk: copies of split halves, their rotary channels in whole pairs of chunks")
    ya, yb = (a, b) if in_place else (empty_contiguous(a), empty_contiguous(b))
    if total == 0:
        return ya, yb
    sched = sched if sched is not None else row_chunks(offsets, total, cpu_offsets)
    if sched.programs == 0:
        return ya, yb
    meta = dict(
        HEAD_DIM=head_dim, BLOCK_M=ROWS, BLOCK_R=tile_extent(rotary_dim // 2),
        BLOCK_P=tile_extent(max(head_dim - rotary_dim, 1)), ROT_DIM=rotary_dim, INTERLEAVED=interleaved,
        HAS_POS=positions is not None, INVERSE=inverse, COPY_PASS=not in_place, FAST_TRIG=a.is_cuda,
        INT64=needs_int64(a, b, ya, yb), INLINE_SEQS=sched.inline_seqs, PAIR_CHUNK=pair_chunk,
        num_warps=8 if head_dim > 128 else 4,
        num_stages=1,
    )
    args = (a, ya, b, yb, sched.table, positions if positions is not None else sched.table, sched.programs,
            sched.num_seqs, ROWS, math.log2(rope_theta), a.shape[1], b.shape[1],
            *a.stride(), *ya.stride(), *b.stride(), *yb.stride())
    launch_rotation((sched.programs,), args, meta, a)
    return ya, yb


def rotated_backward(backward, q: torch.Tensor, k: torch.Tensor, offsets: torch.Tensor,
                     cpu_offsets: Optional[torch.Tensor], rope_theta: float, positions: Optional[torch.Tensor],
                     rotary_dim: int, interleaved: bool, unrotating_backward=None, pair_chunk: int = 0,
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of a rotary call from ``backward(q_rotated, k_rotated)``, the backward of the
    call without rotary on rotated copies of q and k (freed before the back rotation); dq and dk
    rotated back in place. ``unrotating_backward(q_rotated, k_rotated)``, tried first where given:
    ``(dq, dk, dv)`` already rotated back (the Gluon flash kernel with dQ stored,
    ``sm90.flash_bwd.unrotates``; no second pass), or None where it does not take the copies. Both
    passes share one schedule of row chunks. ``pair_chunk``: the copies' channels in that paired-chunk order
    (:func:`rotate_rows`; what ``unrotating_backward`` takes), put back in order before the second pass."""
    sched = row_chunks(offsets, q.shape[0], cpu_offsets)
    rotate = (offsets, cpu_offsets, rope_theta, positions, rotary_dim, interleaved)
    q_rotated, k_rotated = rotate_rows(q, k, *rotate, False, False, sched=sched, pair_chunk=pair_chunk)
    if unrotating_backward is not None:
        grads = unrotating_backward(q_rotated, k_rotated)
        if grads is not None:
            return grads
    dq, dk, dv = backward(q_rotated, k_rotated)
    del q_rotated, k_rotated
    return unrotated_gradients(dq, dk, dv, *rotate, pair_chunk, sched=sched)


def unrotated_gradients(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, offsets: torch.Tensor,
                        cpu_offsets: Optional[torch.Tensor], rope_theta: float, positions: Optional[torch.Tensor],
                        rotary_dim: int, interleaved: bool, pair_chunk: int, *,
                        sched: Optional[Schedule] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v from those of their rotated copies (in the paired-chunk order where
    ``pair_chunk``): dq and dk put back in order, then rotated back in place by the transpose rotation."""
    dq, dk = unpaired_chunks(dq, pair_chunk, rotary_dim), unpaired_chunks(dk, pair_chunk, rotary_dim)
    rotate_rows(dq, dk, offsets, cpu_offsets, rope_theta, positions, rotary_dim, interleaved, True, True, sched=sched)
    return dq, dk, dv


def row_chunks(offsets: torch.Tensor, total: int, cpu_offsets: Optional[torch.Tensor]) -> Schedule:
    """The rotation pass's schedule: chunks of ``ROWS`` rows of one sequence."""
    return Schedule(offsets, total, ROWS, cpu_offsets)
