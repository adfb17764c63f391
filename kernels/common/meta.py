"""Launch-side facts shared by every kernel family (no ``@triton.jit`` code): the device's
generation and size, tile extents, the dot precision, 64-bit addressing, warps, the constexprs
of a call, and output buffers."""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton

LOG2E = 1.4426950408889634
# Rows of the largest tile one program computes in one pass: blocks up to this many tokens
# need no online softmax.
MAX_TILE = 128


@functools.lru_cache(maxsize=16)
def device_major(device: torch.device) -> int:
    """Compute-capability major version of a CUDA device."""
    return torch.cuda.get_device_capability(device)[0]


def major_of(x: torch.Tensor) -> int:
    """Compute-capability major version of ``x``'s GPU (9 off the GPU: the Hopper choices)."""
    return device_major(x.device) if x.is_cuda else 9


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for CPU tensors under the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=16)
def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may take on a CUDA device (the limit Triton checks a
    launch against); 227 KB, sm_90's, for CPU tensors under the interpreter."""
    if device.type != "cuda":
        return 227 * 1024
    from triton.runtime import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


def tile_extent(n: int) -> int:
    """Tile extent for ``n`` rows or columns: a power of two, at least 16 (the smallest dot)."""
    return max(16, triton.next_power_of_2(n))


def input_precision(dtype: torch.dtype) -> str:
    """fp32 dots follow ``torch.backends.cuda.matmul.allow_tf32``; half types are exact products."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an element offset from the first element of one of the tensors can reach 2**31."""
    for t in tensors:
        if t.numel() < 2**31 - 1 and t.is_contiguous():
            continue
        if sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0) >= 2**31 - 1:
            return True
    return False


def num_warps(block_m: int, block_d: int, backward: bool) -> int:
    """4 warps up to a 64x128 tile (measured best on H200 at D=128 and D=64); 8 past that."""
    work = block_m * block_d
    return 4 if work <= 64 * 128 or (not backward and work <= 128 * 128) else 8


@functools.lru_cache(maxsize=256)
def static_meta(
    block_size: int, head_dim: int, rot: int, interleaved: bool, has_pos: bool, causal: bool,
    on_cuda: bool, precision: str, backward: bool,
) -> tuple:
    """The shape-only constexprs and launch options of a call, as ``dict(...).items()``."""
    block_m = tile_extent(block_size)
    block_d = tile_extent(head_dim)
    return tuple(dict(
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=block_d,
        BLOCK_R=tile_extent(rot // 2), BLOCK_P=tile_extent(head_dim - rot), ROT_DIM=rot, INTERLEAVED=interleaved,
        HAS_POS=has_pos, IS_CAUSAL=causal, FAST_TRIG=on_cuda, PRECISION=precision,
        num_warps=num_warps(block_m, block_d, backward), num_stages=1,
    ).items())


def kernel_meta(
    q: torch.Tensor, *tensors: torch.Tensor, block_size: int, rope_theta: Optional[float], rotary_dim: int,
    interleaved: bool, positions: Optional[torch.Tensor], causal: bool, backward: bool,
) -> dict:
    """Constexpr flags, tile sizes and launch options of one call (plus ``log2_theta``).

    The shape-only part is cached: it is recomputed for every launch otherwise, and host
    time per call is what small batches pay for.
    """
    rot = rotary_dim if rope_theta is not None else 0
    meta = dict(static_meta(
        block_size, q.shape[-1], rot, interleaved, positions is not None, causal, q.is_cuda,
        input_precision(q.dtype), backward,
    ))
    meta["log2_theta"] = math.log2(rope_theta) if rope_theta is not None else 0.0
    meta["INT64"] = needs_int64(q, *tensors)
    return meta


def empty_contiguous(x: torch.Tensor) -> torch.Tensor:
    """A buffer of ``x``'s shape and dtype with the standard contiguous strides (those the ops'
    fake implementations give, even where ``x`` is contiguous with other strides on dimensions of
    size 1). ``empty_like``: about half the host time of ``new_empty(x.shape)``, which parses the
    shape (dev CPU 1.6 against 3.0 us), itself half of ``torch.empty(shape, dtype=, device=)``'s."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """Contiguous ``(dq, dk, dv)`` buffers with the inputs' shapes and dtypes."""
    return empty_contiguous(q), empty_contiguous(k), empty_contiguous(v)
