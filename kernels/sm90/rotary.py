"""Rotary-embedding helpers of the sm_90 Gluon kernels: the Gluon home of the rotary math.

The same math as the Triton helpers of ``common.rotary`` (angles ``position * theta ** (-2 i /
rotary_dim)`` in float32, reduced into [-pi, pi] for ``sin.approx`` / ``cos.approx``), written
again because Gluon cannot call Triton JIT functions (its tensors carry layouts); the tests
compare these with the Triton and PyTorch versions on the CPU.

The sm_90 kernels hold q and k (and their gradients) as two half tiles of ``HALF`` columns:
``half_channels`` says which channel of the head each column holds. Half tile a holds the first
channel of each rotary pair (split halves: ``x[j]``, ``j < rotary_dim / 2``), then the first half
of the pass-through channels past ``rotary_dim``; half tile b the pairs' second channels
(``x[j + rotary_dim / 2]``), then the pass-through channels' second half. Interleaved pairs
(``x[2j], x[2j+1]``): column ``j`` of a and b holds channels ``2j`` and ``2j + 1``. Pass-through columns
rotate by the angle 0 (``inv_freq`` 0: sine 0, cosine 1), and columns past ``head_dim / 2`` (a
head dim padded to a power-of-two tile, e.g. 96 -> 128) are masked on every copy and store.
Scores are the sum of the two half tiles' products whatever the channels' order.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

_TWO_PI = gl.constexpr(6.283185307179586)
_INV_TWO_PI = gl.constexpr(0.15915494309189535)


@gluon.jit
def _reduced(angle):
    """``angle`` moved into [-pi, pi], where sin/cos.approx are accurate (~1e-6)."""
    return angle - _TWO_PI * gl.floor(angle * _INV_TWO_PI + 0.5)


@gluon.jit
def half_channels(offs_h, HEAD_DIM: gl.constexpr, ROT_DIM: gl.constexpr, INTERLEAVED: gl.constexpr):
    """``(channels_a, channels_b)``: the head's channels held by columns ``offs_h`` of the half tiles
    a and b (module docstring), for rotary over the first ``ROT_DIM`` of ``HEAD_DIM`` channels in
    split halves (runs of ``ROT_DIM / 2`` and ``(HEAD_DIM - ROT_DIM) / 2`` contiguous channels), or
    ``INTERLEAVED``: column ``j`` holds channels ``2 j`` and ``2 j + 1``, a rotary pair below
    ``ROT_DIM / 2``, two pass-through channels past it."""
    ROT_HALF: gl.constexpr = ROT_DIM // 2
    PASS_HALF: gl.constexpr = (HEAD_DIM - ROT_DIM) // 2
    if INTERLEAVED:
        return 2 * offs_h, 2 * offs_h + 1
    elif PASS_HALF == 0:
        return offs_h, offs_h + ROT_HALF
    else:
        past = (offs_h >= ROT_HALF).to(offs_h.dtype)
        return offs_h + past * ROT_HALF, offs_h + ROT_HALF + past * PASS_HALF


@gluon.jit
def _inv_freq(HALF: gl.constexpr, ROT_HALF: gl.constexpr, log2_theta, LAYOUT: gl.constexpr):
    """The inverse frequencies ``theta ** (-j / ROT_HALF)`` of the half tiles' columns ``j`` in the
    column layout of ``LAYOUT``; 0 past the rotary pairs (pass-through and padding columns)."""
    offs_r = gl.arange(0, HALF, layout=gl.SliceLayout(0, LAYOUT))
    inv_freq = gl.exp2(offs_r.to(gl.float32) * (log2_theta * (-1.0 / ROT_HALF)))
    if ROT_HALF < HALF:
        inv_freq = gl.where(offs_r < ROT_HALF, inv_freq, 0.0)
    return inv_freq


@gluon.jit
def sin_cos(Pos, start, n, first_row, log2_theta, BLOCK_M: gl.constexpr, HALF: gl.constexpr,
            ROT_HALF: gl.constexpr, HAS_POS: gl.constexpr, LAYOUT: gl.constexpr):
    """Rotary sines and cosines ``[BLOCK_M, HALF]`` of the block's rows in ``LAYOUT`` (``ROT_HALF``
    rotary pairs, then angle 0): at the given positions, or at ``first_row + m`` with the angles
    reduced once per column (the Gluon form of ``common.rotary.block_sin_cos`` with ``PER_COLUMN``)."""
    return sin_cos_rows(Pos, start, n, first_row, log2_theta, 0, BLOCK_M, HALF, ROT_HALF, HAS_POS, LAYOUT)


@gluon.jit
def sin_cos_rows(Pos, start, n, first_row, log2_theta, ROW0: gl.constexpr, ROWS: gl.constexpr,
                 HALF: gl.constexpr, ROT_HALF: gl.constexpr, HAS_POS: gl.constexpr, LAYOUT: gl.constexpr):
    """``sin_cos`` of the block's rows ``ROW0 .. ROW0 + ROWS`` (the same values)."""
    offs_m = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))
    inv_freq = _inv_freq(HALF, ROT_HALF, log2_theta, LAYOUT)
    if HAS_POS:
        pos = gl.load(Pos + start + offs_m, mask=offs_m < n, other=0).to(gl.float32)
        angle = _reduced(gl.expand_dims(pos, 1) * gl.expand_dims(inv_freq, 0))
    else:
        base = _reduced(first_row.to(gl.float32) * inv_freq)
        angle = gl.expand_dims(base, 0) + gl.expand_dims(offs_m.to(gl.float32), 1) * gl.expand_dims(inv_freq, 0)
    return _sin_cos_of(angle)


