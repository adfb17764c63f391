"""Block-attention forward for blocks that fit one tile (``block_size <= 128``).

Per program: one block of one kv head, and the ``GROUPS`` query heads that share it (GQA).
Each query head does ``S = QK^T`` once, an exact softmax over the whole block (no running
max, no correction factors) and ``O = PV``; only ``O`` is written, no logsumexp. Rotary is
applied to the q and k tiles right after loading (see ``common.rotary``). Rows past the block
are masked, so no other block's data is used.

These are the ``simple`` variant's kernels; the launch runs the variant ``block.variants``
chooses (on sm_90 the Gluon kernels of ``sm90.block`` for the calls they admit), all with the
same arguments.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from blockattn_layers.runtime.caches import HostCache

from ..common.launch import Launcher
from ..common.meta import LOG2E, empty_contiguous, input_precision, needs_int64
from ..common.rotary import block_sin_cos, load_rotated_pair, rotate_pair, tile_sin_cos
from ..common.schedule import Schedule, tile_of_program, tile_rows
from ..common.tiles import (block_positions, block_probs, block_probs_lse, finite_flag, head_rows, load_cols, load_pairs,
                            pair_cols, pass_cols, row_ptrs, same_slot, store_cols)
from . import self_check
from .bwd import PreparedBackward, prepare_backward
from .plan import block_grid, block_plan, blocks_per_program, grid_heads
from .variants import SIMPLE, call_facts, choose, forced_name

# Rotary at D <= 64: one program per block loops over the kv heads, so the angles are computed
# once per block (H200, D64/H4: forward 1.46 -> 1.27 ms). There the loop fits 128 registers
# (ptxas: 137 unbounded, no spills at 128; about 250 at D=128), launched with ``maxnreg=128``
# (``block.plan.max_registers``): 4 programs of 4 warps per SM. ``block.plan.head_loop`` decides it for
# the launch (the kernel's ``HEAD_LOOP``, and a grid of one kv head).


@triton.jit
def _fwd_head(
    Q, K, V, O, Lse, Pos, start, first_row, rows, row_ok, offs_m, prow, hk, sin, cos, qk_scale, log2_theta,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, HEAD_LOOP: tl.constexpr, SLOT: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """Kv head ``hk`` of a block and its query heads (``STORE_LSE``: and each query row's
    logsumexp, into ``Lse [H, T]``). ``HEAD_LOOP`` (called for each kv head in
    turn): the rotary ``sin``, ``cos`` are given, and the head offsets join the 32-bit row offsets
    (hoisted out of the loop, the usual ``ptr + head + row`` keeps 64-bit row offsets live)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    dtype = Q.dtype.element_ty
    v_ptr, v_rows, v_stride = head_rows(V, rows, stride_vt, stride_vh, hk, INT64, HEAD_LOOP)
    v = load_cols(v_ptr, v_rows, row_ok, offs_d, d_ok, v_stride, stride_vd, INT64)
    # (A packed tile's q and k cannot carry a NaN across blocks: ``same_slot`` replaces the scores
    # between blocks. Its v can, through P V.)
    finite = finite_flag(v, SLOT)
    if ROT_DIM > 0:
        offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
        if not HEAD_LOOP:
            sin, cos = tile_sin_cos(Pos, start, first_row, offs_m, rows, prow, row_ok, offs_r, log2_theta, ROT_DIM,
                                    HAS_POS, FAST_TRIG, False, SLOT)
        k_ptr, k_rows, k_stride = head_rows(K, rows, stride_kt, stride_kh, hk, INT64, HEAD_LOOP)
        ka, kb = load_rotated_pair(k_ptr, k_rows, row_ok, cols_a, cols_b, r_ok, sin, cos, k_stride, stride_kd, BLOCK_R,
                                   ROT_DIM, INTERLEAVED, INT64)
    if ROT_DIM < HEAD_DIM:
        cols_p, p_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
        k_ptr, k_rows, k_stride = head_rows(K, rows, stride_kt, stride_kh, hk, INT64, HEAD_LOOP)
        kp = load_cols(k_ptr, k_rows, row_ok, cols_p, p_ok, k_stride, stride_kd, INT64)
    for g in range(GROUPS):
        q_ptr, q_rows, q_stride = head_rows(Q, rows, stride_qt, stride_qh, hk * GROUPS + g, INT64, HEAD_LOOP)
        s = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        if ROT_DIM > 0:
            # (Not load_rotated_pair: casting before the dots changes the sm_90 code, untimed.)
            qa, qb = load_pairs(q_ptr, q_rows, row_ok, cols_a, cols_b, r_ok, q_stride, stride_qd, BLOCK_R, ROT_DIM,
                                INTERLEAVED, INT64)
            qa, qb = rotate_pair(qa.to(tl.float32), qb.to(tl.float32), sin, cos, False)
            s = tl.dot(qa.to(dtype), tl.trans(ka), s, input_precision=PRECISION)
            s = tl.dot(qb.to(dtype), tl.trans(kb), s, input_precision=PRECISION)
        if ROT_DIM < HEAD_DIM:
            qp = load_cols(q_ptr, q_rows, row_ok, cols_p, p_ok, q_stride, stride_qd, INT64)
            s = tl.dot(qp, tl.trans(kp), s, input_precision=PRECISION)
        # With rotary, rows normalized by a reciprocal (H200: D128 forward 1.33 -> 1.32 ms).
        if STORE_LSE:
            tl.static_assert(not HEAD_LOOP, "the logsumexp is stored by one program per kv head")
            p, lse = block_probs_lse(same_slot(s, offs_m, SLOT), offs_m, row_ok, qk_scale, IS_CAUSAL, ROT_DIM > 0)
            tl.store(row_ptrs(Lse, hk * GROUPS + g, stride_lh, rows, INT64), lse, mask=row_ok)
        else:
            p = block_probs(same_slot(s, offs_m, SLOT), offs_m, row_ok, qk_scale, IS_CAUSAL, ROT_DIM > 0)
        o = tl.dot(p.to(dtype), v, input_precision=PRECISION)
        o_ptr, o_rows, o_stride = head_rows(O, rows, stride_ot, stride_oh, hk * GROUPS + g, INT64, HEAD_LOOP)
        store_cols(o_ptr, o, o_rows, row_ok, offs_d, d_ok, o_stride, stride_od, INT64)
    return finite


