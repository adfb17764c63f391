"""Rotary-embedding helpers shared by the attention kernels (``@triton.jit`` only).

The kernels hold q and k (and dq, dk) as separate column tiles: the first and second
channel of each rotary pair (``x[i], x[i + rotary_dim/2]``, or ``x[2i], x[2i+1]``
interleaved) and the pass-through channels past ``rotary_dim``. A rotation is then plain
elementwise math on two tiles: no gathers or shuffles, and scores are the sum of one dot
per tile. Angles are computed in float32 from the positions and ``log2(rope_theta)``:
``inv_freq_i = theta ** (-2 i / rotary_dim)``.
"""
import triton
import triton.language as tl

from .tiles import block_positions, load_pairs

_TWO_PI = tl.constexpr(6.283185307179586)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def _sin_cos(angle, FAST_TRIG: tl.constexpr):
    if FAST_TRIG:
        sin = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [angle], dtype=tl.float32, is_pure=True, pack=1)
        cos = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [angle], dtype=tl.float32, is_pure=True, pack=1)
        return sin, cos
    return tl.sin(angle), tl.cos(angle)


@triton.jit
def _reduced(angle):
    """``angle`` moved into [-pi, pi]: sin/cos.approx are accurate (~1e-6 absolute) only there."""
    return angle - _TWO_PI * tl.floor(angle * _INV_TWO_PI + 0.5)


@triton.jit
def rotary_sin_cos(pos, offs_r, log2_theta, ROT_DIM: tl.constexpr, FAST_TRIG: tl.constexpr):
    """``pos [M]`` float32, pair index ``offs_r [R]`` -> ``(sin, cos)``, each ``[M, R]``."""
    inv_freq = tl.exp2(-(2.0 * offs_r.to(tl.float32) / ROT_DIM) * log2_theta)
    return _sin_cos(_reduced(pos[:, None] * inv_freq[None, :]), FAST_TRIG)


@triton.jit
def rotate_pair(a, b, sin, cos, INVERSE: tl.constexpr):
    """``(a, b) -> (a cos - b sin, a sin + b cos)``; ``INVERSE`` applies the transpose."""
    if INVERSE:
        return a * cos + b * sin, b * cos - a * sin
    return a * cos - b * sin, a * sin + b * cos


@triton.jit
def load_rotated_pair(ptr, rows, row_ok, cols_a, cols_b, r_ok, sin, cos, stride_t, stride_d, BLOCK_R: tl.constexpr,
                      ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, INT64: tl.constexpr):
    """The rotary pair tiles ``a``, ``b`` of a q or k row tile (columns ``cols_a``, ``cols_b`` of the
    head at ``ptr``: ``tiles.load_pairs``), rotated in float32 and returned in the input dtype."""
    a, b = load_pairs(ptr, rows, row_ok, cols_a, cols_b, r_ok, stride_t, stride_d, BLOCK_R, ROT_DIM, INTERLEAVED,
                      INT64)
    dtype = a.dtype
    a, b = rotate_pair(a.to(tl.float32), b.to(tl.float32), sin, cos, False)
    return a.to(dtype), b.to(dtype)


@triton.jit
def block_sin_cos(pos, first_row, offs_m, offs_r, log2_theta, ROT_DIM: tl.constexpr, HAS_POS: tl.constexpr,
                  FAST_TRIG: tl.constexpr, PER_COLUMN: tl.constexpr):
    """``rotary_sin_cos`` of a block's rows (``pos``; without ``HAS_POS`` row ``m`` is at
    ``first_row + m``). ``PER_COLUMN``: the inverse frequencies take one multiply, and without
    ``HAS_POS`` the angles are reduced once per column, at ``first_row``; row ``m`` then adds
    ``m * inv_freq`` (under ``BLOCK_M`` radians), where the sine and cosine approximations stay
    within ~1e-5 (their argument is scaled to revolutions with one rounding toward zero)."""
    if not PER_COLUMN:
        return rotary_sin_cos(pos, offs_r, log2_theta, ROT_DIM, FAST_TRIG)
    inv_freq = tl.exp2(offs_r.to(tl.float32) * (log2_theta * (-2.0 / ROT_DIM)))
    if HAS_POS:
        angle = _reduced(pos[:, None] * inv_freq[None, :])
    else:
        base = _reduced(first_row.to(tl.float32) * inv_freq)
        angle = base[None, :] + offs_m.to(tl.float32)[:, None] * inv_freq[None, :]
    return _sin_cos(angle, FAST_TRIG)


@triton.jit
def tile_sin_cos(Pos, start, first_row, offs_m, rows, prow, row_ok, offs_r, log2_theta, ROT_DIM: tl.constexpr,
                 HAS_POS: tl.constexpr, FAST_TRIG: tl.constexpr, PER_COLUMN: tl.constexpr, SLOT: tl.constexpr):
    """``block_sin_cos`` of a tile's rows: one block's (``SLOT`` 0: at ``start``, its first row
    ``first_row`` in its sequence), or, for a tile of blocks of ``SLOT`` rows each
    (``common.schedule.packed_rows``), at each row's position: given (``Pos[rows]``) or ``prow``."""
    if SLOT == 0:
        pos = block_positions(Pos, start, first_row, offs_m, row_ok, HAS_POS)
        return block_sin_cos(pos, first_row, offs_m, offs_r, log2_theta, ROT_DIM, HAS_POS, FAST_TRIG, PER_COLUMN)
    if HAS_POS:
        pos = tl.load(Pos + rows, mask=row_ok, other=0).to(tl.float32)
    else:
        pos = prow.to(tl.float32)
    return block_sin_cos(pos, first_row, offs_m, offs_r, log2_theta, ROT_DIM, True, FAST_TRIG, PER_COLUMN)