@gluon.jit
def sin_cos_at(Pos, rows, row_ok, prow, log2_theta, HALF: gl.constexpr, ROT_HALF: gl.constexpr,
               HAS_POS: gl.constexpr, LAYOUT: gl.constexpr):
    """Rotary sines and cosines ``[len(rows), HALF]`` in ``LAYOUT`` of a tile whose rows are the
    tokens ``rows`` (where ``row_ok``) at the positions ``Pos[rows]``, or ``prow`` (each row's index
    in its sequence) without ``Pos``: for tiles of several blocks, whose rows are not one run.
    The angles are ``position * inv_freq`` reduced, as ``sin_cos`` computes them at given positions."""
    row_l: gl.constexpr = gl.SliceLayout(1, LAYOUT)
    inv_freq = _inv_freq(HALF, ROT_HALF, log2_theta, LAYOUT)
    if HAS_POS:
        pos = gl.load(Pos + gl.convert_layout(rows, row_l), mask=gl.convert_layout(row_ok, row_l), other=0)
    else:
        pos = gl.convert_layout(prow, row_l)
    return _sin_cos_of(_reduced(gl.expand_dims(pos.to(gl.float32), 1) * gl.expand_dims(inv_freq, 0)))


@gluon.jit
def pair_sin_cos(angle):
    """``(sin, cos)`` of any float32 ``angle`` (reduced into [-pi, pi] first), as the rotary kernels
    take them."""
    return _sin_cos_of(_reduced(angle))


@gluon.jit
def _sin_cos_of(angle):
    """``(sin, cos)`` of angles in [-pi, pi] (``sin.approx`` / ``cos.approx``)."""
    sin = gl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [angle], dtype=gl.float32, is_pure=True, pack=1)
    cos = gl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [angle], dtype=gl.float32, is_pure=True, pack=1)
    return sin, cos


