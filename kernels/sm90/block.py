"""Block-attention forward and backward for Hopper (sm_90), written in Gluon: the ``hopper`` variant.

Same contract and positional arguments as ``block.fwd`` / ``block.bwd`` (so the launchers,
launch plans and the prepared backward serve both; the constexprs are the subset these kernels
use), for the inputs ``block.variants.HOPPER`` admits: fp16 / bf16, head dims 32-256 in steps of
16 (tiles ``BLOCK_D`` wide, the next power of two, with the channels past ``HEAD_DIM`` masked),
blocks of up to 128 rows (64-row tiles of one warpgroup, 128-row tiles of two: ``_tile_warps``),
no rotary or split-half rotary over ``ROT_DIM`` of the channels, a multiple of 16 (positions
given or implicit; q and k held as two half tiles, ``rotary.half_channels``), 16-byte aligned rows
with unit channel stride, 32- or 64-bit row offsets (``INT64``). One program per
(block, kv head) and its ``GROUPS`` query heads; with several, the query-side tiles take two slots
where that was measured faster (``_q_stages``), so head g + 1's copies are in flight during head
g's products. Where the plan says so (``block.plan.split_groups``), the forward instead runs one
program per query head (``SPLIT_GROUPS``), and the grouped-query backward keeps each head's
independent products in flight together (``OVERLAP``, ``block.plan.overlap_products``). The forward's
128-row tiles of D 144-256 without rotary go through a ring of 64-channel chunks instead of whole tiles
(``CHUNKED``, ``sm90.chunked``, ``block.plan.chunked_channels``): 96 KB of shared memory, two programs per SM.

What Gluon allows that the Triton kernels could not get from the compiler:
- every tile is copied global -> shared memory with ``cp.async`` (masked rows are zero-filled,
  no registers held while in flight), and each ``wgmma`` reads its operands from that one
  shared copy: the rotary halves of q and k are rotated in place there, and P and dS share one
  buffer. Backward, one query head per kv head, D = 128: 72 KB of shared memory plain or
  rotary (Triton: 72 / 80 KB), 158 / 168 registers (rotary: the gradients rotated back from
  fp32 copies in dead tiles, 32 rows at a time, capped at 168: 3 programs per SM, was 191 and 2);
- results leave through a shared tile that is dead by then (a copied input), read back in
  16-byte row chunks: coalesced stores. Storing straight from the accumulator layout (4-byte
  pieces) made the backward 1.7x slower (H200, ncu: 30% excess sectors).
Rows past the block are masked on every load and store, so no other block's data is used.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ..common.launch import Launcher
from .chunked import fwd_tile_chunked
from .rotary import half_channels, rotate_in_place, rotate_rows_in_place, sin_cos, sin_cos_at, sin_cos_rows
from .tile_ops import (  # noqa: F401 (the other kernels and the tests take them from here too)
    _acc_layout, _channel_mask, _copy_rows, _landed, _probs_lse, _ptrs, _row_layout, _smem_layout, _store_cols,
    _store_cols_via,
)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _block_of(Sched, slots, num_seqs, block_size, pid, INLINE_SEQS: gl.constexpr, WARPS: gl.constexpr):
    """``(start, length, first_row)`` of block ``pid`` (in a region of ``WARPS`` warps):
    ``common.schedule.block_of_program`` written again in Gluon (which cannot call Triton JIT functions:
    its tensors carry layouts)."""
    if INLINE_SEQS > 0:
        i, seq_start, seq_end, blocks, cum = _inline_counts(Sched, num_seqs, block_size, INLINE_SEQS, WARPS)
        return _inline_pick(i, seq_start, seq_end, blocks, cum, num_seqs, block_size, pid)
    else:
        return gl.load(Sched + pid), gl.load(Sched + slots + pid), gl.load(Sched + 2 * slots + pid)


@gluon.jit
def group_program(GROUPS: gl.constexpr):
    """``(block, head)`` of this program over a ``(blocks, GROUPS)`` grid taken in launch order with
    the head fastest: the G programs of a block adjacent."""
    linear = gl.program_id(0) + gl.program_id(1) * gl.num_programs(0)
    return linear // GROUPS, linear % GROUPS


@gluon.jit
def _inline_counts(Offsets, num_seqs, block_size, INLINE_SEQS: gl.constexpr, WARPS: gl.constexpr):
    """``(i, seq_start, seq_end, blocks, cum)`` of all ``num_seqs <= INLINE_SEQS`` sequences: their
    index, bounds, block counts and the counts' inclusive prefix sums (``schedule._inline_counts``)."""
    layout: gl.constexpr = gl.BlockedLayout([max(INLINE_SEQS // (32 * WARPS), 1)], [32], [WARPS], [0])
    i = gl.arange(0, INLINE_SEQS, layout=layout)
    m = i < num_seqs
    seq_start = gl.load(Offsets + i, mask=m, other=0)
    seq_end = gl.load(Offsets + i + 1, mask=m, other=0)
    blocks = (seq_end - seq_start + block_size - 1) // block_size
    return i, seq_start, seq_end, blocks, gl.associative_scan(blocks, 0, _add)


@gluon.jit
def _inline_pick(i, seq_start, seq_end, blocks, cum, num_seqs, block_size, pid):
    """``(start, length, first_row)`` of block ``pid`` from ``_inline_counts`` (length 0 past the last)."""
    before = cum <= pid
    s = gl.sum(before.to(gl.int32), 0)
    first_row = (pid - gl.sum(gl.where(before, blocks, 0), 0)) * block_size
    this = i == s
    start = gl.sum(gl.where(this, seq_start, 0), 0) + first_row
    end = gl.sum(gl.where(this, seq_end, 0), 0)
    length = gl.where(s < num_seqs, gl.minimum(end - start, block_size), 0)
    return start, length, first_row


@gluon.jit
def _packed_rows(Sched, slots, num_seqs, block_size, pid, offs_m, SLOT: gl.constexpr, INLINE_SEQS: gl.constexpr,
                 WARPS: gl.constexpr):
    """A 64-row tile of ``64 // SLOT`` blocks (schedule slots ``pid * 64 // SLOT`` on), ``SLOT`` rows
    each: ``(rows, row_ok, prow, n)``, per tile row ``offs_m`` its token, whether it is one and its
    index in its sequence, and ``n`` the tokens of all the tile's blocks (0: nothing to do).
    ``common.schedule.packed_rows`` in Gluon."""
    PACK: gl.constexpr = 64 // SLOT
    slot = offs_m // SLOT
    local = offs_m % SLOT
    row_start = offs_m * 0
    row_n = offs_m * 0
    row_first = offs_m * 0
    n = 0
    if INLINE_SEQS > 0:  # one scan of the offsets for all the tile's blocks
        i, seq_start, seq_end, blocks, cum = _inline_counts(Sched, num_seqs, block_size, INLINE_SEQS, WARPS)
    for j in gl.static_range(PACK):
        b = pid * PACK + j
        if INLINE_SEQS > 0:
            start, length, first_row = _inline_pick(i, seq_start, seq_end, blocks, cum, num_seqs, block_size, b)
        else:
            last = gl.minimum(b, slots - 1)
            start = gl.load(Sched + last)
            length = gl.where(b < slots, gl.load(Sched + slots + last), 0)
            first_row = gl.load(Sched + 2 * slots + last)
        row_start = gl.where(slot == j, start, row_start)
        row_n = gl.where(slot == j, length, row_n)
        row_first = gl.where(slot == j, first_row, row_first)
        n += length
    return row_start + local, local < row_n, row_first + local, n


@gluon.jit
def _copy_halves(a_s, b_s, src, rows, offs_h, mask, stride_t, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr,
                 INTERLEAVED: gl.constexpr, HALF: gl.constexpr):
    """``_copy_rows`` of a row tile's rotary half tiles a and b (``rotary.half_channels``; columns
    past ``HEAD_DIM / 2`` read as zeros). Interleaved, each column's two channels are one 32-bit
    word, loaded into registers (16-byte loads of 4 words) and split into the two tiles: done when
    this returns."""
    cols_a, cols_b = half_channels(offs_h, HEAD_DIM, ROT_DIM, INTERLEAVED)
    mask = _channel_mask(mask, offs_h, HEAD_DIM // 2, HALF)
    if INTERLEAVED:
        words = gl.load(_ptrs(_words(src), rows, offs_h, stride_t // 2), mask=mask, other=0)
        a_s.store(_low_half(words, a_s.dtype))
        b_s.store(_high_half(words, b_s.dtype))
    else:
        _copy_rows(a_s, src, rows, cols_a, mask, stride_t)
        _copy_rows(b_s, src, rows, cols_b, mask, stride_t)


@gluon.jit
def _words(ptr):
    """``ptr`` (16-bit elements) as a pointer to 32-bit words: two channels each."""
    return ptr.to(gl.pointer_type(gl.int32), bitcast=True)


@gluon.jit
def _low_half(words, dtype: gl.constexpr):
    """The 16-bit values in the low halves of 32-bit ``words`` (the lower-addressed channel)."""
    return words.to(gl.int16).to(dtype, bitcast=True)


@gluon.jit
def _high_half(words, dtype: gl.constexpr):
    """The 16-bit values in the high halves of 32-bit ``words``."""
    return (words >> 16).to(gl.int16).to(dtype, bitcast=True)


@gluon.jit
def _word_of(lo, hi, dtype: gl.constexpr):
    """32-bit words of the 16-bit values ``lo`` (low half) and ``hi`` (``lo``, ``hi`` rounded to ``dtype``)."""
    low = lo.to(dtype).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return low | (hi.to(dtype).to(gl.int16, bitcast=True).to(gl.int32) << 16)


@gluon.jit
def _probs(s, n, qk_scale, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr):
    """:func:`_probs_lse` without the logsumexp."""
    p, inv, _ = _probs_lse(s, n, qk_scale, IS_CAUSAL, BLOCK_M, LAYOUT)
    return p, inv


@gluon.jit
def _probs_packed(s, col_ok, qk_scale, IS_CAUSAL: gl.constexpr, SLOT: gl.constexpr, BLOCK_M: gl.constexpr,
                  LAYOUT: gl.constexpr):
    """``_probs`` of a tile of blocks, ``SLOT`` rows each: each row over the keys of its own block
    (``col_ok``: which tile rows are tokens, in the scores' column layout; and the causal triangle).
    Rows with no key (an empty block's) get zero probabilities and a reciprocal sum of 1, not NaN,
    so that they add nothing to dV and dK through P and dS."""
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, LAYOUT))
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
    valid = (gl.expand_dims(rows // SLOT, 1) == gl.expand_dims(cols // SLOT, 0)) & gl.expand_dims(col_ok, 0)
    if IS_CAUSAL:
        valid = valid & (gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0))
    s = gl.where(valid, s * qk_scale, float("-inf"))
    p = gl.exp2(s - gl.expand_dims(gl.maximum(gl.max(s, 1), -1e30), 1))
    # (A row with keys sums to at least 1: its maximum's term.)
    return p, 1.0 / gl.maximum(gl.sum(p, 1), 1.0)


@gluon.jit
def _nonfinite_rows(x):
    """Per row of ``x``, how many of its elements are NaN or infinite (as float32)."""
    return gl.sum(gl.where(gl.abs(x) < float("inf"), 0.0, 1.0), 1)


@gluon.constexpr_function
def _q_stages(groups, block_m, block_d, backward=False, rotary=False):
    """Slots of the query-side tiles (q; in the backward also dO) of a program with ``groups``
    query heads per kv head: two (head g + 1's copies in flight during head g's math) where they
    were measured faster, else one. H200, bf16, prod lengths, block 64, 8x2 and 4x1 heads (A/B
    in one run): forward 1.06-1.14x faster at D 32-128 (tiles up to 64 x 128); backward 1.12-1.16x
    at D64, 1.03-1.04x at D64 rotary, 1.13x at D32 rotary, but 0.90x at D32 and 0.83x at D96 /
    D128 (106 KB of shared memory beside 255 registers that spill), so those keep one."""
    if groups == 1 or block_m * block_d > 64 * 128:
        return 1
    if backward and not (block_m == 64 and (block_d == 64 or block_d == 32 and rotary)):
        return 1
    return 2


@gluon.constexpr_function
def _tile_warps(block_m):
    """Warps of a hopper program: one warpgroup per 64 tile rows."""
    return block_m // 16


@gluon.jit
def _store_via(buf, ptr, x, start, n, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr):
    """Store ``x`` to rows ``start .. start + n`` through the dead shared tile ``buf``
    (``[BLOCK_M, WIDTH]``), read back in 16-byte row chunks (one warpgroup)."""
    _store_cols_via(buf, ptr, x, start, n, stride_t, BLOCK_M, WIDTH, WIDTH, 4)


@gluon.jit
def _store_tile_via(buf, ptr, x, start, n, rows, row_ok, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr,
                    COLS: gl.constexpr, WARPS: gl.constexpr, SLOT: gl.constexpr):
    """``_store_cols_via`` of a tile's rows: block rows ``start .. start + n``, or with ``SLOT`` (a
    tile of blocks) the tokens ``rows`` where ``row_ok`` (in the row layout of ``WIDTH``)."""
    if SLOT > 0:
        gl.thread_barrier()  # every warp is done reading buf
        buf.store(x.to(buf.dtype))
        gl.thread_barrier()
        _store_rows(buf, ptr, rows, row_ok, stride_t, WIDTH, COLS, WARPS)
    else:
        _store_cols_via(buf, ptr, x, start, n, stride_t, BLOCK_M, WIDTH, COLS, WARPS)


@gluon.jit
def _store_rows(buf, ptr, rows, row_ok, stride_t, WIDTH: gl.constexpr, COLS: gl.constexpr, WARPS: gl.constexpr):
    """Store the shared tile ``buf``'s first ``COLS`` columns to the tokens ``rows`` where ``row_ok``."""
    layout: gl.constexpr = _row_layout(WIDTH, WARPS)
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    mask = gl.expand_dims(row_ok, 1)
    if COLS < WIDTH:
        mask = mask & gl.expand_dims(cols < COLS, 0)
    gl.store(_ptrs(ptr, rows, cols, stride_t), buf.load(layout), mask=mask)


@gluon.jit
def _store_halves_tile_via(buf, ptr, lo, hi, start, n, rows, row_ok, stride_t, BLOCK_M: gl.constexpr,
                           WIDTH: gl.constexpr, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr,
                           INTERLEAVED: gl.constexpr, WARPS: gl.constexpr, SLOT: gl.constexpr):
    """Store the row tile whose rotary half tiles are ``lo`` and ``hi`` (``rotary.half_channels``)
    through the dead shared tile ``buf`` (``[BLOCK_M, WIDTH]``), by ``WARPS`` warps, to a tile's rows
    (as ``_store_tile_via``). Where the half tiles are the head's two column halves, in 16-byte
    chunks of whole rows; else each half tile to its channels (``_store_halves``)."""
    HALF: gl.constexpr = WIDTH // 2
    gl.thread_barrier()
    buf.slice(0, HALF, 1).store(lo.to(buf.dtype))
    buf.slice(HALF, HALF, 1).store(hi.to(buf.dtype))
    gl.thread_barrier()
    if HEAD_DIM == WIDTH and ROT_DIM == WIDTH and not INTERLEAVED:
        if SLOT > 0:
            _store_rows(buf, ptr, rows, row_ok, stride_t, WIDTH, WIDTH, WARPS)
        else:
            _store_cols(buf, ptr, start, n, stride_t, BLOCK_M, WIDTH, WIDTH, WARPS)
    else:
        layout: gl.constexpr = _row_layout(HALF, WARPS)
        if SLOT > 0:
            rows_h = gl.convert_layout(rows, gl.SliceLayout(1, layout))
            ok_h = gl.convert_layout(row_ok, gl.SliceLayout(1, layout))
        else:
            offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
            rows_h = start + offs_m
            ok_h = offs_m < n
        offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        mask = gl.expand_dims(ok_h, 1)
        mask = _channel_mask(mask, offs_h, HEAD_DIM // 2, HALF)
        _store_halves(ptr, rows_h, offs_h, mask, stride_t, buf.slice(0, HALF, 1).load(layout),
                      buf.slice(HALF, HALF, 1).load(layout), HEAD_DIM, ROT_DIM, INTERLEAVED)


@gluon.jit
def _tile_sin_cos(Pos, start, n, first_row, rows, row_ok, prow, log2_theta, BLOCK_M: gl.constexpr,
                  HALF: gl.constexpr, ROT_HALF: gl.constexpr, HAS_POS: gl.constexpr, SLOT: gl.constexpr,
                  LAYOUT: gl.constexpr):
    """The rotary ``(sin, cos)`` of a tile's rows in ``LAYOUT``: a block's (``sin_cos``), or with
    ``SLOT`` a tile of blocks' (``sin_cos_at``)."""
    if SLOT > 0:
        return sin_cos_at(Pos, rows, row_ok, prow, log2_theta, HALF, ROT_HALF, HAS_POS, LAYOUT)
    else:
        return sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, ROT_HALF, HAS_POS, LAYOUT)


@gluon.jit
def _unrotate_store(a_buf, b_buf, a, b, ptr, Pos, start, n, first_row, log2_theta, scale, stride_t,
                    BLOCK_M: gl.constexpr, HALF: gl.constexpr, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr,
                    HAS_POS: gl.constexpr, WARPS: gl.constexpr):
    """Store the gradient whose rotary halves are the float32 accumulators ``a``, ``b``, rotated
    back and scaled: ``((a cos + b sin) scale, (b cos - a sin) scale)``, to rows ``start .. start + n``.
    ``a`` and ``b`` go to the dead shared tiles ``a_buf``, ``b_buf`` (16 KB each) and come back 32
    rows at a time in 16-byte row chunks with those rows' angles: a quarter of the tile's registers
    at a time instead of both halves, their angles and a result (the rotary D128 backward fits
    168 registers)."""
    a_s = _f32_view(a_buf, BLOCK_M, HALF)
    b_s = _f32_view(b_buf, BLOCK_M, HALF)
    gl.thread_barrier()  # every warp is done reading the buffers
    a_s.store(a)
    b_s.store(b)
    gl.thread_barrier()
    _unrotate_parked(a_s, b_s, ptr, Pos, start, n, first_row, log2_theta, scale, stride_t, BLOCK_M, HALF, HEAD_DIM,
                     ROT_DIM, INTERLEAVED, HAS_POS, WARPS)


@gluon.jit
def _f32_view(buf, BLOCK_M: gl.constexpr, HALF: gl.constexpr):
    """The dead 16-bit shared tile ``buf`` (16 KB) as a float32 ``[BLOCK_M, HALF]`` tile."""
    fp32_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    return buf._reinterpret(gl.float32, [BLOCK_M, HALF], fp32_l)


@gluon.jit
def _unrotate_parked(a_s, b_s, ptr, Pos, start, n, first_row, log2_theta, scale, stride_t, BLOCK_M: gl.constexpr,
                     HALF: gl.constexpr, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr,
                     WARPS: gl.constexpr):
    """``_unrotate_store`` of halves already parked in the float32 tiles ``a_s``, ``b_s``."""
    ROWS: gl.constexpr = 32
    layout: gl.constexpr = _row_layout(HALF, WARPS)
    # first_row through an opaque copy: the compiler would otherwise reuse the rotation's angles
    # of these rows (same values, same layout) and hold them live from the top of the kernel.
    first_row, log2_theta = _opaque_angles_args(first_row, log2_theta)
    for c in gl.static_range(BLOCK_M // ROWS):
        x = a_s.slice(c * ROWS, ROWS, 0).load(layout)
        y = b_s.slice(c * ROWS, ROWS, 0).load(layout)
        sin, cos = sin_cos_rows(Pos, start, n, first_row, log2_theta, c * ROWS, ROWS, HALF, ROT_DIM // 2, HAS_POS,
                                layout)
        _store_rotated_back_rows(x, y, sin, cos, ptr, start, n, c * ROWS, scale, stride_t, ROWS, HALF, HEAD_DIM,
                                 ROT_DIM, INTERLEAVED, layout)


@gluon.jit
def _store_rotated_back_rows(x, y, sin, cos, ptr, start, n, first, scale, stride_t, ROWS: gl.constexpr,
                             HALF: gl.constexpr, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr,
                             INTERLEAVED: gl.constexpr, layout: gl.constexpr):
    """Store rows ``first .. first + ROWS`` of a gradient whose rotary half tiles are ``x``, ``y``
    (float32, in ``layout``; ``rotary.half_channels``), rotated back by their angles ``sin``, ``cos``
    and scaled: ``((x cos + y sin) scale, (y cos - x sin) scale)``, masked to the block's ``n`` rows."""
    offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    offs_m = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    mask = gl.expand_dims(offs_m < n, 1)
    mask = _channel_mask(mask, offs_h, HEAD_DIM // 2, HALF)
    a = (x * cos + y * sin) * scale
    b = (y * cos - x * sin) * scale
    _store_halves(ptr, start + offs_m, offs_h, mask, stride_t, a, b, HEAD_DIM, ROT_DIM, INTERLEAVED)


@gluon.jit
def _store_halves(ptr, rows, offs_h, mask, stride_t, a, b, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr,
                  INTERLEAVED: gl.constexpr):
    """Store the half tiles ``a``, ``b`` (columns ``offs_h``) to their channels of ``rows``
    (``rotary.half_channels``); interleaved, each column's two channels as one 32-bit word."""
    dtype: gl.constexpr = ptr.dtype.element_ty
    if INTERLEAVED:
        gl.store(_ptrs(_words(ptr), rows, offs_h, stride_t // 2), _word_of(a, b, dtype), mask=mask)
    else:
        cols_a, cols_b = half_channels(offs_h, HEAD_DIM, ROT_DIM, INTERLEAVED)
        gl.store(_ptrs(ptr, rows, cols_a, stride_t), a.to(dtype), mask=mask)
        gl.store(_ptrs(ptr, rows, cols_b, stride_t), b.to(dtype), mask=mask)


@gluon.jit
def _opaque_angles_args(first_row, log2_theta):
    """``first_row`` and ``log2_theta`` through opaque copies, so that angles computed from them are
    computed again rather than reused from earlier (same values, same layout) and held live."""
    first_row = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [first_row], dtype=gl.int32, is_pure=False,
                                          pack=1)
    log2_theta = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [log2_theta], dtype=gl.float32, is_pure=False,
                                           pack=1)
    return first_row, log2_theta


@gluon.constexpr_function
def _rotary_group_fwd_d128(groups, rotary, block_d, slot):
    """Whether a forward tile is a block's (not a tile of blocks') of grouped query heads with rotary
    at D128: it computes its angles again for each query head instead of holding them live across
    the group's loop, and each head's output in two column halves stored through that head's dead
    q halves (no output tile of its own in shared memory). 210 -> 172 registers, 80 -> 64 KB of
    shared memory at 64-row tiles (sm_90, bf16); with the plan's cap (``block.plan``), 3 programs
    per SM instead of 2. At D32 / D64 neither was faster (H200, 4x1 heads, session 25)."""
    return groups > 1 and rotary and block_d == 128 and slot == 0


@gluon.jit
def _unrotate_parked_shared(a_s, b_s, sin_s, cos_s, ptr, start, n, scale, stride_t, BLOCK_M: gl.constexpr,
                            HALF: gl.constexpr, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, WARPS: gl.constexpr):
    """``_unrotate_parked`` with the angles read from the shared 16-bit copies ``sin_s``, ``cos_s``
    (float16: within 2.5e-4 of the float32 angles, a quarter of a bf16 rounding step)."""
    ROWS: gl.constexpr = 32
    layout: gl.constexpr = _row_layout(HALF, WARPS)
    for c in gl.static_range(BLOCK_M // ROWS):
        x = a_s.slice(c * ROWS, ROWS, 0).load(layout)
        y = b_s.slice(c * ROWS, ROWS, 0).load(layout)
        sin = sin_s.slice(c * ROWS, ROWS, 0).load(layout).to(gl.float32)
        cos = cos_s.slice(c * ROWS, ROWS, 0).load(layout).to(gl.float32)
        _store_rotated_back_rows(x, y, sin, cos, ptr, start, n, c * ROWS, scale, stride_t, ROWS, HALF, HEAD_DIM,
                                 ROT_DIM, INTERLEAVED, layout)


@gluon.jit
def _store_buffer(buf, ptr, start, n, stride_t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr):
    """Store the shared tile ``buf`` to rows ``start .. start + n`` (one warpgroup)."""
    _store_cols(buf, ptr, start, n, stride_t, BLOCK_M, WIDTH, WIDTH, 4)


@gluon.jit
def _copy_head(qa_s, qb_s, ka_s, kb_s, v_s, Q, K, V, h, rows, offs_h, offs_d, mask, mask_d,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM: gl.constexpr,
               ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, HALF: gl.constexpr):
    """Issue the copies of kv head ``h``'s rotary q and k half tiles and v tile (one group)."""
    q_ptr = Q + h * stride_qh
    k_ptr = K + h * stride_kh
    _copy_halves(qa_s, qb_s, q_ptr, rows, offs_h, mask, stride_qt, HEAD_DIM, ROT_DIM, INTERLEAVED, HALF)
    _copy_halves(ka_s, kb_s, k_ptr, rows, offs_h, mask, stride_kt, HEAD_DIM, ROT_DIM, INTERLEAVED, HALF)
    _copy_rows(v_s, V + h * stride_vh, rows, offs_d, mask_d, stride_vt)
    async_copy.commit_group()


@gluon.jit
def _fwd_rotary_heads(Q, K, V, O, Pos, start, n, first_row, qk_scale, log2_theta, kv_heads,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr,
                      HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Rotary forward of one block for every head (one query head per kv head): the angles once,
    and two stages of shared tiles, so each head's copies are in flight during the previous
    head's math."""
    HALF: gl.constexpr = BLOCK_D // 2
    WARPS: gl.constexpr = _tile_warps(BLOCK_M)
    dtype: gl.constexpr = Q.dtype.element_ty
    smem_d: gl.constexpr = _smem_layout(BLOCK_D)
    smem_h: gl.constexpr = _smem_layout(HALF)
    acc_s: gl.constexpr = _acc_layout(BLOCK_M, WARPS)
    acc_d: gl.constexpr = _acc_layout(BLOCK_D, WARPS)
    ld: gl.constexpr = _row_layout(BLOCK_D, WARPS)
    rot_l: gl.constexpr = _row_layout(HALF, WARPS)
    a_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_d, k_width=2)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
    rows = start + offs_m
    mask = gl.expand_dims(offs_m < n, 1)
    mask_d = _channel_mask(mask, offs_d, HEAD_DIM, BLOCK_D)
    qa_s = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF], smem_h)
    qb_s = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF], smem_h)
    ka_s = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF], smem_h)
    kb_s = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF], smem_h)
    v_s = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_D], smem_d)
    _copy_head(qa_s.index(0), qb_s.index(0), ka_s.index(0), kb_s.index(0), v_s.index(0), Q, K, V, 0, rows, offs_h,
               offs_d, mask, mask_d, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM,
               ROT_DIM, INTERLEAVED, HALF)
    sin, cos = sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M, HALF, ROT_DIM // 2, HAS_POS, rot_l)
    zero_s = gl.zeros([BLOCK_M, BLOCK_M], gl.float32, acc_s)
    zero_d = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d)
    for h in range(kv_heads):
        stage = h % 2
        gl.thread_barrier()  # every warp is done with the other stage (the previous head's)
        if h + 1 < kv_heads:
            nxt = 1 - stage
            _copy_head(qa_s.index(nxt), qb_s.index(nxt), ka_s.index(nxt), kb_s.index(nxt), v_s.index(nxt), Q, K, V,
                       h + 1, rows, offs_h, offs_d, mask, mask_d, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_vt, stride_vh, HEAD_DIM, ROT_DIM, INTERLEAVED, HALF)
            async_copy.wait_group(1)
        else:
            async_copy.wait_group(0)
        gl.thread_barrier()
        qa, qb, ka, kb = qa_s.index(stage), qb_s.index(stage), ka_s.index(stage), kb_s.index(stage)
        rotate_in_place(qa, qb, sin, cos, rot_l)
        rotate_in_place(ka, kb, sin, cos, rot_l)
        fence_async_shared()
        gl.thread_barrier()
        s = warpgroup_mma(qa, ka.permute((1, 0)), zero_s)
        s = warpgroup_mma(qb, kb.permute((1, 0)), s)
        p, inv = _probs(s, n, qk_scale, IS_CAUSAL, BLOCK_M, acc_s)
        o = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), v_s.index(stage), zero_d)
        o = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, acc_d)), 1)
        _store_cols_via(v_s.index(stage), O + h * stride_oh, o, start, n, stride_ot, BLOCK_M, BLOCK_D, HEAD_DIM, WARPS)


