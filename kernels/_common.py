"""Launch-side helpers shared by the block-attention launchers (no ``@triton.jit`` code)."""
from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
import triton

LOG2E = 1.4426950408889634
MAX_TILE = 128


# Which block-kernel variant runs: "simple" (one program per (block, kv head)), "persistent"
# (a grid of resident programs, each looping over a balanced contiguous range of tiles) or
# "persistent_ws" (the same, reading q, k, v, dO through TMA descriptors so that Triton
# warp-specializes the tile loop: producer warps load tile i+1 while the others compute tile i;
# calls TMA cannot serve run "persistent"). "auto" takes the variant measured fastest on the
# GPU's generation (``AUTO_VARIANT``), else "simple".
VARIANTS = ("simple", "persistent", "persistent_ws")
KERNELS = os.environ.get("BLOCKATTN_KERNELS", "auto")
# Compute-capability major -> the variant that measured faster than "simple" there.
AUTO_VARIANT: dict = {}
# Programs per SM in a persistent grid: what fits of the simple kernels at 4 warps (registers
# per thread, ptxas for sm_90: forward about 116, backward about 200); the persistent kernels
# need more, so part of the grid waits for a slot.
PROGRAMS_PER_SM = {False: 4, True: 2}


def kernel_variant(x: torch.Tensor) -> str:
    """The block-kernel variant for tensors like ``x`` (see ``KERNELS``)."""
    if KERNELS != "auto":
        if KERNELS not in VARIANTS:
            raise ValueError(f"BLOCKATTN_KERNELS must be auto or one of {', '.join(VARIANTS)}, got {KERNELS!r}")
        return KERNELS
    return AUTO_VARIANT.get(_major(x.device), "simple") if x.is_cuda else "simple"


@functools.lru_cache(maxsize=16)
def _major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for CPU tensors under the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def block_grid(variant: str, programs: int, kv_heads: int, device: torch.device, backward: bool) -> tuple:
    """Grid of the block kernels: ``(programs, kv_heads)``, or the resident programs when persistent."""
    if variant == "simple":
        return (programs, kv_heads)
    return (min(programs * kv_heads, sm_count(device) * PROGRAMS_PER_SM[backward]),)


def variant_options(variant: str, tma: bool) -> dict:
    """Constexprs and launch options of a block-kernel variant (with TMA, 2 stages: the buffers
    between the producer and consumer warps of the warp-specialized loop)."""
    options = dict(PERSISTENT=variant != "simple", TMA=tma)
    if tma:
        options["num_stages"] = 2
    return options


def warp_specialized_builds(major: int, block_m: int, backward: bool, rotary: bool) -> bool:
    """Whether the TMA / warp-specialized block kernel compiles for that GPU generation (Triton
    3.6, checked by ``compile_check`` for sm_90 and sm_100): on sm_90 the warp-specialization
    pass fails for 128-row tiles; on sm_100 it leaves the rotary backward's partitions too few
    registers for ptxas."""
    if major == 9:
        return block_m <= 64
    if major == 10:
        return not (backward and rotary)
    return False  # not built or checked for other generations


def tma_ok(meta: dict, backward: bool, *tensors: torch.Tensor) -> bool:
    """Whether the block kernels can read ``[T, H, D]`` tensors as TMA boxes of their
    ``[T, H * D]`` view: heads packed (``stride_h == D``, ``stride_d == 1``), 16-byte aligned
    base and row stride, D a power of two, rotary off or half-split over all of D in halves of at
    least 16 channels (a box per half), 32-bit offsets, on a GPU where the kernel builds (CPU
    tensors: the interpreter)."""
    head_dim, rot = meta["HEAD_DIM"], meta["ROT_DIM"]
    if meta["INT64"] or head_dim != meta["BLOCK_D"] or rot not in (0, head_dim):
        return False
    if rot and (meta["INTERLEAVED"] or meta["BLOCK_R"] != rot // 2):
        return False
    major = _major(tensors[0].device) if tensors[0].is_cuda else None
    if major is not None and not warp_specialized_builds(major, meta["BLOCK_M"], backward, rot > 0):
        return False
    for t in tensors:
        stride_t, stride_h, stride_d = t.stride()
        if stride_d != 1 or (stride_h != head_dim and t.shape[1] > 1):
            return False
        if (stride_t * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def tma_descriptors(tma: bool, meta: dict, split: tuple, whole: tuple) -> tuple:
    """Host TMA descriptors of ``split`` (q, k: boxes of the rotary halves, or whole rows) and
    ``whole`` tensors (v, dO: whole rows) for ``BLOCK_M``-row tiles; the tensors themselves
    (unused placeholders) when ``tma`` is False."""
    if not tma:
        return split + whole
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, head_dim = meta["BLOCK_M"], meta["HEAD_DIM"]
    box = meta["BLOCK_R"] if meta["ROT_DIM"] else head_dim

    def desc(t: torch.Tensor, cols: int):
        total, heads, _ = t.shape
        return TensorDescriptor(t, [total, heads * head_dim], [t.stride(0), 1], [rows, cols])

    return tuple(desc(t, box) for t in split) + tuple(desc(t, head_dim) for t in whole)


def _pow2(n: int) -> int:
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
def _static_meta(
    block_size: int, head_dim: int, rot: int, interleaved: bool, has_pos: bool, causal: bool,
    on_cuda: bool, precision: str, backward: bool,
) -> tuple:
    block_m = _pow2(block_size)
    block_d = _pow2(head_dim)
    return tuple(dict(
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=block_d,
        BLOCK_R=_pow2(rot // 2), BLOCK_P=_pow2(head_dim - rot), ROT_DIM=rot, INTERLEAVED=interleaved,
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
    meta = dict(_static_meta(
        block_size, q.shape[-1], rot, interleaved, positions is not None, causal, q.is_cuda,
        input_precision(q.dtype), backward,
    ))
    meta["log2_theta"] = math.log2(rope_theta) if rope_theta is not None else 0.0
    meta["INT64"] = needs_int64(q, *tensors)
    return meta


def empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """Contiguous ``(dq, dk, dv)`` buffers with the inputs' shapes and dtypes."""
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
