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
# "hopper" (``hopper_block``: Gluon kernels for sm_90, one program per (block, kv head), for the
# inputs ``hopper_fits`` admits; "simple" runs the others) or "hopper_ws" (``hopper_ws``: Gluon
# kernels for sm_90, persistent and warp-specialized, TMA loads for full blocks, for the inputs
# ``hopper_ws_fits`` admits; "hopper" runs the others). "auto" takes the variant measured fastest
# on the GPU's generation (``AUTO_VARIANT``), else "simple".
VARIANTS = ("simple", "persistent", "hopper", "hopper_ws")
KERNELS = os.environ.get("BLOCKATTN_KERNELS", "auto")
# Compute-capability major -> the variant that measured faster than "simple" there (H200, bf16,
# prod shapes, BENCHMARKS.md).
AUTO_VARIANT: dict = {9: "hopper"}
# What the hopper kernels take: 16-bit dtypes, these head dims, blocks of at most 64 rows.
HOPPER_DTYPES = (torch.float16, torch.bfloat16)
HOPPER_HEAD_DIMS = (64, 128)
HOPPER_MAX_BLOCK = 64
# The hopper_ws kernels: 8 warps (a compute warpgroup, a loader warp and 3 idle ones), launched at
# 128 registers (the compute warpgroup raises its own to 232, ``setmaxnreg``), so at most 2
# programs per SM; shared memory (2 stages of tiles, ptxas for sm_90) allows 2 forwards (49 / 98 KB
# at D = 64 / 128) and backwards at D = 64 (74 KB), 1 backward at D = 128 (139 KB). Keyed
# (backward, BLOCK_D > 64).
HOPPER_WS_MAXNREG = 128
HOPPER_WS_PROGRAMS_PER_SM = {(False, False): 2, (False, True): 2, (True, False): 2, (True, True): 1}
# Programs per SM in a persistent grid, by (backward, BLOCK_D > 64): what fits at 4 warps (ptxas
# for sm_90, bf16, 64-row tiles). One-stage tile loop (registers bound them): forward 128, backward
# 202 registers at D = 128. Two-stage tile loop (sm_90+, 2-byte dtypes: the next tile's loads in
# flight during this one's math; shared memory bounds them): forward 57 / 106 KB at D = 64 / 128,
# backward 82 / 147 KB (228 KB per SM; ``tile_loop_stages`` keeps the D = 128 backward at one
# stage). More programs than fit would wait for a slot.
PROGRAMS_PER_SM = {
    1: {(False, False): 4, (False, True): 4, (True, False): 2, (True, True): 2},
    2: {(False, False): 3, (False, True): 2, (True, False): 2, (True, True): 1},
}
# Stages of the persistent kernels' tile loop where the prefetch buffers fit and the prefetch
# measured no slower (H200, prod shapes, ms, one stage -> two): sm_90+, 2-byte dtypes, 64-row
# tiles, forward at D <= 128 (D128 1.206 -> 1.222, D64 1.365 -> 1.363, rotary D128 1.649 ->
# 1.407, D64 1.652 -> 1.509), backward at D <= 64 (2.834 -> 2.688, rotary 3.188 -> 3.204); one
# elsewhere (backward at D = 128: 147 KB of shared memory, one program per SM: 2.747 -> 2.966,
# rotary 3.484 -> 5.637).
PERSISTENT_STAGES = 2


def kernel_variant(x: torch.Tensor) -> str:
    """The block-kernel variant for tensors like ``x`` (see ``KERNELS``)."""
    if KERNELS != "auto":
        if KERNELS not in VARIANTS:
            raise ValueError(f"BLOCKATTN_KERNELS must be auto or one of {', '.join(VARIANTS)}, got {KERNELS!r}")
        return KERNELS
    return AUTO_VARIANT.get(_major(x.device), "simple") if x.is_cuda else "simple"


@functools.lru_cache(maxsize=1)
def hopper_available() -> bool:
    """Whether this Triton has the Gluon API the hopper kernels are written in."""
    try:
        from . import hopper_block  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


