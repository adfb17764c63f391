"""Block-attention backward for blocks that fit one tile (``block_size <= 128``).

Per program: one block of one kv head and its ``GROUPS`` query heads. ``S`` and ``P`` are
recomputed from q and k (nothing but q, k, v is saved by the forward); ``dK`` and ``dV``
are summed over the query heads in registers and written once, ``dQ`` once per head:
no atomics, so gradients are bitwise deterministic. ``Di = rowsum(dO * O)`` is computed
inline as ``rowsum(P * dP)`` (equal, since ``dP = dO V^T`` and ``O = P V``): no
preprocessing kernel and no extra ``PV`` product. Rotary gradients are rotated back by
the transpose rotation before dq and dk are stored. These are the ``simple`` variant's
kernels; the launch runs the variant ``block.variants`` chooses, as in ``block.fwd``.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from blockattn_layers.runtime.caches import HostCache

from ..common.launch import Launcher, scratch_allocator
from ..common.head_sums import sum_head_groups
from ..common.meta import LOG2E, empty_grads, needs_int64
from ..common.rotary import load_rotated_pair, rotate_pair, tile_sin_cos
from ..common.schedule import Schedule, tile_of_program, tile_rows
from ..common.split import load_split, store_split
from ..common.tiles import block_probs, finite_flag, load_cols, pair_cols, pass_cols, same_slot, store_cols, store_pairs
from . import self_check, variants
from .plan import block_grid, block_plan, float32_tile_fits, group_sums_in_launch
from .rotation import rotated_backward
from .variants import SIMPLE, Variant, call_facts, choose


@triton.jit
def _bwd_block(
    Q, K, V, DO, DQ, DK, DV, Pos, start, first_row, rows, row_ok, offs_m, prow, hk, scale, qk_scale, log2_theta,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, SLOT: tl.constexpr,
):
    """Gradients of the tile's rows ``rows`` (``row_ok``: which are real; one block at ``start``,
    its first row ``first_row`` in its sequence, or with ``SLOT`` a tile of blocks:
    ``common.schedule.packed_rows``) of kv head ``hk`` and its query heads. Every load and store
    is masked by row. Returns ``finite_flag`` of the tile's q, k, v and dO (all of them reach the
    other blocks of a packed tile through the products; 1 with one block per tile)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    dtype = Q.dtype.element_ty
    k_ptr = K + hk * stride_kh
    v = load_cols(V + hk * stride_vh, rows, row_ok, offs_d, d_ok, stride_vt, stride_vd, INT64)
    finite = finite_flag(v, SLOT)
    dv = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if ROT_DIM > 0:
        offs_r, cols_a, cols_b, r_ok = pair_cols(BLOCK_R, ROT_DIM, INTERLEAVED)
        # Angles reduced per column (H200: rotary backward D128 2.86 -> 2.76 ms; the forward
        # measured slower with it, 1.33 -> 1.41 ms, and keeps the per-element reduction).
        sin, cos = tile_sin_cos(Pos, start, first_row, offs_m, rows, prow, row_ok, offs_r, log2_theta, ROT_DIM,
                                HAS_POS, FAST_TRIG, True, SLOT)
    else:
        sin = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        cos = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # (Zero tiles for the parts a call does not have: ``common.split``.)
    ka, kb, kp = load_split(k_ptr, rows, row_ok, sin, cos, stride_kt, stride_kd,
                            BLOCK_M, HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
    if ROT_DIM > 0:
        finite = finite & finite_flag(ka, SLOT) & finite_flag(kb, SLOT)
    if ROT_DIM < HEAD_DIM:
        finite = finite & finite_flag(kp, SLOT)
        cols_p, p_ok = pass_cols(BLOCK_P, ROT_DIM, HEAD_DIM)
    dka = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    dkp = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    # The loop body stays written out: it goes column tile by column tile (q's pair tiles and their
    # scores, then the pass-through tile's; dQ's pair tiles rotated back and stored and dK's pair
    # terms, then the pass-through tile's), where ``common.split``'s helpers go gradient by gradient
    # over all the tiles. With both kinds of tile (partial rotary) the helpers' order compiles
    # differently (ptxas -v for sm_90, bf16 blocks of 128 at D128, rotary 64, 2 query heads per kv
    # head: 1372 -> 1524 bytes spilled).
    for g in range(GROUPS):
        h = hk * GROUPS + g
        q_ptr = Q + h * stride_qh
        dq_ptr = DQ + h * stride_dqh
        do = load_cols(DO + h * stride_doh, rows, row_ok, offs_d, d_ok, stride_dot, stride_dod, INT64)
        finite = finite & finite_flag(do, SLOT)
        s = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        if ROT_DIM > 0:
            qa, qb = load_rotated_pair(q_ptr, rows, row_ok, cols_a, cols_b, r_ok, sin, cos, stride_qt, stride_qd,
                                       BLOCK_R, ROT_DIM, INTERLEAVED, INT64)
            finite = finite & finite_flag(qa, SLOT) & finite_flag(qb, SLOT)
            s = tl.dot(qa, tl.trans(ka), s, input_precision=PRECISION)
            s = tl.dot(qb, tl.trans(kb), s, input_precision=PRECISION)
        if ROT_DIM < HEAD_DIM:
            qp = load_cols(q_ptr, rows, row_ok, cols_p, p_ok, stride_qt, stride_qd, INT64)
            finite = finite & finite_flag(qp, SLOT)
            s = tl.dot(qp, tl.trans(kp), s, input_precision=PRECISION)
        p = block_probs(same_slot(s, offs_m, SLOT), offs_m, row_ok, qk_scale, IS_CAUSAL, False)
        if SLOT > 0:
            # Rows outside the tile's blocks (empty slots; in a block-by-block pass the other
            # blocks' rows) can have no valid key, causal: NaN probabilities, which P^T dO would
            # multiply by their zero dO rows into dV. Zeroed by a select.
            p = tl.where(row_ok[:, None], p, 0.0)
        dv = tl.dot(tl.trans(p.to(dtype)), do, dv, input_precision=PRECISION)
        if GROUPS == 1:
            # Stored now, not after the other products: its accumulator dies before dQ's and dK's
            # (sm_90, D128: 198 -> 180 registers; with the 168 cap, 3 programs per SM instead of 2).
            store_cols(DV + hk * stride_dvh, dv, rows, row_ok, offs_d, d_ok, stride_dvt, stride_dvd, INT64)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = (p * (dp - tl.sum(p * dp, 1)[:, None])).to(dtype)
        ds_t = tl.trans(ds)
        if ROT_DIM > 0:
            dqa = tl.dot(ds, ka, input_precision=PRECISION) * scale
            dqb = tl.dot(ds, kb, input_precision=PRECISION) * scale
            dqa, dqb = rotate_pair(dqa, dqb, sin, cos, True)
            store_pairs(dq_ptr, dqa, dqb, rows, row_ok, cols_a, cols_b, r_ok, stride_dqt, stride_dqd, BLOCK_R, ROT_DIM,
                        INTERLEAVED, INT64)
            dka = tl.dot(ds_t, qa, dka, input_precision=PRECISION)
            dkb = tl.dot(ds_t, qb, dkb, input_precision=PRECISION)
        if ROT_DIM < HEAD_DIM:
            dqp = tl.dot(ds, kp, input_precision=PRECISION) * scale
            store_cols(dq_ptr, dqp, rows, row_ok, cols_p, p_ok, stride_dqt, stride_dqd, INT64)
            dkp = tl.dot(ds_t, qp, dkp, input_precision=PRECISION)
    store_split(DK + hk * stride_dkh, dka, dkb, dkp, scale, sin, cos, rows, row_ok, stride_dkt, stride_dkd,
                HEAD_DIM, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED, INT64)
    if GROUPS > 1:
        store_cols(DV + hk * stride_dvh, dv, rows, row_ok, offs_d, d_ok, stride_dvt, stride_dvd, INT64)
    return finite


@triton.jit
def _bwd_tile(
    Q, K, V, DO, DQ, DK, DV, Sched, Pos, pid, hk, slots, num_seqs, block_size, scale, qk_scale,
    log2_theta,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, INLINE_SEQS: tl.constexpr, SLOT: tl.constexpr,
):
    """Gradients of one tile (table slot ``pid``, or with ``SLOT`` the ``BLOCK_M // SLOT`` slots
    from ``pid * BLOCK_M // SLOT``) of kv head ``hk`` and its query heads; empty tiles are skipped."""
    start, n, first_row, packed = tile_of_program(Sched, slots, num_seqs, block_size, pid, BLOCK_M, INLINE_SEQS, SLOT)
    if n > 0:
        offs_m, rows, row_ok, prow = tile_rows(start, n, packed, BLOCK_M, SLOT)
        finite = _bwd_block(Q, K, V, DO, DQ, DK, DV, Pos, start, first_row, rows, row_ok, offs_m, prow, hk, scale,
                            qk_scale, log2_theta, stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                            stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
                            stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
                            stride_dvt, stride_dvh, stride_dvd,
                            HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
                            HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION, SLOT)
        if SLOT > 0:
            if finite == 0:
                # A non-finite input reached the other blocks of the tile: each block again alone,
                # its rows the only ones loaded (the others read as zeros) and stored.
                tl.debug_barrier()
                for b in range(0, BLOCK_M // SLOT):
                    _bwd_block(Q, K, V, DO, DQ, DK, DV, Pos, start, first_row, rows, row_ok & (offs_m // SLOT == b),
                               offs_m, prow, hk, scale, qk_scale, log2_theta,
                               stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                               stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
                               stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
                               stride_dvt, stride_dvh, stride_dvd,
                               HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
                               HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION, SLOT)


@triton.jit(do_not_specialize=["slots", "num_seqs", "block_size", "scale", "qk_scale", "log2_theta", "kv_heads"])
def _block_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, Sched, Pos,
    slots, num_seqs, block_size, scale, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    HEAD_DIM: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, FAST_TRIG: tl.constexpr, INT64: tl.constexpr,
    PRECISION: tl.constexpr, INLINE_SEQS: tl.constexpr, SLOT: tl.constexpr,
):
    _bwd_tile(Q, K, V, DO, DQ, DK, DV, Sched, Pos, tl.program_id(0), tl.program_id(1), slots,
              num_seqs, block_size, scale, qk_scale, log2_theta,
              stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
              stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
              stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
              stride_dvt, stride_dvh, stride_dvd,
              HEAD_DIM, GROUPS, BLOCK_M, BLOCK_D, BLOCK_R, BLOCK_P, ROT_DIM, INTERLEAVED,
              HAS_POS, IS_CAUSAL, FAST_TRIG, INT64, PRECISION, INLINE_SEQS, SLOT)


def block_attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
    block_size: int, scale: float, causal: bool, rope_theta: Optional[float],
    positions: Optional[torch.Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[torch.Tensor], variant: Optional[Variant] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns ``(dq, dk, dv)``, contiguous, dtypes of the inputs.
    ``variant``: the choice for this call where the caller made it (``backward_variant``)."""
    total, num_heads, _ = q.shape
    kv_heads = k.shape[1]
    rot = rotary_dim if rope_theta is not None else 0
    int64 = grads_need_int64(do, q, k, v)
    facts = call_facts(q, k, block_size, rot, rotary_interleaved, int64, positions is not None, backward=True)
    if variant is None:
        variant = choose(facts, q, (q, k, v, do))
    if variant.rotation_pass:
        return rotated_backward(
            lambda qr, kr: block_attention_bwd(do, qr, kr, v, offsets, block_size, scale, causal, None, None, 0, False,
                                               cpu_offsets),
            q, k, offsets, cpu_offsets, rope_theta, positions, rotary_dim, rotary_interleaved)
    dq, dk, dv = empty_grads(q, k, v)
    if total == 0:
        return dq, dk, dv
    sched = Schedule(offsets, total, block_size, cpu_offsets)
    if sched.programs == 0:
        return dq, dk, dv
    flags = (block_size, rot, rotary_interleaved, positions is not None, causal, sched.inline_seqs, int64)
    scalars = (scale, math.log2(rope_theta) if rope_theta is not None else 0.0)
    if splits_groups(variant, q, k):
        return _by_query_heads(variant, facts.major, sched, positions, flags, scalars, do, q, k, v, dq, dk, dv)
    return _launch_checked(variant, facts.major, sched, positions, flags, scalars, (q, k, v, do, dq, dk, dv))


def _by_query_heads(variant, major, sched, positions, flags, scalars, do, q, k, v, dq, dk, dv) -> tuple:
    """The backward of grouped query heads as one of a query head per kv head, kv head by kv head:
    its ``groups`` query heads against k and v repeated by a zero head stride (no copy), a block's
    programs adjacent in launch order where the kernel takes ``GROUP_PROGRAMS``, each query head's
    dK and dV into a ``[T, groups, D]`` buffer, then summed over the group: float32 sums of the
    rounded terms, one more rounding than a kernel summing in registers, in the launch where the
    variant's kernel does them (``plan.group_sums_in_launch``), else by ``common.head_sums`` after it.
    Buffers: two of q's size over the kv heads, kept from one kv head to the next, and the blocks'
    arrival counters of every kv head, zeroed once."""
    groups = q.shape[1] // k.shape[1]
    dk_parts, dv_parts = (torch.empty((q.shape[0], groups, x.shape[2]), dtype=x.dtype, device=x.device)
                          for x in (k, v))
    counts = torch.zeros((k.shape[1], sched.programs), dtype=torch.int32, device=q.device)
    for hk in range(k.shape[1]):
        heads = slice(hk * groups, (hk + 1) * groups)
        kh, vh = (x[:, hk:hk + 1].expand(-1, groups, -1) for x in (k, v))
        dq_heads = dq[:, heads]
        dq_h, _, _ = _launch_checked(variant, major, sched, positions, flags, scalars,
                                     (q[:, heads], kh, vh, do[:, heads], dq_heads, dk_parts, dv_parts),
                                     sums=(dk[:, hk], dv[:, hk], counts[hk]))
        if dq_h is not dq_heads:
            # A self-check disagreed: the simple kernels' result, and theirs for the other kv heads.
            dq_heads.copy_(dq_h)
            variant = SIMPLE
    return dq, dk, dv


def _launch_checked(variant, major, sched, positions, flags, scalars, tensors, sums=None) -> tuple:
    """Launch ``variant``'s backward over ``tensors`` (``q, k, v, do`` and the gradient buffers
    ``dq, dk, dv``) and return the gradients: those buffers, or where a self-check of the variant
    (``block.self_check``) disagreed, the simple kernels' in new ones. ``sums``: ``(dk_sum, dv_sum,
    counts)``, ``[T, D]`` each and zeroed ``[programs]`` int32, where dk and dv are ``[T, G, D]``
    partials of one query head each, to receive their sums over G (in the launch or after it)."""
    q, k, v, do, dq, dk, dv = tensors
    block_size, rot, interleaved, has_pos, causal = flags[:5]
    scale, log2_theta = scalars

    def args(grads):
        return (
            q, k, v, do, *grads, sched.table, positions if positions is not None else sched.table,
            sched.programs, sched.num_seqs, block_size, scale, scale * LOG2E, log2_theta, k.shape[1],
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *(stride for g in grads for stride in g.stride()),
        )

    launcher, meta, key, grid, tail, summed = _grouped_plan(variant, q, k, sched, flags, sums, dk, dv)
    if self_check.pending(variant, major, key) and self_check.capturing():
        variant = SIMPLE  # no host sync while capturing: the verified kernels run
        launcher, meta, key, grid, tail, summed = _grouped_plan(variant, q, k, sched, flags, sums, dk, dv)
    launcher(grid, args((dq, dk, dv)) + tail, meta, q, key)
    if self_check.pending(variant, major, key):
        want = empty_grads(q, k, v)
        simple, simple_meta, simple_key, simple_grid = _plan(SIMPLE, q, k, sched.programs, *flags)
        simple(simple_grid, args(want), simple_meta, q, simple_key)
        got, names = (dq, dk, dv), ("dq", "dk", "dv")
        if summed:  # the sums the launch made, against those of the simple kernels' partials
            want_sums = tuple(torch.empty_like(x) for x in sums[:2])
            sum_head_groups(want[1], want_sums[0], want[2], want_sums[1])
            got, want, names = got + tuple(sums[:2]), want + want_sums, names + ("dk sums", "dv sums")
        described = self_check.describe(q, k, block_size, rot, interleaved, has_pos, causal, True)
        if not self_check.agrees(variant, key, described, got, want, names):
            dq, dk, dv = want[:3]
            summed = False
    if sums is not None and not summed:
        sum_head_groups(dk, sums[0], dv, sums[1])
    return dq, dk, dv


def _grouped_plan(variant, q, k, sched, flags, sums, dk, dv) -> tuple:
    """``(launcher, meta, key, grid, tail, summed)``: ``_plan``'s, where ``sums`` are asked for (one
    query head per program) with the group's programs adjacent in launch order (``GROUP_PROGRAMS``,
    kernels that take it) and the sums in the launch where ``plan.group_sums_in_launch`` says
    (``summed``); ``tail``: the arguments past ``block.bwd``'s of a kernel that can sum
    (``Variant.sums_in_launch`` of the variant whose kernels launch: the blocks' arrival counters and
    the sums' tensors with their row strides, or unused placeholders)."""
    launcher, meta, key, grid = _plan(variant, q, k, sched.programs, *flags)
    owner = variants.VARIANTS[variant.kernels_of] if variant.kernels_of is not None else variant
    summed = sums is not None and group_sums_in_launch(owner, flags[1])
    if sums is not None and "GROUP_PROGRAMS" in meta and not meta.get("SLOT"):
        groups = dk.shape[1]
        meta = {**meta, "GROUP_PROGRAMS": groups, **({"GROUP_SUMS": summed} if "GROUP_SUMS" in meta else {})}
        key = key + ("group_programs", groups, summed)
    tail = ()
    if owner.sums_in_launch:
        tail = ((sums[2], sums[0], sums[1], sums[0].stride(0), sums[1].stride(0)) if summed
                else (sched.table, dk, dv, 0, 0))
    return launcher, meta, key, grid, tail, summed


def _plan(variant, q, k, programs, block_size, rot, interleaved, has_pos, causal, inline_seqs, int64) -> tuple:
    """``(launcher, meta, key, grid)`` of ``variant``'s backward launch (``Variant.kernels_of``'s)."""
    if variant.kernels_of is not None:
        variant = variants.VARIANTS[variant.kernels_of]
    launcher = variant.kernels()[1]
    meta, _, key = block_plan(q, k, block_size, rot, interleaved, has_pos, causal, True, inline_seqs, int64,
                              variant, launcher)
    return launcher, meta, key, block_grid(programs, k.shape[1], q.device, True, variant, meta["BLOCK_D"],
                                           meta.get("SLOT", 0))


launch_bwd = Launcher(_block_bwd_kernel)


def _contiguous_strides(shape) -> tuple:
    t, h, d = shape
    return (h * d, d, 1)


_NO_CONTEXT = contextlib.nullcontext()


class PreparedBackward:
    """The backward launch of one forward call, prepared by the forward.

    PyTorch's autograd engine runs the backward of CUDA tensors on its device thread. On the
    H200's host (small batch, wall clock) our forward and backward launches cost about 43 us each
    alone but 40 us more than that together, and the profiler put 127 us of self time on the
    backward's Python against 52 us on the forward's, much the same code. So the forward, on
    the caller's thread, finds the compiled kernel, the grid and every scalar argument of the
    backward; :meth:`launch` only allocates the gradients and launches (fwd+bwd 11-34 us
    faster, PERF_NOTES). It serves the common case: the saved q, k, v are the very tensors
    prepared for (no saved-tensor hooks replaced them) and dO is contiguous with 16-byte aligned
    rows; otherwise it returns None and the caller takes the ordinary path.

    It holds weak references to q, k, v (the strong ones are the autograd context's, which
    saved-tensor hooks may pack away) and the block table and positions whose addresses it
    passes.
    """

    __slots__ = ("refs", "ptrs", "keep", "entry", "launcher", "grid", "device", "tail", "do_strides")

    def __init__(self, q, k, v, keep, entry, launcher, grid, device, tail, do_strides):
        self.refs = (weakref.ref(q), weakref.ref(k), weakref.ref(v))
        self.ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        self.keep, self.entry, self.launcher, self.grid, self.device, self.tail, self.do_strides = (
            keep, entry, launcher, grid, device, tail, do_strides)

    def launch(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``(dq, dk, dv)``, or None where the preparation does not hold for these tensors."""
        rq, rk, rv = self.refs
        if rq() is not q or rk() is not k or rv() is not v or do.stride() != self.do_strides:
            return None
        if do.get_device() != self.device or not self.launcher.goes_direct(self.device):
            return None
        dq, dk, dv = empty_grads(q, k, v)
        grads = (do.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
        if (grads[0] | grads[1] | grads[2] | grads[3]) % 16:
            return None
        launch, head, consts = self.entry
        gx, gy = self.grid
        with scratch_allocator() if self.launcher.scratch else _NO_CONTEXT:
            launch(gx, gy, 1, self.launcher.stream(self.device), *head, *self.ptrs, *grads, *self.tail, *consts)
        return dq, dk, dv


# (forward launch key, forced variant) -> (compiled backward, its launcher, launch options, stride
# arguments, variant) of its backward; they fix them all (see ``prepare_backward``): a forced variant
# whose forward is auto's (keys, rotated) launches the same forward with another backward. Key None:
# the last (forward key, forced variant, template) prepared. A forward remembered by its signature
# passes the same key object on every call, found there by identity without hashing the key
# (``block.fwd._forward``).
_TEMPLATES = HostCache("block_backwards")
_NO_LAST = (None, None, None)
# The template of a backward that is not one launch (a rotation pass around another backward, or
# grouped query heads launched one kv head at a time: ``Variant.group_partials``).
_UNPREPARED = ()


def one_tile_backward_fits(block_size: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether a block kernel's backward fits one program: not for blocks over 64 rows with head
    dims over 128, whose 128 x 256 tiles of q, k, v, dO and P would take 288 KB of shared memory
    (the H200 has 227 KB per program; Triton's simple kernels ask for more), nor for float32 tiles
    over ``plan.FLOAT32_TILE_MAX`` elements."""
    return (block_size <= 64 or head_dim <= 128) and float32_tile_fits(block_size, head_dim, dtype)


def backward_variant(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, rot: int,
                     interleaved: bool, has_pos: bool) -> Variant:
    """The variant the choice takes for this backward."""
    facts = call_facts(q, k, block_size, rot, interleaved, grads_need_int64(do, q, k, v), has_pos, backward=True)
    return choose(facts, q, (q, k, v, do))


def grads_need_int64(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a backward's launches need 64-bit offsets: the inputs' spans, or the contiguous
    gradients' sizes (which an input of overlapping rows, such as an expanded one, does not bound)."""
    return needs_int64(q, k, v, do) or max(q.numel(), k.numel(), v.numel()) >= 2**31 - 1


def splits_groups(variant: Variant, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``variant``'s backward of this call runs grouped query heads one by one
    (``Variant.group_partials``): not one launch."""
    return variant.group_partials and q.shape[1] > k.shape[1]


def forced_without_wide_backward() -> bool:
    """Whether a forced variant has no backward for the calls ``one_tile_backward_fits`` refuses
    (neither ``Variant.wide_backward`` nor a rotation pass, whose inner backward, without rotary, is
    auto's): the flash kernels run those, as before it was forced, with no warning that it cannot."""
    forced = variants.forced()
    return forced is not None and not forced.wide_backward and not forced.rotation_pass


def wide_backward_runs(variant: Variant) -> bool:
    """Whether ``variant`` (the backward's choice) computes a backward that ``one_tile_backward_fits``
    refuses (``Variant.wide_backward``), not the flash kernels (``forced_without_wide_backward``)."""
    return variant.wide_backward and not forced_without_wide_backward()


def prepare_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sched: Schedule, fwd_key: Optional[tuple], block_size: int,
    scale: float, causal: bool, rope_theta: Optional[float], positions: Optional[torch.Tensor],
    rotary_dim: int, rotary_interleaved: bool,
) -> Optional[PreparedBackward]:
    """The :class:`PreparedBackward` of a forward call, or None where it cannot be prepared.

    ``fwd_key`` is the forward launch's key (``Launcher.__call__``; None where the forward did not
    launch direct on the current device, e.g. with 64-bit addressing). It fixes the backward's
    compiled kernel: the same flags, dtypes, alignments of q, k, v, the table and positions,
    and stride values of q, k, v and of the contiguous output (the shape of dO and dq; dk and
    dv follow from it and ``GROUPS``), and no int the backward specializes on varies per call.
    So the backward's part that does not change per call is looked up once per forward key.
    The first backward of a signature compiles its kernel through the ordinary path; until then
    there is nothing to prepare.
    """
    if fwd_key is None or sched.programs == 0 or not one_tile_backward_fits(block_size, q.shape[2], q.dtype):
        return None
    forced = variants.forced_name()
    last_key, last_forced, template = _TEMPLATES.get(None, _NO_LAST)
    if fwd_key is not last_key or forced != last_forced:
        template = _TEMPLATES.get((fwd_key, forced))
        if template is None:
            template = _template(q, k, v, sched, block_size, scale, causal, rope_theta, positions, rotary_dim,
                                 rotary_interleaved)
            if template is None:
                return None
            _TEMPLATES.put((fwd_key, forced), template)
        _TEMPLATES[None] = (fwd_key, forced, template)
    if template is _UNPREPARED:
        return None
    entry, launcher, meta, strides, variant = template
    pos = positions if positions is not None else sched.table
    kv_heads = k.shape[1]
    tail = (
        sched.table.data_ptr(), pos.data_ptr(), sched.programs, sched.num_seqs, block_size, scale, scale * LOG2E,
        math.log2(rope_theta) if rope_theta is not None else 0.0, kv_heads, *strides,
    )
    grid = block_grid(sched.programs, kv_heads, q.device, True, variant, meta["BLOCK_D"], meta.get("SLOT", 0))
    grid = (grid[0], grid[1] if len(grid) > 1 else 1)
    return PreparedBackward(q, k, v, (sched.table, positions), entry, launcher, grid, q.get_device(), tail,
                           strides[9:12])


def _template(q, k, v, sched, block_size, scale, causal, rope_theta, positions, rotary_dim,
              rotary_interleaved) -> Optional[tuple]:
    """``(entry, launcher, meta, strides, variant)`` of the backward launch for these inputs, with
    dO and the gradients contiguous and 16-byte aligned, None where its kernel is not compiled
    yet, ``_UNPREPARED`` where the backward is not one launch."""
    rot = rotary_dim if rope_theta is not None else 0
    # (dO and the gradients: contiguous and aligned, rows copyable where q's are.)
    facts = call_facts(q, k, block_size, rot, rotary_interleaved, False, positions is not None, backward=True)
    variant = choose(facts, q, (q, k, v))
    if variant.rotation_pass or splits_groups(variant, q, k) or variant.sums_in_launch:
        # Its passes, launches and sums run on the ordinary path (and a kernel that can sum takes
        # arguments past these).
        return _UNPREPARED
    launcher, meta, key, _ = _plan(variant, q, k, sched.programs, block_size, rot, rotary_interleaved,
                                   positions is not None, causal, sched.inline_seqs, False)
    if self_check.pending(variant, facts.major, key):
        return None  # the first backward of the plan is checked on the ordinary path
    pos = positions if positions is not None else sched.table
    q_strides, kv_strides = _contiguous_strides(q.shape), _contiguous_strides(k.shape)
    strides = (*q.stride(), *k.stride(), *v.stride(), *q_strides, *q_strides, *kv_strides, *kv_strides)
    # Stand-ins of dO and the gradient buffers: the saved tensors of the same dtypes (the
    # strides of the contiguous buffers are in ``strides``).
    args = (q, k, v, q, q, k, v, sched.table, pos, sched.programs, sched.num_seqs, block_size, scale,
            scale * LOG2E, 0.0, k.shape[1], *strides)
    aligned = (q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0, True, True, True, True,
               sched.table.data_ptr() % 16 == 0, pos.data_ptr() % 16 == 0)
    entry = launcher.entry_for(args, q, key, aligned)
    return None if entry is None else (entry, launcher, meta, strides, variant)