@gluon.jit
def _fwd_tile(Q, K, V, O, Lse, Pos, start, n, first_row, rows, row_ok, prow, hk, qk_scale, log2_theta,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
              GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
              ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, SLOT: gl.constexpr,
              STORE_LSE: gl.constexpr):
    """Kv head ``hk`` of one tile and its ``GROUPS`` query heads: the tile's tokens ``rows`` where
    ``row_ok`` (in the row layout of ``BLOCK_D``), a block (rows ``start .. start + n``, its first
    row ``first_row`` in its sequence) or with ``SLOT`` blocks of ``SLOT`` rows each (``prow``: each
    row's index in its sequence). ``STORE_LSE`` (a block, not a tile of blocks): also each query
    row's logsumexp, into ``Lse [H, T]``. Returns, for a tile of blocks, how many elements of the
    first head's output are not finite (else 0)."""
    gl.static_assert(not (STORE_LSE and SLOT > 0), "the logsumexp of a block, not of a tile of blocks")
    WARPS: gl.constexpr = _tile_warps(BLOCK_M)
    HALF: gl.constexpr = BLOCK_D // 2
    ROT_HALF: gl.constexpr = ROT_DIM // 2
    ROTARY: gl.constexpr = ROT_DIM > 0
    dtype: gl.constexpr = Q.dtype.element_ty
    smem_d: gl.constexpr = _smem_layout(BLOCK_D)
    smem_h: gl.constexpr = _smem_layout(HALF)
    acc_s: gl.constexpr = _acc_layout(BLOCK_M, WARPS)
    acc_d: gl.constexpr = _acc_layout(BLOCK_D, WARPS)
    ld: gl.constexpr = _row_layout(BLOCK_D, WARPS)
    rot_l: gl.constexpr = _row_layout(HALF, WARPS)
    a_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_d, k_width=2)
    # Grouped query heads with rotary at D128: angles again for each head, output by halves.
    O_HALVES: gl.constexpr = _rotary_group_fwd_d128(GROUPS, ROTARY, BLOCK_D, SLOT)
    # A block's rotary half tiles 128 wide (D 144-256): rotated 32 rows at a time with those rows'
    # angles, none held across the scores (``rotary.rotate_rows_in_place``).
    ROTATE_BY_ROWS: gl.constexpr = ROTARY and HALF == 128 and SLOT == 0
    acc_h: gl.constexpr = _acc_layout(HALF, WARPS)

    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
    mask = gl.expand_dims(row_ok, 1)
    if SLOT > 0:
        col_ok = gl.convert_layout(row_ok, gl.SliceLayout(0, acc_s))
    bad = 0.0
    mask_d = _channel_mask(mask, offs_d, HEAD_DIM, BLOCK_D)
    k_ptr = K + hk * stride_kh
    # Query tiles in STAGES slots: with two, head g + 1's copy is in flight during head g's math.
    STAGES: gl.constexpr = _q_stages(GROUPS, BLOCK_M, BLOCK_D)
    v_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], smem_d)
    zero_s = gl.zeros([BLOCK_M, BLOCK_M], gl.float32, acc_s)
    zero_d = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d)
    if ROTARY:
        qa_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HALF], smem_h)
        qb_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HALF], smem_h)
        ka_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], smem_h)
        kb_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], smem_h)
        _copy_halves(ka_s, kb_s, k_ptr, rows, offs_h, mask, stride_kt, HEAD_DIM, ROT_DIM, INTERLEAVED, HALF)
        if GROUPS > 1 and not O_HALVES:
            o_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], smem_d)  # heads before the last
    else:
        q_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], smem_d)
        k_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], smem_d)
        _copy_rows(k_s, k_ptr, rows, offs_d, mask_d, stride_kt)
    # Without rotary and with one query slot, v's copy is a commit group of its own, in flight
    # while the first head's scores and softmax are computed.
    V_APART: gl.constexpr = not ROTARY and STAGES == 1
    if not V_APART:
        _copy_rows(v_s, V + hk * stride_vh, rows, offs_d, mask_d, stride_vt)
    for g in gl.static_range(GROUPS):
        if g > 0:
            gl.thread_barrier()  # every warp is done with the previous head's tiles
        # Head g's copy (issued during the previous head when STAGES is 2), then head g + 1's.
        for c in gl.static_range(g, g + 2):
            if c < GROUPS and (c == g and (g == 0 or STAGES == 1) or c > g and STAGES == 2):
                q_ptr = Q + (hk * GROUPS + c) * stride_qh
                if ROTARY:
                    _copy_halves(qa_s.index(c % STAGES), qb_s.index(c % STAGES), q_ptr, rows, offs_h, mask,
                                 stride_qt, HEAD_DIM, ROT_DIM, INTERLEAVED, HALF)
                else:
                    _copy_rows(q_s.index(c % STAGES), q_ptr, rows, offs_d, mask_d, stride_qt)
                async_copy.commit_group()
        if V_APART and g == 0:
            _copy_rows(v_s, V + hk * stride_vh, rows, offs_d, mask_d, stride_vt)
            async_copy.commit_group()
        if ROTARY and not ROTATE_BY_ROWS:
            if g == 0:
                # Angles while the copies are in flight.
                sin, cos = _tile_sin_cos(Pos, start, n, first_row, rows, row_ok, prow, log2_theta, BLOCK_M, HALF,
                                         ROT_HALF, HAS_POS, SLOT, rot_l)
            elif O_HALVES:
                row0, theta = _opaque_angles_args(first_row, log2_theta)
                sin, cos = _tile_sin_cos(Pos, start, n, row0, rows, row_ok, prow, theta, BLOCK_M, HALF, ROT_HALF,
                                         HAS_POS, SLOT, rot_l)
        async_copy.wait_group(1 if (STAGES == 2 and g + 1 < GROUPS) or (V_APART and g == 0) else 0)
        if ROTARY:
            qa, qb = qa_s.index(g % STAGES), qb_s.index(g % STAGES)
            gl.thread_barrier()
            if ROTATE_BY_ROWS:
                rotate_rows_in_place(qa, qb, ka_s, kb_s, Pos, start, n, first_row, log2_theta, g == 0, BLOCK_M, HALF,
                                     ROT_HALF, HAS_POS, rot_l)
            else:
                rotate_in_place(qa, qb, sin, cos, rot_l)
                if g == 0:
                    rotate_in_place(ka_s, kb_s, sin, cos, rot_l)
        fence_async_shared()
        gl.thread_barrier()
        if ROTARY:
            s = warpgroup_mma(qa, ka_s.permute((1, 0)), zero_s)
            s = warpgroup_mma(qb, kb_s.permute((1, 0)), s)
        else:
            s = warpgroup_mma(q_s.index(g % STAGES), k_s.permute((1, 0)), zero_s)
        if SLOT > 0:
            p, inv = _probs_packed(s, col_ok, qk_scale, IS_CAUSAL, SLOT, BLOCK_M, acc_s)
        elif STORE_LSE:
            p, inv, lse = _probs_lse(s, n, qk_scale, IS_CAUSAL, BLOCK_M, acc_s)
            # Straight from the scores' row layout: no layout change (a shared-memory round trip).
            lse_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_s))
            gl.store(Lse + (hk * GROUPS + g) * stride_lh + start + lse_rows, lse, mask=lse_rows < n)
        else:
            p, inv = _probs(s, n, qk_scale, IS_CAUSAL, BLOCK_M, acc_s)
        if O_HALVES:
            zero_h = gl.zeros([BLOCK_M, HALF], gl.float32, acc_h)
            p_h = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc_h, k_width=2))
            inv_h = gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, acc_h)), 1)
            o_ptr = O + (hk * GROUPS + g) * stride_oh
            o_lo = warpgroup_mma(p_h, v_s.slice(0, HALF, 1), zero_h) * inv_h
            _store_cols_via(qa, o_ptr, o_lo, start, n, stride_ot, BLOCK_M, HALF, HALF, WARPS)
            o_hi = warpgroup_mma(p_h, v_s.slice(HALF, HALF, 1), zero_h) * inv_h
            _store_cols_via(qb, o_ptr + HALF, o_hi, start, n, stride_ot, BLOCK_M, HALF, HEAD_DIM - HALF, WARPS)
        else:
            if V_APART and g == 0:
                _landed(0)
            o = warpgroup_mma(gl.convert_layout(p.to(dtype), a_d), v_s, zero_d)
            o = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, acc_d)), 1)
            if SLOT > 0 and g == 0:
                # A NaN or infinity in v reaches every row of o (through the zero probabilities of
                # the other blocks' keys too); in q or k it stays in its block (the scores between
                # blocks are replaced), so the first head's o tells whether the tile must be done
                # block by block.
                bad = gl.sum(_nonfinite_rows(o), 0)
            o_ptr = O + (hk * GROUPS + g) * stride_oh
            if not ROTARY:
                _store_tile_via(q_s.index(g % STAGES), o_ptr, o, start, n, rows, row_ok, stride_ot, BLOCK_M, BLOCK_D,
                                HEAD_DIM, WARPS, SLOT)
            elif g == GROUPS - 1:
                _store_tile_via(v_s, o_ptr, o, start, n, rows, row_ok, stride_ot, BLOCK_M, BLOCK_D, HEAD_DIM, WARPS,
                                SLOT)
            else:
                _store_tile_via(o_s, o_ptr, o, start, n, rows, row_ok, stride_ot, BLOCK_M, BLOCK_D, HEAD_DIM, WARPS,
                                SLOT)
    return bad