@functools.lru_cache(maxsize=1)
def hopper_ws_available() -> bool:
    """Whether this Triton has the Gluon API of the hopper_ws kernels (TMA, mbarriers, warp
    specialization)."""
    if not hopper_available():
        return False
    try:
        from . import hopper_ws  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def hopper_kernel(name: str):
    """The Gluon kernel ``name`` of ``hopper_block`` or ``hopper_ws``, or None where that module
    cannot be imported (then ``hopper_fits`` / ``hopper_ws_fits`` admit nothing and it is never
    launched)."""
    if name.startswith("_hopper_ws_"):
        if not hopper_ws_available():
            return None
        from . import hopper_ws as module
    else:
        if not hopper_available():
            return None
        from . import hopper_block as module
    return getattr(module, name)


def _rows_copyable(t: torch.Tensor) -> bool:
    """16-byte aligned rows of unit channel stride, token and head strides multiples of 16
    elements (what Triton specializes as 16-divisible), as the hopper kernels' copies need."""
    st, sh, sd = t.stride()
    return sd == 1 and st % 16 == 0 and sh % 16 == 0 and t.data_ptr() % 16 == 0


def hopper_admits(q: torch.Tensor, tensors, block_size: int, rot: int, interleaved: bool, int64: bool) -> bool:
    """Whether the hopper kernels compute this call: a 16-bit dtype, head dim 64 or 128, blocks of
    at most 64 rows, no rotary or rotary on all channels in split halves, 32-bit offsets, and
    every ``[T, H, D]`` tensor in ``tensors`` with copyable rows."""
    head_dim = q.shape[2]
    return (q.dtype in HOPPER_DTYPES and head_dim in HOPPER_HEAD_DIMS and block_size <= HOPPER_MAX_BLOCK
            and not int64 and (rot == 0 or (rot == head_dim and not interleaved))
            and all(_rows_copyable(t) for t in tensors))


def hopper_fits(q: torch.Tensor, tensors, block_size: int, rot: int, interleaved: bool, int64: bool) -> bool:
    """Whether the hopper kernels take this call: ``hopper_admits`` it, on an sm_90 GPU."""
    return (q.is_cuda and _major(q.device) == 9 and hopper_admits(q, tensors, block_size, rot, interleaved, int64)
            and hopper_available())


def hopper_ws_admits(q: torch.Tensor, tensors, block_size: int, rot: int, interleaved: bool, int64: bool) -> bool:
    """Whether the hopper_ws kernels compute this call: what ``hopper_admits`` takes, one query
    head per kv head, and in every ``[T, H, D]`` tensor the heads of a row contiguous (head stride
    ``D``: one ``[T, H * D]`` tensor map covers them)."""
    k = tensors[1]
    return (q.shape[1] == k.shape[1]
            and all(t.shape[1] == 1 or t.stride(1) == t.shape[2] for t in tensors)
            and hopper_admits(q, tensors, block_size, rot, interleaved, int64))


def hopper_ws_fits(q: torch.Tensor, tensors, block_size: int, rot: int, interleaved: bool, int64: bool) -> bool:
    """Whether the hopper_ws kernels take this call: ``hopper_ws_admits`` it, on an sm_90 GPU."""
    return (q.is_cuda and _major(q.device) == 9 and hopper_ws_available()
            and hopper_ws_admits(q, tensors, block_size, rot, interleaved, int64))


def block_variant(q: torch.Tensor, tensors, block_size: int, rot: int, interleaved: bool, int64: bool) -> str:
    """The variant a block-kernel call runs: ``kernel_variant``, with "hopper_ws" falling back to
    "hopper" for the calls ``hopper_ws_fits`` does not admit, and "hopper" to "simple" for those
    ``hopper_fits`` does not."""
    variant = kernel_variant(q)
    if variant == "hopper_ws" and not hopper_ws_fits(q, tensors, block_size, rot, interleaved, int64):
        variant = "hopper"
    if variant == "hopper" and not hopper_fits(q, tensors, block_size, rot, interleaved, int64):
        return "simple"
    return variant


@functools.lru_cache(maxsize=16)
def _major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def major_of(x: torch.Tensor) -> int:
    """Compute-capability major version of ``x``'s GPU (9 off the GPU: the Hopper choices)."""
    return _major(x.device) if x.is_cuda else 9


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for CPU tensors under the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def block_grid(meta: dict, programs: int, kv_heads: int, device: torch.device, backward: bool,
               variant: Optional[str] = None) -> tuple:
    """Grid of the block kernels: ``(programs, kv_heads)``, or the resident programs when persistent
    (``variant``: the call's, for "hopper_ws")."""
    if not meta["PERSISTENT"]:
        return (programs, kv_heads)
    if variant == "hopper_ws":
        per_sm = HOPPER_WS_PROGRAMS_PER_SM[backward, meta["BLOCK_D"] > 64]
    else:
        per_sm = PROGRAMS_PER_SM[meta["num_stages"]][backward, meta["BLOCK_D"] > 64]
    return (min(programs * kv_heads, sm_count(device) * per_sm),)


