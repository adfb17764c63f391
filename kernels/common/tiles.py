"""Tile loads and stores shared by the block-attention kernels (``@triton.jit`` only).

A row tile of q or k is read as up to three column tiles (see ``common.rotary``): ``a`` and ``b``
hold the two channels of each rotary pair, ``p`` the channels that pass through (all of
them without rotary). Column tiles are padded to powers of two and masked.
"""
import triton
import triton.language as tl


@triton.jit
def load_cols(ptr, rows, row_ok, cols, col_ok, stride_t, stride_d, INT64: tl.constexpr):
    if INT64:
        rows = rows.to(tl.int64)
    mask = row_ok[:, None] & col_ok[None, :]
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :] * stride_d, mask=mask, other=0.0)


@triton.jit
def store_cols(ptr, x, rows, row_ok, cols, col_ok, stride_t, stride_d, INT64: tl.constexpr):
    if INT64:
        rows = rows.to(tl.int64)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(ptr + rows[:, None] * stride_t + cols[None, :] * stride_d, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_cols(ptr, x, rows, row_ok, cols, col_ok, stride_t, stride_d, INT64: tl.constexpr):
    """Atomic ``ptr[rows, cols] += x`` (float32 accumulators; the order of the adds is not fixed)."""
    if INT64:
        rows = rows.to(tl.int64)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.atomic_add(ptr + rows[:, None] * stride_t + cols[None, :] * stride_d, x, mask=mask, sem="relaxed")


@triton.jit
def pair_cols(BLOCK_R: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Columns of the first and second channel of each rotary pair, and their mask."""
    offs_r = tl.arange(0, BLOCK_R)
    if INTERLEAVED:
        cols_a = 2 * offs_r
        cols_b = cols_a + 1
    else:
        cols_a = offs_r
        cols_b = offs_r + ROT_DIM // 2
    return offs_r, cols_a, cols_b, offs_r < ROT_DIM // 2


@triton.jit
def load_pairs(ptr, rows, row_ok, cols_a, cols_b, r_ok, stride_t, stride_d, BLOCK_R: tl.constexpr,
               ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, INT64: tl.constexpr):
    """The rotary pair tiles ``(a, b)`` (columns ``cols_a``, ``cols_b`` from ``pair_cols``) of a row
    tile. Interleaved pairs are read as one contiguous tile of the first ``ROT_DIM`` channels and
    split in registers: read apart, each pair's channels are strided 2-byte loads (sm_90 PTX of
    the simple D128 kernels: 128 of them, against 16-byte loads contiguous)."""
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_R)
        x = load_cols(ptr, rows, row_ok, cols, cols < ROT_DIM, stride_t, stride_d, INT64)
        return tl.split(tl.reshape(x, (x.shape[0], BLOCK_R, 2)))
    a = load_cols(ptr, rows, row_ok, cols_a, r_ok, stride_t, stride_d, INT64)
    b = load_cols(ptr, rows, row_ok, cols_b, r_ok, stride_t, stride_d, INT64)
    return a, b


@triton.jit
def store_pairs(ptr, a, b, rows, row_ok, cols_a, cols_b, r_ok, stride_t, stride_d, BLOCK_R: tl.constexpr,
                ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, INT64: tl.constexpr):
    """Store the rotary pair tiles ``a``, ``b`` at their columns; interleaved pairs joined in
    registers into one contiguous tile (as :func:`load_pairs` reads them)."""
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_R)
        x = tl.reshape(tl.join(a, b), (a.shape[0], 2 * BLOCK_R))
        store_cols(ptr, x, rows, row_ok, cols, cols < ROT_DIM, stride_t, stride_d, INT64)
    else:
        store_cols(ptr, a, rows, row_ok, cols_a, r_ok, stride_t, stride_d, INT64)
        store_cols(ptr, b, rows, row_ok, cols_b, r_ok, stride_t, stride_d, INT64)


@triton.jit
def pass_cols(BLOCK_P: tl.constexpr, ROT_DIM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Columns past the rotary channels (all columns without rotary), and their mask."""
    cols = ROT_DIM + tl.arange(0, BLOCK_P)
    return cols, cols < HEAD_DIM


@triton.jit
def block_positions(Pos, block_start, first_row, offs_m, row_ok, HAS_POS: tl.constexpr):
    """Rotary positions of the block's rows: given, or the index inside the sequence."""
    if HAS_POS:
        return tl.load(Pos + block_start + offs_m, mask=row_ok, other=0).to(tl.float32)
    return (first_row + offs_m).to(tl.float32)


@triton.jit
def block_probs_lse(s, offs_m, row_ok, qk_scale, IS_CAUSAL: tl.constexpr, RECIP: tl.constexpr):
    """Exact softmax of the block's raw scores ``s``, normalized, float32 ``[M, M]`` (``RECIP``:
    by one reciprocal per row and a multiply, not a full division per element), and each row's
    natural-log logsumexp of the scaled scores (``qk_scale`` includes log2(e)), as the flash
    kernels store it."""
    s = s * qk_scale
    valid = row_ok[None, :]
    if IS_CAUSAL:
        valid = valid & (offs_m[:, None] >= offs_m[None, :])
    s = tl.where(valid, s, float("-inf"))
    row_max = tl.max(s, 1)
    p = tl.exp2(s - row_max[:, None])
    row_sum = tl.sum(p, 1)
    lse = (row_max + tl.log2(row_sum)) * 0.6931471805599453
    if RECIP:
        return p * (1.0 / row_sum)[:, None], lse
    return p / row_sum[:, None], lse


@triton.jit
def block_probs(s, offs_m, row_ok, qk_scale, IS_CAUSAL: tl.constexpr, RECIP: tl.constexpr):
    """:func:`block_probs_lse`'s probabilities alone."""
    p, _ = block_probs_lse(s, offs_m, row_ok, qk_scale, IS_CAUSAL, RECIP)
    return p


@triton.jit
def head_rows(ptr, rows, stride_t, stride_h, head, INT64: tl.constexpr, FOLD: tl.constexpr):
    """``(pointer, row offsets, row stride)`` of one head's rows: ``ptr`` moved to the head, or
    with ``FOLD`` the head offset joined to 32-bit element offsets of the rows (row stride 1). In
    a loop over heads, that keeps one 32-bit offset per row live, not a 64-bit one."""
    if FOLD:
        if INT64:
            rows = rows.to(tl.int64)
        return ptr, rows * stride_t + head * stride_h, 1
    return ptr + head * stride_h, rows, stride_t


@triton.jit
def finite_flag(x, SLOT: tl.constexpr):
    """For a tile of blocks (``SLOT`` > 0): 1 if every element of ``x`` is finite, else 0; with one
    block per tile, 1 without looking. The products of a packed tile multiply each block's values
    by the zero probabilities (or score gradients) of the other blocks' rows, and 0 x NaN is NaN:
    a tile with a non-finite input is computed again block by block (``block.fwd`` / ``block.bwd``)."""
    if SLOT == 0:
        return 1
    ok = (tl.abs(x.to(tl.float32)) < float("inf")).to(tl.int32)
    return tl.min(tl.min(ok, 1), 0)


@triton.jit
def same_slot(s, offs_m, SLOT: tl.constexpr):
    """Raw scores ``s`` of a tile of blocks of ``SLOT`` rows each (0: one block), with the pairs of
    two different blocks set far below any score (finite, so that a row of an empty slot, masked
    everywhere else, keeps finite probabilities: its output is never stored and its gradients are
    zero)."""
    if SLOT == 0:
        return s
    return tl.where((offs_m[:, None] // SLOT) == (offs_m[None, :] // SLOT), s, -1.0e30)


@triton.jit
def row_ptrs(ptr, h, stride_h, rows, INT64: tl.constexpr):
    """Pointers to ``x[h, rows]`` of a ``[H, T]`` float32 row statistic (lse, delta)."""
    if INT64:
        return ptr + h.to(tl.int64) * stride_h + rows.to(tl.int64)
    return ptr + h * stride_h + rows