@gluon.jit(noinline=True)
def _fwd_block_alone(Q, K, V, O, Sched, Pos, slots, num_seqs, block_size, pid, block, hk, qk_scale, log2_theta,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                      GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
                      ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
                      INT64: gl.constexpr, SLOT: gl.constexpr):
    """``_fwd_tile`` of the block ``block`` of tile ``pid`` alone (the other blocks' rows masked: read
    as zeros, not stored). Not inlined, one block a call: a second copy of the tile's code in the
    kernel, or the same code in a loop, held its addresses live (107 -> 176 registers at D128)."""
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _row_layout(BLOCK_D, 4)))
    rows, row_ok, prow, n = _packed_rows(Sched, slots, num_seqs, block_size, pid, offs_m, SLOT, INLINE_SEQS, 4)
    if INT64:
        rows = rows.to(gl.int64)
    _fwd_tile(Q, K, V, O, O, Pos, 0, n, 0, rows, row_ok & (offs_m // SLOT == block), prow, hk, qk_scale,
              log2_theta, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, 0,
              GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, SLOT, False)


@gluon.jit
def _fwd_program(Q, K, V, O, Lse, Sched, Pos, slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
                 GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
                 ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
                 HEAD_LOOP: gl.constexpr, INT64: gl.constexpr, SLOT: gl.constexpr, SPLIT_GROUPS: gl.constexpr,
                 STORE_LSE: gl.constexpr, CHUNKED: gl.constexpr):
    """One program of the forward (``STORE_LSE``: and each query row's logsumexp, ``Lse [H, T]``,
    of blocks one per program without the kv-head loop; ``CHUNKED``: a 128-row tile of a wide head
    in 64-channel chunks, ``sm90.chunked``)."""
    gl.static_assert(not (STORE_LSE and HEAD_LOOP), "the logsumexp without the kv-head loop")
    if SPLIT_GROUPS > 1:
        # One query head per program (GROUPS is 1), the grid's second axis over the query heads.
        # Programs start in launch order (the first axis fastest): taken as (tile, head) with the
        # head fastest, so a kv head's SPLIT_GROUPS programs run together and read its k and v
        # from L2 after the first.
        gl.static_assert(GROUPS == 1 and not HEAD_LOOP, "one query head per program")
        heads = gl.num_programs(1)
        order = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        pid = order // heads
        h = order % heads
        hk = h // SPLIT_GROUPS
        Q = Q + (h - hk) * stride_qh
        O = O + (h - hk) * stride_oh
        Lse = Lse + (h - hk) * stride_lh
    else:
        pid = gl.program_id(0)
        hk = gl.program_id(1)
    WARPS: gl.constexpr = _tile_warps(BLOCK_M)
    ld: gl.constexpr = _row_layout(BLOCK_D, WARPS)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    if SLOT > 0:
        gl.static_assert(BLOCK_M == 64 and not HEAD_LOOP, "tiles of blocks: 64 rows, no kv-head loop")
        rows, row_ok, prow, n = _packed_rows(Sched, slots, num_seqs, block_size, pid, offs_m, SLOT,
                                       INLINE_SEQS, WARPS)
        if INT64:
            rows = rows.to(gl.int64)
        if n > 0:
            bad = _fwd_tile(Q, K, V, O, Lse, Pos, 0, n, 0, rows, row_ok, prow, hk, qk_scale, log2_theta, stride_qt,
                            stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
                            GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, SLOT, STORE_LSE)
            if bad > 0:
                # A NaN or infinity in v reached the other blocks' rows (0 x NaN in P V): each block
                # again alone.
                for b in range(64 // SLOT):
                    _fwd_block_alone(Q, K, V, O, Sched, Pos, slots, num_seqs, block_size, pid, b, hk,
                                     qk_scale, log2_theta, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                                     stride_vh, stride_ot, stride_oh, GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED,
                                     HAS_POS, IS_CAUSAL, INLINE_SEQS, INT64, SLOT)
    else:
        start, n, first_row = _block_of(Sched, slots, num_seqs, block_size, pid, INLINE_SEQS, WARPS)
        if INT64:
            start = start.to(gl.int64)
        if HEAD_LOOP:
            if n > 0:
                _fwd_rotary_heads(Q, K, V, O, Pos, start, n, first_row, qk_scale, log2_theta, kv_heads,
                                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                                  stride_oh, HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL)
        elif CHUNKED:
            gl.static_assert(GROUPS == 1 and ROT_DIM == 0 and BLOCK_M == 128, "one query head, no rotary, 128 rows")
            if n > 0:
                fwd_tile_chunked(Q + hk * stride_qh, K + hk * stride_kh, V + hk * stride_vh, O + hk * stride_oh,
                                 Lse + hk * stride_lh, start, n, qk_scale, stride_qt, stride_kt, stride_vt, stride_ot,
                                 HEAD_DIM, IS_CAUSAL, STORE_LSE)
        elif n > 0:
            _fwd_tile(Q, K, V, O, Lse, Pos, start, n, first_row, start + offs_m, offs_m < n, 0, hk, qk_scale,
                      log2_theta, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                      stride_oh, stride_lh, GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, SLOT,
                      STORE_LSE)


@gluon.jit(do_not_specialize=["slots", "num_seqs", "block_size", "qk_scale", "log2_theta", "kv_heads"])
def _hopper_fwd_kernel(
    Q, K, V, O, Sched, Pos,
    slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
    GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
    ROT_DIM: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
    HEAD_LOOP: gl.constexpr, INT64: gl.constexpr, SLOT: gl.constexpr, SPLIT_GROUPS: gl.constexpr = 1,
    INTERLEAVED: gl.constexpr = False, CHUNKED: gl.constexpr = False,
):
    _fwd_program(Q, K, V, O, O, Sched, Pos, slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, 0,
                 GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, INLINE_SEQS, HEAD_LOOP, INT64,
                 SLOT, SPLIT_GROUPS, False, CHUNKED)


@gluon.jit(do_not_specialize=["slots", "num_seqs", "block_size", "qk_scale", "log2_theta", "kv_heads"])
def _hopper_fwd_lse_kernel(
    Q, K, V, O, Lse, Sched, Pos,
    slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_lh,
    GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
    ROT_DIM: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
    HEAD_LOOP: gl.constexpr, INT64: gl.constexpr, SLOT: gl.constexpr, SPLIT_GROUPS: gl.constexpr = 1,
    INTERLEAVED: gl.constexpr = False, CHUNKED: gl.constexpr = False,
):
    """``_hopper_fwd_kernel`` that also stores each query row's logsumexp, ``Lse [H, T]`` (blocks
    one per program: no ``SLOT``, no ``HEAD_LOOP``)."""
    _fwd_program(Q, K, V, O, Lse, Sched, Pos, slots, num_seqs, block_size, qk_scale, log2_theta, kv_heads,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
                 GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, INLINE_SEQS, HEAD_LOOP, INT64,
                 SLOT, SPLIT_GROUPS, True, CHUNKED)


@gluon.jit
def _bwd_head_overlapped(q_s, k_s, v_s, do_s, pds_s, dv, dk, dq_ptr, start, n, rows, row_ok, scale, qk_scale,
                         stride_dqt, g, PENDING: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_D: gl.constexpr, IS_CAUSAL: gl.constexpr, SLOT: gl.constexpr):
    """Query head ``g`` of a grouped-query backward tile (no rotary, 64-row tiles of D <= 64) with
    its independent products in flight together: S = Q K^T beside dP = dO V^T (the softmax waits
    for S only), dV += P^T dO beside dS, and dQ = dS K beside dK += dS^T Q (dQ's store waits for dQ
    only). Returns dV and dK. ``PENDING``: the copy groups still in flight once this head's have
    landed (the next head's, prefetched)."""
    WARPS: gl.constexpr = _tile_warps(BLOCK_M)
    dtype: gl.constexpr = do_s.dtype
    acc_s: gl.constexpr = _acc_layout(BLOCK_M, WARPS)
    zero_s = gl.zeros([BLOCK_M, BLOCK_M], gl.float32, acc_s)
    async_copy.wait_group(PENDING)
    fence_async_shared()
    gl.thread_barrier()
    s = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_s, is_async=True)
    dp = warpgroup_mma(do_s, v_s.permute((1, 0)), zero_s, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    if SLOT > 0:
        col_ok = gl.convert_layout(row_ok, gl.SliceLayout(0, acc_s))
        p, inv = _probs_packed(s, col_ok, qk_scale, IS_CAUSAL, SLOT, BLOCK_M, acc_s)
    else:
        p, inv = _probs(s, n, qk_scale, IS_CAUSAL, BLOCK_M, acc_s)
    p = p * gl.expand_dims(inv, 1)
    pds_s.store(p.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    dv = warpgroup_mma(pds_s.permute((1, 0)), do_s, dv, use_acc=g > 0, is_async=True)
    dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp,))
    ds = (p * (dp - gl.expand_dims(gl.sum(p * dp, 1), 1))).to(dtype)
    dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))
    gl.thread_barrier()  # every warp's dV product is done reading P
    pds_s.store(ds)
    fence_async_shared()
    gl.thread_barrier()
    acc_d: gl.constexpr = _acc_layout(BLOCK_D, WARPS)
    dq = warpgroup_mma(pds_s, k_s, gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d), is_async=True)
    dk = warpgroup_mma(pds_s.permute((1, 0)), q_s, dk, use_acc=g > 0, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq,))
    # dO's tile is dead (dV's product is done) and carries dQ out.
    _store_tile_via(do_s, dq_ptr, dq * scale, start, n, rows, row_ok, stride_dqt, BLOCK_M, BLOCK_D, HEAD_DIM, WARPS,
                    SLOT)
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
    return dv, dk