@gluon.jit
def unrotate_pairs(x, pos, col0, log2_theta, ROWS: gl.constexpr, COLS: gl.constexpr, ROT_DIM: gl.constexpr,
                   INTERLEAVED: gl.constexpr, PAIR_CHUNK: gl.constexpr, LAYOUT: gl.constexpr):
    """The transpose rotation of a float32 gradient tile ``x [ROWS, COLS]`` in ``LAYOUT`` (a head's columns
    ``col0 ..``, its rows at the float32 positions ``pos [ROWS]`` in ``SliceLayout(1, LAYOUT)``): each rotary
    pair ``(a, b)`` (interleaved: columns ``2 i, 2 i + 1``; split halves: ``i, i + ROT_DIM / 2``; ``i <
    ROT_DIM / 2``) -> ``(a cos + b sin, b cos - a sin)`` at the angle ``position * theta ** (-2 i / ROT_DIM)``,
    as ``common.rotary.rotate_pair`` with ``INVERSE``; columns from ``ROT_DIM`` on pass (angle 0). Split
    halves: ``COLS`` a multiple of ``ROT_DIM`` and ``col0`` of ``COLS`` (each pair inside the tile); or, with
    ``PAIR_CHUNK`` (split halves over every channel), the head's channels in the paired-chunk order
    (``reference.paired_chunks``: chunks of ``PAIR_CHUNK`` of the two halves alternating), so that pair ``i``
    is columns ``2 c j + r`` and ``2 c j + c + r`` (``c`` the chunk, ``i = c j + r``), ``COLS`` a multiple of
    ``2 c``. A pair sits in one thread's registers in the wgmma accumulator layouts (columns ``8 j + 2 t + {0,
    1}``), so the reshapes move no data."""
    HALF: gl.constexpr = ROT_DIM // 2
    cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
    if INTERLEAVED:
        pair = cols // 2
    elif PAIR_CHUNK > 0:
        gl.static_assert(COLS % (2 * PAIR_CHUNK) == 0, "paired chunks: whole pairs of chunks in the tile")
        pair = cols % PAIR_CHUNK + PAIR_CHUNK * (cols // (2 * PAIR_CHUNK))
    else:
        gl.static_assert(COLS % ROT_DIM == 0, "split halves: whole pairs in the tile")
        pair = cols % HALF
    inv_freq = gl.where(cols < ROT_DIM, gl.exp2(pair.to(gl.float32) * (log2_theta * (-2.0 / ROT_DIM))), 0.0)
    angle = gl.expand_dims(pos, 1) * gl.expand_dims(inv_freq, 0)
    if INTERLEAVED:
        a, b = gl.split(gl.reshape(x, [ROWS, COLS // 2, 2]))
        angle, _ = gl.split(gl.reshape(angle, [ROWS, COLS // 2, 2]))
    else:
        GROUP: gl.constexpr = 2 * PAIR_CHUNK if PAIR_CHUNK > 0 else ROT_DIM
        a, b = gl.split(gl.permute(gl.reshape(x, [ROWS, COLS // GROUP, 2, GROUP // 2]), [0, 1, 3, 2]))
        angle, _ = gl.split(gl.permute(gl.reshape(angle, [ROWS, COLS // GROUP, 2, GROUP // 2]), [0, 1, 3, 2]))
    sin, cos = pair_sin_cos(angle)
    pairs = gl.join(a * cos + b * sin, b * cos - a * sin)
    if INTERLEAVED:
        out = gl.reshape(pairs, [ROWS, COLS])
    else:
        out = gl.reshape(gl.permute(pairs, [0, 1, 3, 2]), [ROWS, COLS])
    return gl.convert_layout(out, LAYOUT)


@gluon.jit
def rotate_in_place(a_s, b_s, sin, cos, LAYOUT: gl.constexpr):
    """Rotate the shared halves ``(a, b) -> (a cos - b sin, a sin + b cos)`` (float32 math)."""
    a = a_s.load(LAYOUT).to(gl.float32)
    b = b_s.load(LAYOUT).to(gl.float32)
    a_s.store((a * cos - b * sin).to(a_s.dtype))
    b_s.store((a * sin + b * cos).to(b_s.dtype))


@gluon.jit
def rotate_rows_in_place(qa_s, qb_s, ka_s, kb_s, Pos, start, n, first_row, log2_theta, WITH_K: gl.constexpr,
                         BLOCK_M: gl.constexpr, HALF: gl.constexpr, ROT_HALF: gl.constexpr, HAS_POS: gl.constexpr,
                         LAYOUT: gl.constexpr):
    """``rotate_in_place`` of a block's q half tiles ``(qa_s, qb_s)`` (and with ``WITH_K`` its k half
    tiles) 32 rows at a time, each with those rows' angles (``sin_cos_rows``): a quarter of a
    128-row tile's registers at a time, where the whole tiles' angles, held across the rotations,
    would take 128 registers a thread at 128 x 128 half tiles."""
    ROWS: gl.constexpr = 32
    for c in gl.static_range(BLOCK_M // ROWS):
        sin, cos = sin_cos_rows(Pos, start, n, first_row, log2_theta, c * ROWS, ROWS, HALF, ROT_HALF, HAS_POS, LAYOUT)
        rotate_in_place(qa_s.slice(c * ROWS, ROWS, 0), qb_s.slice(c * ROWS, ROWS, 0), sin, cos, LAYOUT)
        if WITH_K:
            rotate_in_place(ka_s.slice(c * ROWS, ROWS, 0), kb_s.slice(c * ROWS, ROWS, 0), sin, cos, LAYOUT)
