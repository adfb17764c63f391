"""Rotary-embedding helpers shared by the attention kernels (``@triton.jit`` only).

Angles are computed in float32 in the kernel from the positions and ``log2(rope_theta)``:
``inv_freq_i = theta ** (-2 i / rotary_dim)``. A rotation mixes channel ``d`` with its
partner (``d ^ 1`` interleaved, ``d +- rotary_dim/2`` half-split), gathered from the tile in
registers, so rotary reads no extra bytes. The sign of ``sin`` is folded per channel:
``y = x * cos + x[partner] * sin_signed``; the transpose (for gradients) is
``x * cos - x[partner] * sin_signed``.
"""
import triton
import triton.language as tl

_TWO_PI = tl.constexpr(6.283185307179586)


@triton.jit
def _sin_cos(angle, FAST_TRIG: tl.constexpr):
    if FAST_TRIG:
        sin = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [angle], dtype=tl.float32, is_pure=True, pack=1)
        cos = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [angle], dtype=tl.float32, is_pure=True, pack=1)
        return sin, cos
    return tl.sin(angle), tl.cos(angle)


@triton.jit
def rotary_tables(pos, offs_d, rotary_dim, log2_theta, INTERLEAVED: tl.constexpr, FAST_TRIG: tl.constexpr):
    """``pos [M]`` float32 -> ``(cos [M, D], sin_signed [M, D], partner [D])``."""
    half = rotary_dim // 2
    if INTERLEAVED:
        freq_idx = offs_d // 2
        partner = offs_d ^ 1
        sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
    else:
        first = offs_d < half
        freq_idx = tl.where(first, offs_d, offs_d - half)
        partner = tl.where(first, offs_d + half, offs_d - half)
        sign = tl.where(first, -1.0, 1.0)
    rot = offs_d < rotary_dim
    partner = tl.where(rot, partner, offs_d)
    inv_freq = tl.exp2(-(2.0 * freq_idx.to(tl.float32) / rotary_dim) * log2_theta)
    angle = pos[:, None] * inv_freq[None, :]
    # Reduce to [-pi, pi] first: sin/cos.approx are accurate (~1e-6 absolute) only there.
    angle = angle - _TWO_PI * tl.floor(angle / _TWO_PI + 0.5)
    sin, cos = _sin_cos(angle, FAST_TRIG)
    cos = tl.where(rot[None, :], cos, 1.0)
    sin = tl.where(rot[None, :], sin * sign[None, :], 0.0)
    return cos, sin, partner


@triton.jit
def rotate(x, cos, sin, partner, INVERSE: tl.constexpr):
    """Rotate the float32 tile ``x [M, D]`` (``INVERSE``: by the negative angle)."""
    xp = tl.gather(x, tl.broadcast_to(partner[None, :], x.shape), 1)
    if INVERSE:
        return x * cos - xp * sin
    return x * cos + xp * sin
