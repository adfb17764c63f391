"""Launch-side helpers shared by the block-attention launchers (no ``@triton.jit`` code)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton

LOG2E = 1.4426950408889634
MAX_TILE = 128


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_d: int
    num_warps: int
    num_stages: int


def tile_config(block_size: int, head_dim: int, backward: bool) -> TileConfig:
    """One tile covers a whole block: rows padded to a power of two >= 16, head dim likewise."""
    block_m = max(16, triton.next_power_of_2(block_size))
    block_d = max(16, triton.next_power_of_2(head_dim))
    work = block_m * block_d
    num_warps = 4 if work <= 128 * 64 or (not backward and work <= 128 * 128) else 8
    return TileConfig(block_m, block_d, num_warps, 1)


def input_precision(dtype: torch.dtype) -> str:
    """fp32 dots follow ``torch.backends.cuda.matmul.allow_tf32``; half types are exact products."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def rotary_args(rope_theta: Optional[float], rotary_dim: int) -> tuple:
    """``(HAS_ROTARY, rotary_dim, log2(theta))`` for the kernels."""
    if rope_theta is None:
        return False, 0, 0.0
    return True, rotary_dim, math.log2(rope_theta)


def needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an element offset into one of the tensors can pass 2**31."""
    return any(t.numel() and sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) >= 2**31 - 1 for t in tensors)


def fast_trig(x: torch.Tensor) -> bool:
    """PTX ``sin/cos.approx`` on CUDA (after range reduction); the interpreter has no inline asm."""
    return x.device.type == "cuda"