@triton.jit
def _fwd_block(
    Q, K, V, O, Lse, Pos, start, first_row, rows, row_ok, offs_m, prow, hk, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, HEAD_LOOP: tl.constexpr, SLOT: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """The tile's rows ``rows`` (``row_ok``: which are real; a tile of blocks:
    ``common.schedule.packed_rows``) of kv head ``hk`` and its query heads; ``HEAD_LOOP``: of
    every kv head in turn (``hk`` unused), with the rotary angles computed once. Every load and
    store is masked by row. Returns ``finite_flag`` of the tile's v (1 with one block per tile)."""
    if HEAD_LOOP:
        tl.static_assert(SLOT == 0, "the kv-head loop takes one block per tile")
        pos = block_positions(Pos, start, first_row, offs_m, row_ok, HAS_POS)
        sin, cos = block_sin_cos(pos, first_row, offs_m, tl.arange(0, BLOCK_R), log2_theta, ROT_DIM, HAS_POS,
                                 FAST_TRIG, False)
        # One stage: a pipelined head loop turns the loads into cp.async copies (slower).
        for h in tl.range(0, kv_heads, num_stages=1):
            _fwd_head(Q, K, V, O, Lse, Pos, start, first_row, rows, row_ok, offs_m, prow, h, sin, cos,
                      qk_scale, log2_theta, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                      stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
                      HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
                      HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION, True, SLOT, STORE_LSE)
        return 1
    else:
        unused = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        return _fwd_head(Q, K, V, O, Lse, Pos, start, first_row, rows, row_ok, offs_m, prow, hk, unused, unused,
                  qk_scale, log2_theta, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                  stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
                  HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
                  HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION, False, SLOT, STORE_LSE)


@triton.jit
def _fwd_tile(
    Q, K, V, O, Lse, Sched, Pos, pid, hk, slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, INLINE_SEQS: tl.constexpr, HEAD_LOOP: tl.constexpr, SLOT: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """One tile (table slot ``pid``, or with ``SLOT`` the ``BLOCK_M // SLOT`` slots from ``pid *
    BLOCK_M // SLOT``) of kv head ``hk`` and its query heads (see ``_fwd_block``); empty tiles are
    skipped."""
    start, n, first_row, packed = tile_of_program(Sched, slots, num_seqs, block_size, pid, BLOCK_M, INLINE_SEQS, SLOT)
    if n > 0:
        offs_m, rows, row_ok, prow = tile_rows(start, n, packed, BLOCK_M, SLOT)
        finite = _fwd_block(Q, K, V, O, Lse, Pos, start, first_row, rows, row_ok, offs_m, prow, hk, qk_scale,
                            log2_theta, kv_heads, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                            stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
                            HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
                            HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION, HEAD_LOOP, SLOT, STORE_LSE)
        if SLOT > 0:
            if finite == 0:
                # A non-finite v reached the other blocks of the tile: each block again alone, its
                # rows the only ones loaded (the others read as zeros) and stored.
                tl.debug_barrier()
                for b in range(0, BLOCK_M // SLOT):
                    _fwd_block(Q, K, V, O, Lse, Pos, start, first_row, rows, row_ok & (offs_m // SLOT == b), offs_m,
                               prow, hk, qk_scale, log2_theta, kv_heads, stride_qt, stride_qh, stride_qd,
                               stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                               stride_ot, stride_oh, stride_od, stride_lh,
                               HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
                               HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION, HEAD_LOOP, SLOT, STORE_LSE)


@triton.jit(do_not_specialize=["slots", "num_seqs", "block_size", "qk_scale", "log2_theta", "kv_heads"])
def _block_fwd_kernel(
    Q, K, V, O, Sched, Pos,
    slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, INLINE_SEQS: tl.constexpr, HEAD_LOOP: tl.constexpr, SLOT: tl.constexpr,
):
    _fwd_tile(Q, K, V, O, O, Sched, Pos, tl.program_id(0), tl.program_id(1), slots, num_seqs, block_size,
              qk_scale, log2_theta, kv_heads, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
              stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, 0,
              HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
              HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION, INLINE_SEQS, HEAD_LOOP, SLOT, False)


@triton.jit(do_not_specialize=["slots", "num_seqs", "block_size", "qk_scale", "log2_theta", "kv_heads", "stride_lh"])
def _block_fwd_lse_kernel(
    Q, K, V, O, Lse, Sched, Pos,
    slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, INLINE_SEQS: tl.constexpr, HEAD_LOOP: tl.constexpr, SLOT: tl.constexpr,
):
    """``_block_fwd_kernel`` that also stores each query row's logsumexp, ``Lse [H, T]``."""
    _fwd_tile(Q, K, V, O, Lse, Sched, Pos, tl.program_id(0), tl.program_id(1), slots, num_seqs, block_size,
              qk_scale, log2_theta, kv_heads, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
              stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
              HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
              HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION, INLINE_SEQS, HEAD_LOOP, SLOT, True)


def block_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, block_size: int,
    scale: float, causal: bool, rope_theta: Optional[float], positions: Optional[torch.Tensor],
    rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[torch.Tensor],
) -> torch.Tensor:
    """Launch the forward kernel; returns ``o [T, H, D]`` (contiguous, dtype of ``q``)."""
    return _forward(q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
                    rotary_interleaved, cpu_offsets, False)[0]


def block_attention_fwd_prepared(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, block_size: int,
    scale: float, causal: bool, rope_theta: Optional[float], positions: Optional[torch.Tensor],
    rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, Optional[PreparedBackward]]:
    """:func:`block_attention_fwd`, and the launch of its backward prepared on this thread
    (:class:`~blockattn_layers.kernels.block.bwd.PreparedBackward`, or None)."""
    return _forward(q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
                    rotary_interleaved, cpu_offsets, True)


def _launch_facts(q, k, v, o, offsets, block_size, rope_theta, positions, rotary_dim, cpu_offsets) -> Optional[tuple]:
    """``(schedule, rotary dim or 0, int64, positions or the block table, log2(theta) or 0)`` of a
    forward launch, or None where there is nothing to launch (no rows, or no blocks)."""
    if q.shape[0] == 0:
        return None
    sched = Schedule(offsets, q.shape[0], block_size, cpu_offsets)
    if sched.programs == 0:
        return None
    rot = rotary_dim if rope_theta is not None else 0
    pos = positions if positions is not None else sched.table
    log2_theta = math.log2(rope_theta) if rope_theta is not None else 0.0
    return sched, rot, needs_int64(q, k, v, o), pos, log2_theta


def block_attention_fwd_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, block_size: int,
    scale: float, causal: bool, rope_theta: Optional[float], positions: Optional[torch.Tensor],
    rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward and each query row's logsumexp: ``(o [T, H, D], lse [H, T] float32)``, the
    natural-log logsumexp of the scaled scores that the flash kernels' backward reads. Runs the
    variant the choice takes among those with such a kernel (``Variant.lse_forward``); one that
    would be self-checked at first use leaves the call to the simple kernels."""
    o = empty_contiguous(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    call = _launch_facts(q, k, v, o, offsets, block_size, rope_theta, positions, rotary_dim, cpu_offsets)
    if call is None:
        return o, lse
    sched, rot, int64, pos, log2_theta = call
    has_pos = positions is not None
    facts = call_facts(q, k, block_size, rot, rotary_interleaved, int64, has_pos, stores_lse=True)
    variant = choose(facts, q, (q, k, v))
    flags = (block_size, rot, rotary_interleaved, has_pos, causal, sched.inline_seqs, int64)
    launcher, meta, key, grid = _plan(variant, q, k, sched.programs, *flags, lse=True)
    if self_check.pending(variant, facts.major, key):
        launcher, meta, key, grid = _plan(SIMPLE, q, k, sched.programs, *flags, lse=True)
    args = (q, k, v, o, lse, sched.table, pos, sched.programs, sched.num_seqs, block_size, scale * LOG2E, log2_theta,
            k.shape[1], *q.stride(), *k.stride(), *v.stride(), *o.stride(), lse.stride(0))
    launcher(grid, args, meta, q, key)
    return o, lse


class _Remembered:
    """A forward launch remembered by its signature (``_signature``): the compiled kernel's entry
    (``Launcher.compiled``), the stride arguments, the grid's kv-head extent, its launcher, the
    launch key, from which the backward is prepared (``prepare_backward``), and ``pack``: the
    blocks per program (a variant that packs blocks into tiles; else 1)."""

    __slots__ = ("entry", "strides", "grid_heads", "launcher", "key", "pack")

    def __init__(self, entry, strides, grid_heads, launcher, key, pack):
        self.entry, self.strides, self.grid_heads, self.launcher, self.key = entry, strides, grid_heads, launcher, key
        self.pack = pack


# signature -> _Remembered (a handful per model).
_REMEMBERED = HostCache("block_forwards")


def _signature(q, k, v, pos, sched: Schedule, block_size, rot, interleaved, has_pos, causal, aligned) -> tuple:
    """Everything a forward launch's kernel and its non-address arguments depend on, besides the
    sizes the kernels take at run time (T, B, the grid): what the variant choice, ``block_plan``
    and the launcher's key are computed from, so equal signatures launch the same compiled kernel
    with the same stride arguments (o's follow from q's shape), the forced variant included."""
    return (q.device, q.dtype, k.dtype, v.dtype, pos.dtype, sched.table.dtype, q.shape[1:], k.shape[1:],
            q.stride(), k.stride(), v.stride(), block_size, rot, interleaved, has_pos, causal, sched.inline_seqs,
            input_precision(q.dtype), forced_name(), aligned)


def _forward(q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
             rotary_interleaved, cpu_offsets, prepare: bool) -> tuple:
    """The forward launch. Calls of a signature seen before (``_signature``, 32-bit offsets, a
    direct launch on the current device) skip the variant choice, the launch plan and the
    launcher's key, host time that a small batch pays on every call (H200 host, small shape,
    forward with grad, median per call: 63-80 -> 34-55 us, FA2 varlen's 29-49 in the same
    processes)."""
    kv_heads = k.shape[1]
    o = empty_contiguous(q)
    call = _launch_facts(q, k, v, o, offsets, block_size, rope_theta, positions, rotary_dim, cpu_offsets)
    if call is None:
        return o, None
    sched, rot, int64, pos, log2_theta = call
    qk_scale = scale * LOG2E
    sig = seen = None
    if q.is_cuda and not int64:
        ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), sched.table.data_ptr(), pos.data_ptr()]
        sig = _signature(q, k, v, pos, sched, block_size, rot, rotary_interleaved, positions is not None, causal,
                         tuple([p % 16 == 0 for p in ptrs]))
        seen = _REMEMBERED.get(sig)
        device = q.get_device()
        if seen is not None and not seen.launcher.goes_direct(device):
            seen = None
    if seen is None:
        launched = _launch_ordinary(q, k, v, o, sched, pos, block_size, qk_scale, log2_theta, rot, rotary_interleaved,
                                    positions is not None, causal, int64, sig)
    else:
        launch, head, consts = seen.entry
        programs = sched.programs if seen.pack == 1 else -(-sched.programs // seen.pack)
        launch(programs, seen.grid_heads, 1, seen.launcher.stream(device), *head, *ptrs, sched.programs,
               sched.num_seqs, block_size, qk_scale, log2_theta, kv_heads, *seen.strides, *consts)
        launched = seen.key
    if not prepare:
        return o, None
    return o, prepare_backward(q, k, v, sched, launched, block_size, scale, causal, rope_theta, positions, rotary_dim,
                            rotary_interleaved)


def _launch_ordinary(q, k, v, o, sched, pos, block_size, qk_scale, log2_theta, rot, interleaved, has_pos, causal,
                    int64, sig) -> Optional[tuple]:
    """The forward launch through the variant choice, the launch plan and the launcher; remembers
    it under ``sig`` (if given) where it went direct. Returns the launcher's key (or None). A
    variant with no hardware run on this GPU generation is checked against the simple kernels at
    the first launch of each plan (``self_check``), and not remembered before it has agreed."""
    facts = call_facts(q, k, block_size, rot, interleaved, int64, has_pos)
    variant = choose(facts, q, (q, k, v))
    flags = (block_size, rot, interleaved, has_pos, causal, sched.inline_seqs, int64)
    launcher, meta, key, grid = _plan(variant, q, k, sched.programs, *flags)
    strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
    args = (q, k, v, o, sched.table, pos, sched.programs, sched.num_seqs, block_size, qk_scale, log2_theta, k.shape[1],
            *strides)
    if self_check.pending(variant, facts.major, key):
        if self_check.capturing():  # no host sync while capturing: the verified kernels run
            launcher, meta, key, grid = _plan(SIMPLE, q, k, sched.programs, *flags)
        else:
            launcher(grid, args, meta, q, key)
            want = empty_contiguous(o)
            simple, simple_meta, simple_key, simple_grid = _plan(SIMPLE, q, k, sched.programs, *flags)
            simple(simple_grid, (*args[:3], want, *args[4:]), simple_meta, q, simple_key)
            described = self_check.describe(q, k, block_size, rot, interleaved, has_pos, causal, False)
            if not self_check.agrees(variant, key, described, (o,), (want,), ("out",)):
                o.copy_(want)
            return None
    launched = launcher(grid, args, meta, q, key)
    if sig is not None and launched is not None and not variant.persistent:
        _REMEMBERED.put(sig, _Remembered(launcher.compiled(launched), strides, grid[1], launcher, launched,
                                         blocks_per_program(meta.get("SLOT", 0))))
    return launched


def _plan(variant, q, k, programs, block_size, rot, interleaved, has_pos, causal, inline_seqs, int64,
          lse: bool = False) -> tuple:
    """``(launcher, meta, key, grid)`` of ``variant``'s forward launch (``lse``: its forward that
    also stores the logsumexp)."""
    launcher = variant.lse_forward() if lse else variant.kernels()[0]
    meta, loop, key = block_plan(q, k, block_size, rot, interleaved, has_pos, causal, False, inline_seqs, int64,
                                 variant, launcher, lse)
    grid = block_grid(programs, grid_heads(meta, loop, k.shape[1]), q.device, False, variant, meta["BLOCK_D"],
                      meta.get("SLOT", 0))
    return launcher, meta, key, grid


launch_fwd = Launcher(_block_fwd_kernel)
launch_fwd_lse = Launcher(_block_fwd_lse_kernel)