@gluon.jit
def _bwd_tile(Q, K, V, DO, DQ, DK, DV, Pos, start, n, first_row, rows, row_ok, prow, hk, scale, qk_scale, log2_theta,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
              stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
              GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
              ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, SLOT: gl.constexpr,
              OVERLAP: gl.constexpr):
    """Gradients of kv head ``hk`` of one tile and its ``GROUPS`` query heads (the tile's rows as in
    ``_fwd_tile``). Returns, for a tile of blocks, how many elements of dK and dV are not finite
    (else 0)."""
    WARPS: gl.constexpr = _tile_warps(BLOCK_M)
    HALF: gl.constexpr = BLOCK_D // 2
    ROT_HALF: gl.constexpr = ROT_DIM // 2
    ROTARY: gl.constexpr = ROT_DIM > 0
    # dQ and dK rotated back through the dead v and dO tiles (``_unrotate_store``): at D128 with
    # one query head per kv head (v's tile is live across the heads of a group; at D64 the
    # register path needs fewer registers). Tiles of blocks (rows not one run, each at its own
    # position) rotate back in registers at every width (D128: 168 registers, 76 bytes spilled).
    # The same at D 144-256 on 64-row tiles (dQ's and dK's halves are 64 x 128 there, the dead
    # tiles 32 KB).
    UNROTATE_IN_SMEM: gl.constexpr = ROTARY and GROUPS == 1 and SLOT == 0 and (HALF == 64 or HALF == 128
                                                                               and BLOCK_M == 64)
    # Half tiles 128 wide (D 144-256): q and k rotated 32 rows at a time with those rows' angles
    # (``rotary.rotate_rows_in_place``), none held across the products.
    ROTATE_BY_ROWS: gl.constexpr = ROTARY and HALF == 128 and SLOT == 0
    # With grouped query heads at D128 (v live across the heads) dQ's halves are parked one at
    # a time in dO's dead tile and a scratch tile, then rotated back the same way.
    PARK_DQ: gl.constexpr = ROTARY and GROUPS > 1 and HALF == 64 and SLOT == 0
    # There the angles are computed once, for k and the first head's q, and kept in a 16-bit shared
    # copy (16 KB) that the later heads' rotations and the rotations back read: held in registers
    # across the heads they took 64 of them and spilled, and dQ's rotation back computed them again
    # for every head (H200, bf16, block 64, 4x1 heads: 3.03 -> 1.89 ms; 608 -> 360 bytes spilled).
    SHARED_ANGLES: gl.constexpr = PARK_DQ
    # Grouped query heads at 128-row tiles, D >= 64: P read back in 16 bits from its shared copy
    # for dS instead of held in float32 across dO V^T (the scores' tiles are 64 registers each
    # there, beside dK's and dV's accumulators; ptxas at D128: spills 628 -> 332 bytes).
    P_RELOAD: gl.constexpr = GROUPS > 1 and BLOCK_M == 128 and BLOCK_D >= 64
    # dQ by column halves where dK and dV are both live across the heads (grouped query heads,
    # 128-wide tiles: ptxas spilled at 255 registers with the whole dQ accumulator).
    DQ_HALVES: gl.constexpr = not ROTARY and GROUPS > 1 and BLOCK_D == 128
    # Grouped query heads without rotary at 64-row tiles of D <= 64: each head's independent
    # products in flight together (``_bwd_head_overlapped``), where the plan asks for it.
    OVERLAP_HERE: gl.constexpr = OVERLAP and not ROTARY and GROUPS > 1 and BLOCK_M == 64 and BLOCK_D <= 64
    dtype: gl.constexpr = Q.dtype.element_ty
    smem_d: gl.constexpr = _smem_layout(BLOCK_D)
    smem_h: gl.constexpr = _smem_layout(HALF)
    acc_s: gl.constexpr = _acc_layout(BLOCK_M, WARPS)
    acc_d: gl.constexpr = _acc_layout(BLOCK_D, WARPS)
    acc_h: gl.constexpr = _acc_layout(HALF, WARPS)
    ld: gl.constexpr = _row_layout(BLOCK_D, WARPS)
    rot_l: gl.constexpr = _row_layout(HALF, WARPS)

    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    offs_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld))
    mask = gl.expand_dims(row_ok, 1)
    if SLOT > 0:
        col_ok = gl.convert_layout(row_ok, gl.SliceLayout(0, acc_s))
    # A NaN or infinity in the tile's q, k, v or dO shows in dK or dV: q's, dO's and k's reach dV
    # (every row for dO's, through the other blocks' zero probabilities), v's reach dK through dS.
    # Counted there, where they are live anyway (counting the raw scores and dO V^T instead held
    # them live: 160 -> 192 registers at D128, 0.8 KB spilled with grouped query heads at D64).
    bad = 0.0
    mask_d = _channel_mask(mask, offs_d, HEAD_DIM, BLOCK_D)
    k_ptr = K + hk * stride_kh
    # q and dO tiles in STAGES slots: with two, head g + 1's copies are in flight during head g's math.
    STAGES: gl.constexpr = _q_stages(GROUPS, BLOCK_M, BLOCK_D, True, ROT_DIM > 0)
    v_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], smem_d)
    do_st = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], smem_d)
    pds_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_M], smem_d)
    zero_s = gl.zeros([BLOCK_M, BLOCK_M], gl.float32, acc_s)
    if ROTARY:
        qa_st = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HALF], smem_h)
        qb_st = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HALF], smem_h)
        ka_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], smem_h)
        kb_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HALF], smem_h)
        _copy_halves(ka_s, kb_s, k_ptr, rows, offs_h, mask, stride_kt, HEAD_DIM, ROT_DIM, INTERLEAVED, HALF)
        if PARK_DQ:
            park_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], smem_d)
        if SHARED_ANGLES:
            angles_s = gl.allocate_shared_memory(gl.float16, [2, BLOCK_M, HALF], smem_h)
    else:
        q_st = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], smem_d)
        k_s = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], smem_d)
        _copy_rows(k_s, k_ptr, rows, offs_d, mask_d, stride_kt)
    if OVERLAP_HERE:
        # (Not read at the first head: its products start them, use_acc=False.)
        dv = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d)
        dk = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d)
    # (Otherwise dK and dV start at the first head's products, not as zeros held from the top.)
    for g in gl.static_range(GROUPS):
        h = hk * GROUPS + g
        if g > 0:
            gl.thread_barrier()  # every warp is done with the previous head's q and dO
        # Head g's copies (issued during the previous head when STAGES is 2), then head g + 1's:
        # each head's q in one commit group and its dO (with v for the first head) in the next.
        for c in gl.static_range(g, g + 2):
            if c < GROUPS and (c == g and (g == 0 or STAGES == 1) or c > g and STAGES == 2):
                q_ptr = Q + (hk * GROUPS + c) * stride_qh
                if ROTARY:
                    _copy_halves(qa_st.index(c % STAGES), qb_st.index(c % STAGES), q_ptr, rows, offs_h, mask,
                                 stride_qt, HEAD_DIM, ROT_DIM, INTERLEAVED, HALF)
                else:
                    _copy_rows(q_st.index(c % STAGES), q_ptr, rows, offs_d, mask_d, stride_qt)
                async_copy.commit_group()
                _copy_rows(do_st.index(c % STAGES), DO + (hk * GROUPS + c) * stride_doh, rows, offs_d, mask_d, stride_dot)
                if c == 0:
                    _copy_rows(v_s, V + hk * stride_vh, rows, offs_d, mask_d, stride_vt)
                async_copy.commit_group()
        do_s = do_st.index(g % STAGES)
        if ROTARY:
            qa_s = qa_st.index(g % STAGES)
            qb_s = qb_st.index(g % STAGES)
        else:
            q_s = q_st.index(g % STAGES)
        if ROTARY and not ROTATE_BY_ROWS:
            if g == 0:
                sin, cos = _tile_sin_cos(Pos, start, n, first_row, rows, row_ok, prow, log2_theta, BLOCK_M, HALF,
                                         ROT_HALF, HAS_POS, SLOT, rot_l)
                if SHARED_ANGLES:
                    angles_s.index(0).store(sin.to(gl.float16))
                    angles_s.index(1).store(cos.to(gl.float16))
            elif SHARED_ANGLES:
                sin = angles_s.index(0).load(rot_l).to(gl.float32)
                cos = angles_s.index(1).load(rot_l).to(gl.float32)

        if OVERLAP_HERE:
            dv, dk = _bwd_head_overlapped(q_s, k_s, v_s, do_s, pds_s, dv, dk, DQ + h * stride_dqh, start, n, rows,
                                          row_ok, scale, qk_scale, stride_dqt, g,
                                          2 if STAGES == 2 and g + 1 < GROUPS else 0, HEAD_DIM, BLOCK_M, BLOCK_D,
                                          IS_CAUSAL, SLOT)
        else:
            # S once q and k have landed (dO and v may still be in flight; so may head g + 1's q and
            # dO, two commit groups, when prefetched).
            async_copy.wait_group(3 if STAGES == 2 and g + 1 < GROUPS else 1)
            if ROTARY:
                gl.thread_barrier()
                if ROTATE_BY_ROWS:
                    rotate_rows_in_place(qa_s, qb_s, ka_s, kb_s, Pos, start, n, first_row, log2_theta, g == 0, BLOCK_M,
                                         HALF, ROT_HALF, HAS_POS, rot_l)
                else:
                    rotate_in_place(qa_s, qb_s, sin, cos, rot_l)
                    if g == 0:
                        rotate_in_place(ka_s, kb_s, sin, cos, rot_l)
            fence_async_shared()
            gl.thread_barrier()
            if ROTARY:
                s = warpgroup_mma(qa_s, ka_s.permute((1, 0)), zero_s)
                s = warpgroup_mma(qb_s, kb_s.permute((1, 0)), s)
            else:
                s = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_s)
            if SLOT > 0:
                p, inv = _probs_packed(s, col_ok, qk_scale, IS_CAUSAL, SLOT, BLOCK_M, acc_s)
            else:
                p, inv = _probs(s, n, qk_scale, IS_CAUSAL, BLOCK_M, acc_s)
            p = p * gl.expand_dims(inv, 1)

            # P to shared memory (dV's product reads it transposed); dP = dO V^T; dS.
            pds_s.store(p.to(dtype))
            async_copy.wait_group(2 if STAGES == 2 and g + 1 < GROUPS else 0)
            fence_async_shared()
            gl.thread_barrier()
            dp = warpgroup_mma(do_s, v_s.permute((1, 0)), zero_s)
            if P_RELOAD:
                p = pds_s.load(acc_s).to(gl.float32)
            ds = (p * (dp - gl.expand_dims(gl.sum(p * dp, 1), 1))).to(dtype)
            if g == 0:
                dv = warpgroup_mma(pds_s.permute((1, 0)), do_s, gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d))
            else:
                dv = warpgroup_mma(pds_s.permute((1, 0)), do_s, dv)
            if GROUPS == 1:
                # v is dead: dV leaves now, and its accumulator with it.
                if SLOT > 0:
                    bad = gl.sum(_nonfinite_rows(dv), 0)
                _store_tile_via(v_s, DV + hk * stride_dvh, dv, start, n, rows, row_ok, stride_dvt, BLOCK_M, BLOCK_D,
                                HEAD_DIM, WARPS, SLOT)
            gl.thread_barrier()  # dV's product is done reading P
            pds_s.store(ds)
            fence_async_shared()
            gl.thread_barrier()
            # dQ = dS K, dK += dS^T Q; dO's tile is dead and carries dQ out.
            dq_ptr = DQ + h * stride_dqh
            if UNROTATE_IN_SMEM:
                zero_h = gl.zeros([BLOCK_M, HALF], gl.float32, acc_h)
                dqa = warpgroup_mma(pds_s, ka_s, zero_h)
                dqb = warpgroup_mma(pds_s, kb_s, zero_h)
                _unrotate_store(v_s, do_s, dqa, dqb, dq_ptr, Pos, start, n, first_row, log2_theta, scale, stride_dqt,
                                BLOCK_M, HALF, HEAD_DIM, ROT_DIM, INTERLEAVED, HAS_POS, WARPS)
                dka = warpgroup_mma(pds_s.permute((1, 0)), qa_s, zero_h)
                dkb = warpgroup_mma(pds_s.permute((1, 0)), qb_s, zero_h)
                _unrotate_store(v_s, do_s, dka, dkb, DK + hk * stride_dkh, Pos, start, n, first_row, log2_theta,
                                scale, stride_dkt, BLOCK_M, HALF, HEAD_DIM, ROT_DIM, INTERLEAVED, HAS_POS, WARPS)
            elif ROTARY:
                zero_h = gl.zeros([BLOCK_M, HALF], gl.float32, acc_h)
                if PARK_DQ:
                    dqa_s = _f32_view(do_s, BLOCK_M, HALF)
                    dqb_s = _f32_view(park_s, BLOCK_M, HALF)
                    gl.thread_barrier()  # every warp is done reading dO's tile
                    dqa_s.store(warpgroup_mma(pds_s, ka_s, zero_h))
                    dqb_s.store(warpgroup_mma(pds_s, kb_s, zero_h))
                    gl.thread_barrier()
                    _unrotate_parked_shared(dqa_s, dqb_s, angles_s.index(0), angles_s.index(1), dq_ptr, start, n,
                                            scale, stride_dqt, BLOCK_M, HALF, HEAD_DIM, ROT_DIM, INTERLEAVED, WARPS)
                else:
                    # (Angles again in the accumulators' layout: cheaper than keeping them live.)
                    sin_h, cos_h = _tile_sin_cos(Pos, start, n, first_row, rows, row_ok, prow, log2_theta, BLOCK_M,
                                                 HALF, ROT_HALF, HAS_POS, SLOT, acc_h)
                    dqa = warpgroup_mma(pds_s, ka_s, zero_h)
                    dqb = warpgroup_mma(pds_s, kb_s, zero_h)
                    _store_halves_tile_via(do_s, dq_ptr, (dqa * cos_h + dqb * sin_h) * scale,
                                           (dqb * cos_h - dqa * sin_h) * scale, start, n, rows, row_ok, stride_dqt,
                                           BLOCK_M, BLOCK_D, HEAD_DIM, ROT_DIM, INTERLEAVED, WARPS, SLOT)
                if g == 0:
                    dka = warpgroup_mma(pds_s.permute((1, 0)), qa_s, zero_h)
                    dkb = warpgroup_mma(pds_s.permute((1, 0)), qb_s, zero_h)
                else:
                    dka = warpgroup_mma(pds_s.permute((1, 0)), qa_s, dka)
                    dkb = warpgroup_mma(pds_s.permute((1, 0)), qb_s, dkb)
            elif DQ_HALVES:
                # dQ in two column halves, each to dO's dead tile as soon as it is summed: half the
                # registers beside the live dK and dV accumulators.
                zero_h = gl.zeros([BLOCK_M, HALF], gl.float32, acc_h)
                gl.thread_barrier()  # every warp is done reading dO's tile
                dqa = warpgroup_mma(pds_s, k_s.slice(0, HALF, 1), zero_h)
                do_s.slice(0, HALF, 1).store((dqa * scale).to(dtype))
                dqb = warpgroup_mma(pds_s, k_s.slice(HALF, HALF, 1), zero_h)
                do_s.slice(HALF, HALF, 1).store((dqb * scale).to(dtype))
                gl.thread_barrier()
                if SLOT > 0:
                    _store_rows(do_s, dq_ptr, rows, row_ok, stride_dqt, BLOCK_D, HEAD_DIM, WARPS)
                else:
                    _store_cols(do_s, dq_ptr, start, n, stride_dqt, BLOCK_M, BLOCK_D, HEAD_DIM, WARPS)
            else:
                dq = warpgroup_mma(pds_s, k_s, gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d))
                _store_tile_via(do_s, dq_ptr, dq * scale, start, n, rows, row_ok, stride_dqt, BLOCK_M, BLOCK_D, HEAD_DIM,
                                WARPS, SLOT)
            if not ROTARY:
                if g == 0:
                    dk = warpgroup_mma(pds_s.permute((1, 0)), q_s, gl.zeros([BLOCK_M, BLOCK_D], gl.float32, acc_d))
                else:
                    dk = warpgroup_mma(pds_s.permute((1, 0)), q_s, dk)
    dk_ptr = DK + hk * stride_dkh
    if ROTARY and not UNROTATE_IN_SMEM:
        if SHARED_ANGLES:
            sin_h = angles_s.index(0).load(acc_h).to(gl.float32)
            cos_h = angles_s.index(1).load(acc_h).to(gl.float32)
        else:
            sin_h, cos_h = _tile_sin_cos(Pos, start, n, first_row, rows, row_ok, prow, log2_theta, BLOCK_M, HALF,
                                         ROT_HALF, HAS_POS, SLOT, acc_h)
        if SLOT > 0:
            bad = bad + gl.sum(_nonfinite_rows(dka), 0) + gl.sum(_nonfinite_rows(dkb), 0)
        _store_halves_tile_via(do_s, dk_ptr, (dka * cos_h + dkb * sin_h) * scale,
                               (dkb * cos_h - dka * sin_h) * scale, start, n, rows, row_ok, stride_dkt, BLOCK_M,
                               BLOCK_D, HEAD_DIM, ROT_DIM, INTERLEAVED, WARPS, SLOT)
    elif not ROTARY:
        if SLOT > 0:
            bad = bad + gl.sum(_nonfinite_rows(dk), 0)
        _store_tile_via(do_s, dk_ptr, dk * scale, start, n, rows, row_ok, stride_dkt, BLOCK_M, BLOCK_D, HEAD_DIM,
                        WARPS, SLOT)
    if GROUPS > 1:
        if SLOT > 0:
            bad = bad + gl.sum(_nonfinite_rows(dv), 0)
        _store_tile_via(v_s, DV + hk * stride_dvh, dv, start, n, rows, row_ok, stride_dvt, BLOCK_M, BLOCK_D,
                        HEAD_DIM, WARPS, SLOT)
    return bad