# Register caps (ptxas ``maxnreg``) of the simple block kernels. The forward's rotary kv-head loop
# (D <= 64, see ``block_fwd``) needs 128 to fit 4 programs per SM on every generation. The others
# were measured on the H200 (sm_90, bf16, 64-row tiles, prod shapes, one query head per kv head)
# and apply there, keyed (backward, BLOCK_D, rotary):
# - rotary forward, D = 128: 104 (110 without; 8 bytes spilled): 1.319 -> 1.283 ms (96: 1.49 ms);
# - rotary backward, D = 64: 128 (140 without at the time, 128 since dV is stored early; 3 -> 4
#   programs per SM): 2.774 -> 2.673 ms;
# - plain backward, D = 128: 168 (180 without; 4 bytes spilled; 2 -> 3 programs per SM, which
#   shared memory allows): 2.582 -> 2.397 ms;
# - plain forward, D = 64: 72 (80 without; 16 bytes spilled; 6 -> 7 programs per SM): 1.199 ->
#   1.184 ms (64: 1.519 ms).
HEAD_LOOP_MAXNREG = 128
# The hopper kernels' caps, keyed as ``_SM90_MAXNREG`` (one query head per kv head); none
# measured faster (H200, prod shapes: 168 and 128 on the backward, ms, uncapped -> capped: D128
# 2.042 -> 2.042 / 2.086, D64 2.245 -> 2.244 / 2.243, rotary D128 2.523 -> 2.534 / 2.533, rotary
# D64 2.450 -> 2.463 / 2.571). Their rotary kv-head loop takes ``HEAD_LOOP_MAXNREG`` (168 without,
# no spills at 128: rotary D64 forward 1.186 -> 1.164 ms). The rotary D128 backward, its gradients
# rotated back 32 rows at a time from shared memory (``hopper_block._unrotate_store``), needs 178
# registers uncapped and 168 with 16 bytes spilled: 3 programs per SM instead of 2.
HOPPER_MAXNREG: dict = {(True, 128, True): 168}
_SM90_MAXNREG = {
    (False, 128, True): 104, (True, 64, True): 128, (True, 128, False): 168, (False, 64, False): 72,
}


def head_loop(meta: dict, variant: str) -> bool:
    """Whether a forward launch loops over the kv heads in each program (``HEAD_LOOP``): rotary at
    D <= 64, simple kernels, or hopper ones with one query head per kv head."""
    return (meta["ROT_DIM"] > 0 and meta["BLOCK_D"] <= 64
            and (variant == "simple" or (variant == "hopper" and meta["GROUPS"] == 1)))


def max_registers(meta: dict, variant: str, backward: bool, major: int, itemsize: int) -> Optional[int]:
    """The ``maxnreg`` launch option of a block kernel, or None for ptxas's own choice."""
    if variant == "hopper_ws":
        return HOPPER_WS_MAXNREG
    if variant == "hopper":
        if not backward and head_loop(meta, variant):
            return HEAD_LOOP_MAXNREG
        return HOPPER_MAXNREG.get((backward, meta["BLOCK_D"], meta["ROT_DIM"] > 0)) if meta["GROUPS"] == 1 else None
    if not backward and head_loop(meta, variant):
        return HEAD_LOOP_MAXNREG
    if major != 9 or variant != "simple" or meta["BLOCK_M"] != 64 or itemsize != 2 or meta["GROUPS"] != 1:
        return None
    return _SM90_MAXNREG.get((backward, meta["BLOCK_D"], meta["ROT_DIM"] > 0))


