"""Launch-side helpers shared by the block-attention launchers (no ``@triton.jit`` code)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton

LOG2E = 1.4426950408889634
MAX_TILE = 128


def _pow2(n: int) -> int:
    """Tile extent for ``n`` rows or columns: a power of two, at least 16 (the smallest dot)."""
    return max(16, triton.next_power_of_2(n))


def input_precision(dtype: torch.dtype) -> str:
    """fp32 dots follow ``torch.backends.cuda.matmul.allow_tf32``; half types are exact products."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an element offset into one of the tensors can pass 2**31."""
    return any(
        t.numel() and sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) >= 2**31 - 1 for t in tensors
    )


def num_warps(block_m: int, block_d: int, backward: bool) -> int:
    """4 warps up to a 64x128 tile (measured best on H200 at D=128 and D=64); 8 past that."""
    work = block_m * block_d
    return 4 if work <= 64 * 128 or (not backward and work <= 128 * 128) else 8


def kernel_meta(
    q: torch.Tensor, *tensors: torch.Tensor, block_size: int, rope_theta: Optional[float], rotary_dim: int,
    interleaved: bool, positions: Optional[torch.Tensor], causal: bool, backward: bool,
) -> dict:
    """Constexpr flags, tile sizes and launch options of one call (plus ``log2_theta``)."""
    head_dim = q.shape[-1]
    rot = rotary_dim if rope_theta is not None else 0
    block_m = _pow2(block_size)
    block_d = _pow2(head_dim)
    return dict(
        log2_theta=math.log2(rope_theta) if rope_theta is not None else 0.0,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=block_d,
        BLOCK_R=_pow2(rot // 2), BLOCK_P=_pow2(head_dim - rot), ROT_DIM=rot, INTERLEAVED=interleaved,
        HAS_POS=positions is not None, IS_CAUSAL=causal, FAST_TRIG=q.device.type == "cuda",
        INT64=needs_int64(q, *tensors), PRECISION=input_precision(q.dtype),
        num_warps=num_warps(block_m, block_d, backward), num_stages=1,
    )