@gluon.jit(noinline=True)
def _bwd_block_alone(Q, K, V, DO, DQ, DK, DV, Sched, Pos, slots, num_seqs, block_size, pid, block, hk, scale,
                     qk_scale, log2_theta, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                     GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
                     ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
                     INT64: gl.constexpr, SLOT: gl.constexpr, OVERLAP: gl.constexpr):
    """``_bwd_tile`` of the block ``block`` of tile ``pid`` alone (as ``_fwd_block_alone``)."""
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _row_layout(BLOCK_D, 4)))
    rows, row_ok, prow, n = _packed_rows(Sched, slots, num_seqs, block_size, pid, offs_m, SLOT, INLINE_SEQS, 4)
    if INT64:
        rows = rows.to(gl.int64)
    _bwd_tile(Q, K, V, DO, DQ, DK, DV, Pos, 0, n, 0, rows, row_ok & (offs_m // SLOT == block), prow, hk, scale,
              qk_scale, log2_theta, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
              stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, GROUPS, HEAD_DIM,
              BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, SLOT, OVERLAP)


@gluon.jit(do_not_specialize=["slots", "num_seqs", "block_size", "scale", "qk_scale", "log2_theta", "kv_heads"])
def _hopper_bwd_kernel(
    Q, K, V, DO, DQ, DK, DV, Sched, Pos,
    slots, num_seqs, block_size, scale, qk_scale, log2_theta, kv_heads,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd, stride_dot, stride_doh, stride_dod,
    stride_dqt, stride_dqh, stride_dqd, stride_dkt, stride_dkh, stride_dkd,
    stride_dvt, stride_dvh, stride_dvd,
    GROUPS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
    ROT_DIM: gl.constexpr, HAS_POS: gl.constexpr, IS_CAUSAL: gl.constexpr, INLINE_SEQS: gl.constexpr,
    INT64: gl.constexpr, SLOT: gl.constexpr, OVERLAP: gl.constexpr = False, INTERLEAVED: gl.constexpr = False,
    GROUP_PROGRAMS: gl.constexpr = 0,
):
    """``GROUP_PROGRAMS`` (one query head per kv head launched for a group of that many query heads,
    ``Variant.group_partials``): the programs taken with the head fastest, a block's adjacent, so that
    they run side by side and read each k and v tile from HBM once (``group_program``)."""
    WARPS: gl.constexpr = _tile_warps(BLOCK_M)
    ld: gl.constexpr = _row_layout(BLOCK_D, WARPS)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    if GROUP_PROGRAMS > 0:
        gl.static_assert(SLOT == 0, "a group's programs adjacent: blocks one per program")
        block, hk = group_program(GROUP_PROGRAMS)
    else:
        block, hk = gl.program_id(0), gl.program_id(1)
    if SLOT > 0:
        gl.static_assert(BLOCK_M == 64, "tiles of blocks: 64 rows")
        rows, row_ok, prow, n = _packed_rows(Sched, slots, num_seqs, block_size, gl.program_id(0), offs_m, SLOT,
                                       INLINE_SEQS, WARPS)
        if INT64:
            rows = rows.to(gl.int64)
        if n > 0:
            bad = _bwd_tile(Q, K, V, DO, DQ, DK, DV, Pos, 0, n, 0, rows, row_ok, prow, hk, scale, qk_scale,
                            log2_theta, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt,
                            stride_dvh, GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, SLOT, OVERLAP)
            if bad > 0:
                # A NaN or infinity in the tile's q, k, v or dO reached the other blocks' gradients
                # (0 x NaN in the products): each block again alone.
                for b in range(64 // SLOT):
                    _bwd_block_alone(Q, K, V, DO, DQ, DK, DV, Sched, Pos, slots, num_seqs, block_size,
                                     gl.program_id(0), b, hk, scale, qk_scale, log2_theta, stride_qt, stride_qh,
                                     stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dqt,
                                     stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, GROUPS, HEAD_DIM,
                                     BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, INLINE_SEQS, INT64, SLOT, OVERLAP)
    else:
        start, n, first_row = _block_of(Sched, slots, num_seqs, block_size, block, INLINE_SEQS, WARPS)
        if INT64:
            start = start.to(gl.int64)
        if n > 0:
            _bwd_tile(Q, K, V, DO, DQ, DK, DV, Pos, start, n, first_row, start + offs_m, offs_m < n, 0, hk,
                      scale, qk_scale, log2_theta, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                      GROUPS, HEAD_DIM, BLOCK_M, BLOCK_D, ROT_DIM, INTERLEAVED, HAS_POS, IS_CAUSAL, SLOT, OVERLAP)


launch_fwd = Launcher(_hopper_fwd_kernel)
launch_fwd_lse = Launcher(_hopper_fwd_lse_kernel)
launch_bwd = Launcher(_hopper_bwd_kernel)