def tile_loop_stages(variant: str, major: int, itemsize: int, block_m: int, block_d: int, backward: bool) -> int:
    """``num_stages`` of a block kernel: 2 for the persistent tile loop where its prefetch
    buffers fit and it measured no slower (``PERSISTENT_STAGES``), else 1 (the simple kernels
    have no loop to pipeline). With more than one, the kernels take ``PREFETCH``: the tile loop
    runs empty slots (masked, they move nothing) instead of branching around them, since
    Triton's pipeliner does not prefetch loads under that branch (sm_90 PTX: no ``cp.async`` at
    any ``num_stages``); without it the loop keeps the branch (on sm_100, dropping it cost the
    128-row backward its ``tcgen05.mma``)."""
    widest = 64 if backward else 128
    if variant == "persistent" and major >= 9 and itemsize == 2 and block_m == 64 and block_d <= widest:
        return PERSISTENT_STAGES
    return 1


def variant_options(variant: str) -> dict:
    """Constexprs of a block-kernel variant."""
    return dict(PERSISTENT=variant in ("persistent", "hopper_ws"))


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


# (key -> plan) of ``block_plan``: a handful of entries per model (dtype, head shape, block size,
# flags); emptied when it reaches ``_MAX_BLOCK_PLANS``.
_BLOCK_PLANS: dict = {}
_MAX_BLOCK_PLANS = 256


def block_plan(
    q: torch.Tensor, k: torch.Tensor, block_size: int, rot: int, interleaved: bool, has_pos: bool,
    causal: bool, backward: bool, inline_seqs: int, int64: bool, variant: Optional[str] = None,
) -> tuple:
    """``(meta, head_loop, key)`` of a block-kernel launch, built once per ``key``.

    ``meta``: the constexprs and launch options (``rot`` is the rotary dim, 0 without rotary);
    ``head_loop``: the forward's ``HEAD_LOOP`` (a grid of one kv head); ``key``: every input that
    ``meta`` depends on, hashable, which the launcher takes as its cache key in place of ``meta``.
    ``meta`` is shared between calls: read it, don't change it. Building it for each call cost
    about a third of the launch's host time, which small batches pay for. ``variant``: the
    call's (``block_variant``), by default ``kernel_variant(q)``.
    """
    key = (q.dtype, q.device, q.shape[2], q.shape[1] // k.shape[1], block_size, rot, interleaved, has_pos,
           causal, backward, inline_seqs, int64, input_precision(q.dtype), variant or kernel_variant(q))
    plan = _BLOCK_PLANS.get(key)
    if plan is None:
        if len(_BLOCK_PLANS) >= _MAX_BLOCK_PLANS:
            _BLOCK_PLANS.clear()
        plan = _BLOCK_PLANS[key] = _build_block_plan(key)
    return plan


def _build_block_plan(key: tuple) -> tuple:
    (dtype, device, head_dim, groups, block_size, rot, interleaved, has_pos, causal, backward, inline_seqs,
     int64, precision, variant) = key
    on_cuda = device.type == "cuda"
    meta = dict(_static_meta(block_size, head_dim, rot, interleaved, has_pos, causal, on_cuda, precision, backward))
    meta.update(INT64=int64, GROUPS=groups, INLINE_SEQS=inline_seqs, **variant_options(variant))
    if variant in ("hopper", "hopper_ws"):
        meta["BLOCK_M"] = 64  # one warpgroup's wgmma rows
    major = _major(device) if on_cuda else 9
    meta["num_stages"] = tile_loop_stages(variant, major, dtype.itemsize, meta["BLOCK_M"], meta["BLOCK_D"], backward)
    meta["PREFETCH"] = meta["num_stages"] > 1
    loop = not backward and head_loop(meta, variant)
    if not backward:
        meta["HEAD_LOOP"] = loop
    regs = max_registers(meta, variant, backward, major, dtype.itemsize)
    if regs:
        meta["maxnreg"] = regs
    return meta, loop, key


def empty_contiguous(x: torch.Tensor) -> torch.Tensor:
    """A buffer of ``x``'s shape and dtype with the standard contiguous strides (those the ops'
    fake implementations give, even where ``x`` is contiguous with other strides on dimensions of
    size 1). ``empty_like``: about half the host time of ``new_empty(x.shape)``, which parses the
    shape (dev CPU 1.6 against 3.0 us), itself half of ``torch.empty(shape, dtype=, device=)``'s."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """Contiguous ``(dq, dk, dv)`` buffers with the inputs' shapes and dtypes."""
    return empty_contiguous(q), empty_contiguous(k), empty_contiguous(v)
