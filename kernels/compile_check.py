"""Compile every kernel variant (the simple block kernels, and for sm_90 the Gluon hopper kernels
and the experimental warp-specialized hopper_ws ones, for sm_100 the warp-specialized Gluon
``sm100_`` kernels; the flash forward, dK/dV and dQ kernels
with pointer and tensor-map loads) for a GPU architecture on a machine without a GPU.

``python -m blockattn_layers.kernels.compile_check --arch sm_100 --out DIR`` writes
``DIR/<variant>.ptx`` for each variant and fails unless the matrix instructions of that
generation are in the PTX: ``mma.sync`` (sm_80), ``wgmma`` (sm_90), ``tcgen05.mma`` (sm_100),
and the tensor-map variants' loads are TMA copies (``cp.async.bulk.tensor``), the hopper kernels
copy their tiles with asynchronous copies (``cp.async``), and the warp-specialized kernels
reallocate registers between partitions (``setmaxnreg``). The sm_100 Gluon kernels must hold
``tcgen05.mma``, a tensor-memory load or store, TMA copies, asynchronous copies, mbarrier waits and
``setmaxnreg``. For each sm_100 and hopper build the registers and spills (ptxas -v), shared
memory, tensor memory and the programs an SM holds at once are printed (``--usage``: for every
build), and a build over budget (``Usage.over_budget``) fails; every Triton build's shared memory
is checked against the same budget. Tiles, launch options and the float32 products' precision are
the ones the launchers use on that generation.
"""
from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

try:
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
except ImportError:  # no Gluon: no hopper variants either (``_hopper_variants``)
    GluonASTSource = GluonJITFunction = None

from .block.bwd import _block_bwd_kernel
from .block.fwd import _block_fwd_kernel, _block_fwd_lse_kernel
from .block.plan import (
    chunked_channels, float32_tile_fits, head_loop, max_registers, overlap_products, split_groups,
)
from .block.variants import (
    HOPPER, HOPPER_PACKED, HOPPER_WS, SIMPLE, SM100, CallFacts, gluon_import_error, sm100_import_error,
    wide_import_error,
)
from .flash.bwd import (
    _flash_bwd_delta_kernel, _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel, _flash_bwd_dq_store_kernel,
    bwd_launch_options,
)
from .flash.fwd import _flash_fwd_kernel, fwd_launch_options
from .common.meta import num_warps, static_meta, tile_extent
from .flash.schedule import flash_tiles

ARCHS = {"sm_80": 80, "sm_89": 89, "sm_90": 90, "sm_100": 100}
EXPECTED = {"sm_80": ("mma.sync",), "sm_89": ("mma.sync",), "sm_90": ("wgmma",), "sm_100": ("tcgen05.mma",)}
# What the fp8 builds' PTX must hold beyond the generation's products: e4m3 pairs converted to
# 16-bit floats in registers (``cvt.rn.f16x2.e4m3x2``), from sm_89 on.
FP8_CONVERT = "e4m3x2"
TMA_COPY = "cp.async.bulk.tensor"
TMA_REDUCE = "cp.reduce.async.bulk.tensor"
SET_MAX_REGISTERS = "setmaxnreg"
ASYNC_COPY = "cp.async.cg.shared.global"
MBARRIER_WAIT = "mbarrier.try_wait"
# What every sm_100 build's PTX must hold beyond tcgen05.mma: a tensor-memory load or store, TMA
# copies (full blocks), asynchronous copies (ragged ones), mbarrier waits, register reallocation.
SM100_REQUIRED = (("tcgen05.ld", "tcgen05.st"), TMA_COPY, ASYNC_COPY, MBARRIER_WAIT, SET_MAX_REGISTERS)
_DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32", "fp8": "*fp8e4nv"}
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Tensor-descriptor arguments of the flash kernels: which tile rows (constexpr) each one loads.
_DESCRIPTORS = {"KD": "BLOCK_N", "VD": "BLOCK_N", "QD": "BLOCK_M", "DOD": "BLOCK_M", "DQD": "BLOCK_M"}


class Build(NamedTuple):
    """One kernel compiled with one set of constexprs and launch options."""

    name: str
    kernel: object
    dtype: str
    constexprs: Dict[str, object]
    options: Dict[str, object]


def _signature(kernel, dtype: str, constexprs: Dict[str, object]) -> Tuple[Dict[str, str], Dict]:
    """Signature and attributes as the JIT sees a contiguous ``[T, H, D]`` launch.

    Unit strides are specialized to the constant 1 and pointers and other strides are
    16-divisible, as the JIT does at run time, so the PTX shows the real (vectorized) loads.
    Descriptor arguments are tensor maps of one head's row tile where ``TMA`` is set, else
    the tensors themselves.
    """
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in _DESCRIPTORS and constexprs.get("TMA"):
            rows = constexprs[_DESCRIPTORS[name]]
            element = "fp32" if name == "DQD" else _DTYPES[dtype][1:]  # the fast backward's dQ sums
            sig[name] = f"tensordesc<{element}[{rows},{constexprs['BLOCK_D']}]>"
            continue
        if name in ("Sched", "Table", "Pos", "Counts", "Sem"):
            sig[name] = "*i32"
        elif name in ("Lse", "Delta", "QD", "KD", "VD"):
            sig[name] = "*fp32"
        elif name == "Offsets":
            sig[name] = "*i64"
        elif name in ("DQA", "DQD"):  # the fast flash backward's float32 dQ sums
            sig[name] = "*fp32"
        elif name == "B":  # the fp8 projection's bias
            sig[name] = "*fp32"
        elif name == "Y":  # ... and its e4m3 output
            sig[name] = "*fp8e4nv"
        elif dtype == "fp8" and name == "O":
            sig[name] = "*bf16"
        elif name[0].isupper():
            sig[name] = _DTYPES[dtype]
        elif name in ("qk_scale", "scale", "log2_theta"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if name[0].isupper() or (name.startswith("stride_") and not name.endswith("d")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _kernel_constexprs(kernel, constexprs: Dict[str, object]) -> Dict[str, object]:
    """The kernel's own constexprs out of ``constexprs``, unit channel strides specialized to 1."""
    names = set(kernel.arg_names)
    out = {name: value for name, value in constexprs.items() if name in names}
    out.update({n: 1 for n in kernel.arg_names if n.startswith("stride_") and n.endswith("d")})
    return out


def _block_constexprs(dim: int, groups: int, block: int, rot: int, has_pos: bool, causal: bool,
                      inline_seqs: int) -> Dict[str, object]:
    return dict(
        HEAD_DIM=dim, GROUPS=groups, BLOCK_M=block, BLOCK_D=dim, BLOCK_R=max(16, rot // 2), BLOCK_P=max(16, dim - rot),
        ROT_DIM=rot, INTERLEAVED=False, HAS_POS=has_pos, IS_CAUSAL=causal, FAST_TRIG=True, INT64=False,
        PRECISION="tf32", INLINE_SEQS=inline_seqs, SLOT=0,
    )


def _block_builds(capability: int) -> Iterator[Build]:
    kernels = (("fwd", _block_fwd_kernel), ("bwd", _block_bwd_kernel))
    for (kind, kernel), dtype, (block, dim), rotary, causal in itertools.product(
        kernels, ("bf16", "fp16", "fp32"), ((64, 128), (64, 64), (128, 128)), (False, True), (False, True),
    ):
        name = f"{kind}_{dtype}_b{block}_d{dim}{'_rope' if rotary else ''}{'_causal' if causal else ''}"
        backward = kernel is not _block_fwd_kernel
        constexprs = _block_constexprs(dim, 1, block, dim if rotary else 0, False, causal, 0)
        constexprs["HEAD_LOOP"] = not backward and head_loop(constexprs, SIMPLE.name)
        if dtype == "fp32" and not float32_tile_fits(block, dim, torch.float32):
            # The op layer runs those float32 blocks on the flash kernels (``block.plan.float32_tile_fits``).
            continue
        size = 4 if dtype == "fp32" else 2
        options = dict(num_warps=num_warps(block, dim, backward), num_stages=1)
        regs = max_registers(constexprs, SIMPLE, backward, capability // 10, size)
        if regs:
            options["maxnreg"] = regs
        yield Build(name, kernel, dtype, _kernel_constexprs(kernel, constexprs), options)


def _lse_builds(capability: int) -> Iterator[Build]:
    """The simple forward that also stores the logsumexp, which runs the forward with gradients of
    blocks of 65-128 tokens at head dims over 128 (their backward runs the flash kernels): 16-bit,
    block 128, D 192 and 256, split-half rotary or none, causal, one or four query heads per kv head.
    Rotary with grouped query heads on sm_90 only: on sm_100 Triton 3.6 builds those dots without
    tcgen05 products (the simple forward without the store too; kernels/PERF_NOTES.md, session 23).
    On sm_90 also the hopper twin, which auto takes there for one query head per kv head (bf16 and
    fp16, D 192 / 256, causal or not, one or two query heads per kv head; no rotary past D128), and
    for grouped query heads at D 128 (four a group, registers capped)."""
    if capability // 10 == 9 and gluon_import_error() is None:
        for dtype, dim, causal, groups in itertools.product(("bf16", "fp16"), (192, 256), (False, True), (1, 2)):
            yield _hopper_build("fwd_lse", dtype, 128, dim, False, causal, groups, False)
        # Grouped query heads at D 128 (their backward: the flash kernel with dQ stored), its registers capped.
        for dtype, causal in itertools.product(("bf16", "fp16"), (False, True)):
            yield _hopper_build("fwd_lse", dtype, 128, 128, False, causal, 4, False)
    for dtype, dim, rotary, causal, groups in itertools.product(
        ("bf16", "fp16"), (192, 256), (False, True), (False, True), (1, 4),
    ):
        if rotary and groups > 1 and capability // 10 != 9:
            continue
        name = f"fwd_lse_{dtype}_b128_d{dim}_g{groups}{'_rope' if rotary else ''}{'_causal' if causal else ''}"
        meta = dict(static_meta(128, dim, dim if rotary else 0, False, False, causal, True, "tf32", False))
        options = {key: meta.pop(key) for key in ("num_warps", "num_stages")}
        meta.update(GROUPS=groups, INT64=False, INLINE_SEQS=0, SLOT=0, HEAD_LOOP=False)
        yield Build(name, _block_fwd_lse_kernel, dtype, _kernel_constexprs(_block_fwd_lse_kernel, meta), options)


def _packed_builds(capability: int) -> Iterator[Build]:
    """The packed variant (the simple kernels on 64-row tiles of blocks of 16 or 32
    rows): bf16, D 64 / 128, rotary or none, causal, in-kernel schedule or table, GQA."""
    kernels = (("fwd", _block_fwd_kernel), ("bwd", _block_bwd_kernel))
    for (kind, kernel), slot, dim, rotary, groups in itertools.product(
        kernels, (16, 32), (64, 128), (False, True), (1, 2),
    ):
        constexprs = _block_constexprs(dim, groups, 64, dim if rotary else 0, rotary and groups > 1, True,
                                       512 if groups == 1 else 0)
        constexprs.update(SLOT=slot, HEAD_LOOP=False)
        name = f"packed_{kind}_bf16_s{slot}_d{dim}{'_rope' if rotary else ''}{'_gqa' if groups > 1 else ''}"
        options = dict(num_warps=num_warps(64, dim, kind == "bwd"), num_stages=1)
        yield Build(name, kernel, "bf16", _kernel_constexprs(kernel, constexprs), options)


def _hopper_build(kind: str, dtype: str, block: int, head_dim: int, rotary: bool, causal: bool, groups: int,
                  int64: bool, variant=HOPPER, rot_dim: Optional[int] = None, interleaved: bool = False) -> Build:
    """A build of ``variant``'s Gluon kernels (hopper or hopper_packed; the caller sets the latter's
    ``SLOT``) with the launch plan's ``HEAD_LOOP``, register cap and ``SPLIT_GROUPS``; ``kind``:
    fwd, fwd_lse (the forward that also stores the logsumexp) or bwd. Rotary over ``rot_dim``
    channels (default all), in split halves or ``interleaved`` pairs."""
    from .sm90.block import _hopper_bwd_kernel, _hopper_fwd_kernel, _hopper_fwd_lse_kernel

    kernel = {"fwd": _hopper_fwd_kernel, "fwd_lse": _hopper_fwd_lse_kernel, "bwd": _hopper_bwd_kernel}[kind]
    forward = kind != "bwd"
    rot = (rot_dim or head_dim) if rotary else 0
    constexprs = _block_constexprs(head_dim, groups, block, rot, rotary and causal, causal, 512 if groups == 2 else 0)
    constexprs.update(BLOCK_D=tile_extent(head_dim), INT64=int64, INTERLEAVED=interleaved)
    constexprs["HEAD_LOOP"] = forward and head_loop(constexprs, variant.name)
    options = dict(num_warps=block // 16, num_stages=1)
    regs = max_registers(constexprs, variant, kind == "bwd", 9, 2, kind == "fwd_lse")
    if regs:
        options["maxnreg"] = regs
    if forward:
        constexprs["SPLIT_GROUPS"] = 1
        if split_groups(constexprs, variant, False):
            constexprs.update(SPLIT_GROUPS=groups, GROUPS=1)
        constexprs["CHUNKED"] = chunked_channels(constexprs, variant, False)
    if kind == "bwd":
        constexprs.update(OVERLAP=overlap_products(constexprs, variant, True), GROUP_PROGRAMS=0)
    rope = "" if not rotary else "_rope" if rot == head_dim else f"_rope{rot}"
    rope += "i" if interleaved else ""
    name = (f"{kind}_{dtype}_b{block}_d{head_dim}{rope}{'_causal' if causal else ''}"
            f"{'_gqa' if groups > 1 else ''}{'_int64' if int64 else ''}_hopper")
    return Build(name, kernel, dtype, _kernel_constexprs(kernel, constexprs), options)


def _hopper_builds(capability: int) -> Iterator[Build]:
    """The Gluon kernels of the hopper variant (sm_90 only): 16-bit dtypes, D 64 / 128 on 64-row
    tiles with rotary, causal, one or two query heads per kv head, the block table or the in-kernel
    schedule; then, in bf16, the other tiles the variant admits (``HOPPER.call_reasons``): 128-row
    tiles (two warpgroups, causal; D64 too, where the launch plan caps registers), D 32, 96 (padded
    to 128) and 256, 64-bit addressing, and rotary over half the channels."""
    if capability // 10 != 9 or gluon_import_error() is not None:
        return
    for kind, dtype, dim, rotary, causal, groups in itertools.product(
        ("fwd", "bwd"), ("bf16", "fp16"), (64, 128), (False, True), (False, True), (1, 2),
    ):
        yield _hopper_build(kind, dtype, 64, dim, rotary, causal, groups, False)
    for kind, block, dim, rotary, groups in itertools.product(
        ("fwd", "bwd"), (64, 128), (32, 64, 96, 128, 256), (False, True), (1, 2),
    ):
        facts = CallFacts("cuda", 9, torch.bfloat16, dim, groups, block, dim if rotary else 0, False, False,
                          backward=kind == "bwd")
        if (block == 128 or dim not in (64, 128)) and not HOPPER.call_reasons(facts):
            yield _hopper_build(kind, "bf16", block, dim, rotary, block == 128, groups, False)
    for kind in ("fwd", "bwd"):
        yield _hopper_build(kind, "bf16", 64, 128, True, False, 1, True)
    # Partial rotary (half the channels; pass-through columns in the half tiles).
    for kind, (block, dim), groups in itertools.product(("fwd", "bwd"), ((64, 64), (64, 96), (128, 128)), (1, 2)):
        facts = CallFacts("cuda", 9, torch.bfloat16, dim, groups, block, dim // 2, False, False,
                          backward=kind == "bwd")
        if not HOPPER.call_reasons(facts):
            yield _hopper_build(kind, "bf16", block, dim, True, block == 128, groups, False, rot_dim=dim // 2)
    # Interleaved rotary pairs.
    for kind, (block, dim, rot, groups) in itertools.product(("fwd", "bwd"), ((64, 64, 64, 1), (128, 96, 64, 2))):
        yield _hopper_build(kind, "bf16", block, dim, True, False, groups, False, rot_dim=rot, interleaved=True)
    # hopper_heads' launches: one query head per kv head, a group of 4 programs adjacent.
    for dim, interleaved in ((96, False), (128, True)):
        build = _hopper_build("bwd", "bf16", 128, dim, True, True, 1, False, interleaved=interleaved)
        yield build._replace(name=build.name.replace("_hopper", "_group4_hopper"),
                             constexprs=dict(build.constexprs, GROUP_PROGRAMS=4))


# Name ending of the hopper_packed builds (not ``_hopper``: ``--only _hopper`` selects the hopper variant's).
PACKED_HOPPER_SUFFIX = "_hpacked"


def _hopper_packed_builds(capability: int) -> Iterator[Build]:
    """The hopper kernels on 64-row tiles of blocks of 16 or 32 rows (the ``hopper_packed`` variant,
    sm_90 only): bf16 and fp16, every head dim of the grid that ``HOPPER_PACKED.call_reasons``
    admits, rotary or not, one or four query heads per kv head, causal or not, the in-kernel
    schedule or the table."""
    if capability // 10 != 9 or gluon_import_error() is not None:
        return
    for kind, slot, dim, rotary, groups, causal in itertools.product(
        ("fwd", "bwd"), (16, 32), (32, 64, 96, 128, 256), (False, True), (1, 4), (False, True),
    ):
        facts = CallFacts("cuda", 9, torch.bfloat16, dim, groups, slot, dim if rotary else 0, False, False,
                          backward=kind == "bwd")
        if HOPPER_PACKED.call_reasons(facts):
            continue
        for dtype in ("bf16", "fp16") if (dim, groups, rotary) == (128, 1, False) else ("bf16",):
            build = _hopper_build(kind, dtype, 64, dim, rotary, causal, groups, False, HOPPER_PACKED)
            constexprs = dict(build.constexprs, SLOT=slot, INLINE_SEQS=512 if causal else 0)
            name = build.name.replace("_b64_", f"_s{slot}_").replace("_hopper", PACKED_HOPPER_SUFFIX)
            options = dict(num_warps=4, num_stages=1)
            regs = max_registers(constexprs, HOPPER_PACKED, kind == "bwd", 9, 2)
            if regs:
                options["maxnreg"] = regs
            yield Build(name, build.kernel, dtype, constexprs, options)


# Name ending of the hopper_wide backward's builds.
WIDE_HOPPER_SUFFIX = "_hwide"


def _hopper_wide_builds(capability: int) -> Iterator[Build]:
    """The hopper_wide backward (``sm90.wide``, sm_90 only), blocks of 128 rows: D256 (bf16, fp16;
    causal with 64-bit addressing) and D192 (tiles padded to 256 channels, causal); rotary at D256
    in split halves (at given positions, causal) and interleaved over 128 channels; a group of 4 query
    heads' programs adjacent (``GROUP_PROGRAMS``) with their sums in the launch (``GROUP_SUMS``, taken
    without rotary) plain and causal with 64-bit addressing, and without them with split rotary."""
    if capability // 10 != 9 or wide_import_error() is not None:
        return
    from .sm90.wide import _hopper_wide_bwd_kernel

    for dtype, dim, causal, int64, rot, interleaved, has_pos, group, sums in (
        ("bf16", 256, False, False, 0, False, False, 0, False), ("fp16", 256, False, False, 0, False, False, 0, False),
        ("bf16", 256, True, True, 0, False, False, 0, False), ("bf16", 192, True, False, 0, False, False, 0, False),
        ("bf16", 256, True, False, 256, False, True, 0, False), ("bf16", 256, False, False, 128, True, False, 0, False),
        ("bf16", 256, False, False, 0, False, False, 4, True), ("bf16", 256, True, True, 0, False, False, 4, True),
        ("bf16", 256, False, False, 256, False, False, 4, False),
    ):
        constexprs = dict(HEAD_DIM=dim, BLOCK_M=128, BLOCK_D=256, ROT_DIM=rot, INTERLEAVED=interleaved,
                          HAS_POS=has_pos, IS_CAUSAL=causal, INLINE_SEQS=0, INT64=int64, GROUP_PROGRAMS=group,
                          GROUP_SUMS=sums)
        rotary = (f"_rope{rot}" if rot else "") + ("_interleaved" if interleaved else "") + ("_pos" if has_pos else "")
        grouped = (f"_sums{group}" if sums else f"_group{group}") if group else ""
        name = (f"bwd_{dtype}_b128_d{dim}{rotary}{'_causal' if causal else ''}{'_int64' if int64 else ''}"
                f"{grouped}{WIDE_HOPPER_SUFFIX}")
        yield Build(name, _hopper_wide_bwd_kernel, dtype, constexprs, dict(num_warps=8, num_stages=1))


def _hopper_ws_builds(capability: int) -> Iterator[Build]:
    """The experimental persistent, warp-specialized Gluon kernels (sm_90 only): 16-bit dtypes,
    D 64 / 128, rotary with given or implicit positions, causal, the block table or the in-kernel
    schedule."""
    if capability // 10 != 9 or gluon_import_error() is not None:
        return
    from .experimental.sm90_ws import _hopper_ws_bwd_kernel, _hopper_ws_fwd_kernel

    for (kind, kernel), dtype, dim, rotary, causal in itertools.product(
        (("fwd", _hopper_ws_fwd_kernel), ("bwd", _hopper_ws_bwd_kernel)), ("bf16", "fp16"), (64, 128),
        (False, True), (False, True),
    ):
        constexprs = _block_constexprs(dim, 1, 64, dim if rotary else 0, rotary and causal, causal,
                                       512 if causal else 0)
        options = dict(num_warps=4, num_stages=1, maxnreg=max_registers(constexprs, HOPPER_WS, kind == "bwd", 9, 2))
        name = f"ws_{kind}_{dtype}_d{dim}{'_rope' if rotary else ''}{'_causal' if causal else ''}"
        yield Build(name, kernel, dtype, _kernel_constexprs(kernel, constexprs), options)


# The sm_100 builds the CI test compiles (a representative subset; the CLI builds them all).
SM100_CI = ("sm100_fwd_bf16_m128_d128_rope_causal_gqa_inline", "sm100_bwd_bf16_m128_d128_rope_causal_gqa_inline",
            "sm100_fwd_bf16_m128_d128_table", "sm100_bwd_bf16_m128_d128_table")


def _sm100_builds(capability: int) -> Iterator[Build]:
    """The warp-specialized Gluon kernels for Blackwell (sm_100 only): forward and backward, fp16 /
    bf16, 128- and 64-row tiles at D 64 / 128, rotary (given positions under
    causal, implicit ones otherwise), causal, one or two query heads per kv head, the block table
    or the in-kernel schedule. Launch options: 4 warps for the default partition, no register cap."""
    if capability != 100 or sm100_import_error() is not None:
        return
    from .sm100.block import _sm100_bwd_kernel, _sm100_fwd_kernel

    for (kind, kernel), dtype, (block, dim), rotary, causal, groups, inline in itertools.product(
        (("fwd", _sm100_fwd_kernel), ("bwd", _sm100_bwd_kernel)), ("bf16", "fp16"),
        ((128, 128), (128, 64), (64, 128), (64, 64)),
        (False, True), (False, True), (1, 2), (False, True),
    ):
        facts = CallFacts("cuda", 10, _TORCH_DTYPES[dtype], dim, groups, block, dim if rotary else 0, False, False,
                          rotary and causal)
        if SM100.call_reasons(facts):
            continue  # not admitted (the variant's declaration says why)
        constexprs = _block_constexprs(dim, groups, block, dim if rotary else 0, rotary and causal, causal,
                                       512 if inline else 0)
        name = (f"sm100_{kind}_{dtype}_m{block}_d{dim}{'_rope' if rotary else ''}{'_causal' if causal else ''}"
                f"{'_gqa' if groups > 1 else ''}{'_inline' if inline else '_table'}")
        yield Build(name, kernel, dtype, _kernel_constexprs(kernel, constexprs), dict(num_warps=4, num_stages=1))


def _flash_builds(capability: int) -> Iterator[Build]:
    """GQA (2 query heads per kv head), causal, D = 128: plain heads (tensor-map loads from sm_90
    on) and half rotary (pointer loads), with the tiles and options of full attention; the
    backward's deterministic passes and the fast one's (the dK/dV pass with atomic dQ, the delta
    and dQ store passes). On sm_90, whose tiles at D > 128 are their own, also bf16 D = 256 plain
    heads (their shared memory is checked against the budget, as every Triton build's)."""
    major = capability // 10
    kinds = (("fwd", "fwd", _flash_fwd_kernel), ("dkv", "dkv", _flash_bwd_dkdv_kernel),
             ("dq", "dq", _flash_bwd_dq_kernel), ("dkv_fast", "dkv_fast", _flash_bwd_dkdv_kernel),
             ("dq_store", "dq", _flash_bwd_dq_store_kernel))
    wide = [(256, "bf16", 0)] if major == 9 else []
    for dim, dtype, rot in [(128, d, r) for d, r in itertools.product(("bf16", "fp16", "fp32"), (0, 64))] + wide:
        size = 4 if dtype == "fp32" else 2
        tiles = flash_tiles(dim, "cuda", size, major, rotary=rot > 0)
        for kind, tile_kind, kernel in kinds:
            outer, inner = tiles[tile_kind]
            block_m, block_n = (inner, outer) if tile_kind.startswith("dkv") else (outer, inner)
            tma = rot == 0 and major >= 9 and kind != "dq_store"
            constexprs = dict(
                HEAD_DIM=dim, GROUPS=2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=dim, BLOCK_R=max(16, rot // 2),
                BLOCK_P=dim - rot, ROT_DIM=rot, INTERLEAVED=False, HAS_POS=False, IS_CAUSAL=True,
                FAST_TRIG=True, INT64=False, PRECISION="tf32", TMA=tma, DQ_ATOMIC=kind == "dkv_fast",
                DQ_TMA=tma and kind == "dkv_fast" and dtype != "fp32",
            )
            if kind == "fwd":
                options = fwd_launch_options(outer, dim, "cuda", major)
            elif kind == "dq_store":
                options = dict(num_warps=4)
            else:
                options = bwd_launch_options(outer, dim, "cuda", inner if tile_kind.startswith("dkv") else 64,
                                             dq_atomic=kind == "dkv_fast")
            name = f"flash_{kind}_{dtype}_d{dim}_causal_gqa{'_rope' if rot else '_tma' if tma else ''}"
            yield Build(name, kernel, dtype, _kernel_constexprs(kernel, constexprs), options)
        if rot == 0 and dim == 128:
            constexprs = dict(HEAD_DIM=dim, BLOCK_M=64, BLOCK_D=dim, INT64=False)
            yield Build(f"flash_delta_{dtype}_d{dim}", _flash_bwd_delta_kernel, dtype, constexprs, dict(num_warps=4))


# Builds with no matrix products: the fast flash backward's row-wise passes, the rotation pass of
# ``rotated`` and the group sums of ``Variant.group_partials``.
_NO_PRODUCTS = ("flash_delta_", "flash_dq_store_", "rotation_", "head_sums_")


def required_products(build: Build, arch: str) -> Tuple[str, ...]:
    """The generation's matrix instruction, for every build that multiplies matrices; the fast
    dK/dV pass must also add dQ's terms atomically (``red`` or ``atom`` ``.add.f32``), and with
    tensor-map reductions (``DQ_TMA``) add whole query tiles' terms that way."""
    if build.name.startswith(_NO_PRODUCTS):
        return ()
    if build.name.startswith("flash_dkv_fast_"):
        atomic = ("atom.global.gpu.relaxed.add", "red.global.gpu.relaxed.add", "atom.global.add", "red.global.add")
        reduce = build.constexprs.get("DQ_TMA")
        return EXPECTED[arch] + (atomic,) + ((TMA_REDUCE,) if reduce else ())
    return EXPECTED[arch]


def _flash_forward_loop_builds(kernel, prefix: str, loops: Dict[str, dict]) -> Iterator[Build]:
    """One Gluon flash forward on 128-row tiles: bf16 / fp16, D 64 / 128, causal GQA or neither, each
    consumer loop of ``loops`` (name suffix -> its constexprs: ``OVERLAP``, ``PINGPONG``, ...)."""
    for dtype, dim, (causal, groups), loop in itertools.product(
            ("bf16", "fp16"), (64, 128), ((False, 1), (True, 4)), loops):
        constexprs = dict(HEAD_DIM=dim, GROUPS=groups, BLOCK_M=128, BLOCK_N=128, IS_CAUSAL=causal, **loops[loop])
        yield Build(f"{prefix}_{dtype}_d{dim}{'_causal_gqa' if causal else ''}{loop}", kernel, dtype, constexprs,
                    dict(num_warps=4))


def _flash_gluon_builds(capability: int) -> Iterator[Build]:
    """The warp-specialized Gluon flash forward (``sm90.flash_fwd``, and its persistent form
    ``sm90.flash_persistent``), sm_90 only: D 64 and 128, bf16 / fp16, causal with GQA or neither, each
    consumer loop, the tiles they launch; then the flash backward's dK/dV pass (``sm90.flash_bwd``)."""
    if capability // 10 != 9 or gluon_import_error() is not None:
        return
    from .sm90.flash_fwd import _flash_fwd_ws_kernel
    from .sm90.flash_persistent import _flash_fwd_persistent_kernel

    # Consumer loops. The per-tile form's ping-pong overlaps too; the persistent form's takes turns in the
    # serial loop, its k and v may sit on barriers of their own (SPLIT_KV), and in the serial loop a block's
    # last key tile may be its last keys (SHIFT_LAST; the overlapped loop spills 324-332 B with it at D 128), and
    # the previous item's query buffer may go back after the first Q K^T (EARLY_RELEASE), and items of one key
    # tile may reuse the previous item's (SHARE_KV, with both of the last two), and the consumers' threads may hand
    # slots back one by one (THREAD_RELEASE, on the D 128 default loop: overlapped on split barriers).
    loops = {"": dict(OVERLAP=False, PINGPONG=False), "_overlap": dict(OVERLAP=True, PINGPONG=False),
             "_pingpong": dict(OVERLAP=True, PINGPONG=True)}
    yield from _flash_forward_loop_builds(_flash_fwd_ws_kernel, "flash_gluon_fwd", loops)
    plain = dict(OVERLAP=False, PINGPONG=False, SPLIT_KV=False, SHIFT_LAST=False, EARLY_RELEASE=False, SHARE_KV=False,
                 THREAD_RELEASE=False)
    loops = {"": plain, "_overlap": dict(plain, OVERLAP=True), "_pingpong": dict(plain, PINGPONG=True),
             "_split_kv": dict(plain, SPLIT_KV=True), "_overlap_split_kv": dict(plain, OVERLAP=True, SPLIT_KV=True),
             "_shift_last": dict(plain, SHIFT_LAST=True),
             "_split_kv_shift_last": dict(plain, SPLIT_KV=True, SHIFT_LAST=True),
             "_early_release": dict(plain, EARLY_RELEASE=True),
             "_share_kv": dict(plain, SPLIT_KV=True, EARLY_RELEASE=True, SHARE_KV=True),
             "_thread_release": dict(plain, OVERLAP=True, SPLIT_KV=True, THREAD_RELEASE=True)}
    yield from _flash_forward_loop_builds(_flash_fwd_persistent_kernel, "flash_gluon_fwd_persistent", loops)
    # 192-row items, three consumer warpgroups (THREE_CONSUMER_HEAD_DIMS): full attention at D 64 (each loop but
    # the overlapped one on split barriers: ptxas spills 360-408 B at three consumers' 160 registers); at D 128
    # (a candidate) on 64-row key tiles (THREE_CONSUMER_KEY_ROWS).
    for (causal, groups), loop in itertools.product(((False, 1), (True, 4)), list(loops)[:4]):
        constexprs = dict(HEAD_DIM=64, GROUPS=groups, BLOCK_M=192, BLOCK_N=128, IS_CAUSAL=causal, **loops[loop])
        name = f"flash_gluon_fwd_persistent_m192_bf16_d64{'_causal_gqa' if causal else ''}{loop}"
        yield Build(name, _flash_fwd_persistent_kernel, "bf16", constexprs, dict(num_warps=4))
    for causal, groups in ((False, 1), (True, 4)):
        constexprs = dict(HEAD_DIM=128, GROUPS=groups, BLOCK_M=192, BLOCK_N=64, IS_CAUSAL=causal, **plain)
        name = f"flash_gluon_fwd_persistent_m192_n64_bf16_d128{'_causal_gqa' if causal else ''}"
        yield Build(name, _flash_fwd_persistent_kernel, "bf16", constexprs, dict(num_warps=4))
    from .sm90.flash_bwd import TILE_M as BWD_M, TILE_N as BWD_N, _flash_bwd_ws_kernel, dq_cols, pair_chunk
    _NO_UNROTATE = dict(ROT_DIM=0, INTERLEAVED=False, HAS_POS=False, PAIR_CHUNK=0)

    for dtype, dim, (causal, groups), ordered in itertools.product(
            ("bf16", "fp16"), (64, 128), ((False, 1), (True, 4)), (False, True)):
        constexprs = dict(HEAD_DIM=dim, DIM=dim, GROUPS=groups, BLOCK_M=BWD_M, BLOCK_N=BWD_N, DQ_COLS=dq_cols(dim),
                          IS_CAUSAL=causal, DETERMINISTIC=ordered, DQ_WRITER=True, P_BESIDE_DP=False, WITH_DQ=True,
                          ROWS_BY_LOADER=False, THREAD_RELEASE=False, DQ_LAG=False,
                          STAGGER=False, LEAN_WRITER=False, DQ_STORE=False, DELTA_IN_KERNEL=False, **_NO_UNROTATE)
        name = f"flash_gluon_bwd_{dtype}_d{dim}{'_causal_gqa' if causal else ''}{'_deterministic' if ordered else ''}"
        yield Build(name, _flash_bwd_ws_kernel, dtype, constexprs, dict(num_warps=4))
    # Candidates: dQ's adds by the consumers themselves (no writer partition), P computed beside
    # dP's product (P_BESIDE_DP), and dK, dV without dQ's terms (WITH_DQ off).
    for dim, ordered, writer, early_p, with_dq in (
            (64, False, False, False, True), (64, True, False, False, True), (128, False, False, False, True),
            (128, True, False, False, True), (64, False, True, True, True), (128, False, True, True, True),
            (128, True, True, True, True), (64, False, True, False, False), (128, False, True, False, False)):
        constexprs = dict(HEAD_DIM=dim, DIM=dim, GROUPS=1, BLOCK_M=BWD_M, BLOCK_N=BWD_N, DQ_COLS=dq_cols(dim),
                          IS_CAUSAL=False, DETERMINISTIC=ordered, DQ_WRITER=writer, P_BESIDE_DP=early_p,
                          WITH_DQ=with_dq, ROWS_BY_LOADER=False, THREAD_RELEASE=False, DQ_LAG=False,
                          STAGGER=False, LEAN_WRITER=False, DQ_STORE=False, DELTA_IN_KERNEL=False, **_NO_UNROTATE)
        name = (f"flash_gluon_bwd{'' if writer else '_consumer_adds'}{'_pbesidedp' if early_p else ''}"
                f"{'' if with_dq else '_dkdv_only'}_bf16_d{dim}{'_deterministic' if ordered else ''}")
        yield Build(name, _flash_bwd_ws_kernel, "bf16", constexprs, dict(num_warps=4))
    # lse and delta copied by the loader (ROWS_BY_LOADER): the fast and ordered passes, causal GQA, D 128 and 64;
    # at D 128 also with the slots released by every consumer thread (THREAD_RELEASE).
    for dim, (causal, groups), ordered, threads in itertools.product(
            (64, 128), ((False, 1), (True, 4)), (False, True), (False, True)):
        if threads and dim != 128:
            continue
        constexprs = dict(HEAD_DIM=dim, DIM=dim, GROUPS=groups, BLOCK_M=BWD_M, BLOCK_N=BWD_N, DQ_COLS=dq_cols(dim),
                          IS_CAUSAL=causal, DETERMINISTIC=ordered, DQ_WRITER=True, P_BESIDE_DP=False, WITH_DQ=True,
                          ROWS_BY_LOADER=True, THREAD_RELEASE=threads, DQ_LAG=False,
                          STAGGER=False, LEAN_WRITER=False, DQ_STORE=False, DELTA_IN_KERNEL=False, **_NO_UNROTATE)
        name = (f"flash_gluon_bwd_lse_by_loader{'_thread_release' if threads else ''}_bf16_d{dim}"
                f"{'_causal_gqa' if causal else ''}{'_deterministic' if ordered else ''}")
        yield Build(name, _flash_bwd_ws_kernel, "bf16", constexprs, dict(num_warps=4))
    # Each step's dQ product the step before's (DQ_LAG), at D 128 on the rows by the loader, thread releases and
    # the writer on fewer registers (LEAN_WRITER), and with warpgroup 1 starting half a step behind (STAGGER);
    # the lean writer alone on the default form.
    for (causal, groups), ordered, stagger in itertools.product(((False, 1), (True, 4)), (False, True), (False, True)):
        constexprs = dict(HEAD_DIM=128, DIM=128, GROUPS=groups, BLOCK_M=BWD_M, BLOCK_N=BWD_N, DQ_COLS=dq_cols(128),
                          IS_CAUSAL=causal, DETERMINISTIC=ordered, DQ_WRITER=True, P_BESIDE_DP=False, WITH_DQ=True,
                          ROWS_BY_LOADER=True, THREAD_RELEASE=True, DQ_LAG=True, STAGGER=stagger,
                          LEAN_WRITER=True, DQ_STORE=False, DELTA_IN_KERNEL=False, **_NO_UNROTATE)
        name = (f"flash_gluon_bwd_{'stagger' if stagger else 'dq_lag'}_bf16_d128"
                f"{'_causal_gqa' if causal else ''}{'_deterministic' if ordered else ''}")
        yield Build(name, _flash_bwd_ws_kernel, "bf16", constexprs, dict(num_warps=4))
    for causal, groups in ((False, 1), (True, 4)):
        constexprs = dict(HEAD_DIM=128, DIM=128, GROUPS=groups, BLOCK_M=BWD_M, BLOCK_N=BWD_N, DQ_COLS=dq_cols(128),
                          IS_CAUSAL=causal, DETERMINISTIC=False, DQ_WRITER=True, P_BESIDE_DP=False, WITH_DQ=True,
                          ROWS_BY_LOADER=False, THREAD_RELEASE=False, DQ_LAG=False, STAGGER=False, LEAN_WRITER=True,
                          DQ_STORE=False, DELTA_IN_KERNEL=False, **_NO_UNROTATE)
        yield Build(f"flash_gluon_bwd_lean_writer_bf16_d128{'_causal_gqa' if causal else ''}", _flash_bwd_ws_kernel,
                    "bf16", constexprs, dict(num_warps=4))
    # dQ stored where one key tile holds a whole block (DQ_STORE): by the consumers at D 128 (no writer partition;
    # also with the rows by the loader and thread releases, _by_loader), the terms' sum by the writer at D 64; and
    # with the delta rows computed in the kernel (DELTA_IN_KERNEL, _delta).
    for dim, (causal, groups), form in itertools.product((64, 128), ((False, 1), (True, 4)), ("", "_by_loader",
                                                                                            "_delta")):
        if form == "_by_loader" and dim == 64:
            continue
        constexprs = dict(HEAD_DIM=dim, DIM=dim, GROUPS=groups, BLOCK_M=BWD_M, BLOCK_N=BWD_N, DQ_COLS=dq_cols(dim),
                          IS_CAUSAL=causal, DETERMINISTIC=False, DQ_WRITER=dq_cols(dim) == dim, P_BESIDE_DP=False,
                          WITH_DQ=True, ROWS_BY_LOADER=form == "_by_loader", THREAD_RELEASE=form == "_by_loader",
                          DQ_LAG=False, STAGGER=False, LEAN_WRITER=False, DQ_STORE=True,
                          DELTA_IN_KERNEL=form == "_delta", **_NO_UNROTATE)
        yield Build(f"flash_gluon_bwd_dq_store{form}_bf16_d{dim}{'_causal_gqa' if causal else ''}",
                    _flash_bwd_ws_kernel, "bf16", constexprs, dict(num_warps=4))
    # dQ and dK rotated back in the kernel (ROT_DIM, UNROTATE) with dQ stored at D 128, as the defaults run it (rows by
    # the loader, thread releases, the delta rows in the kernel without causal masks): interleaved over every channel,
    # split halves over 64, interleaved over 32 at given positions, split halves over every channel on q and k in the
    # paired-chunk order (PAIR_CHUNK).
    for (causal, groups), (rot, interleaved, has_pos) in itertools.product(
            ((False, 4), (True, 4)), ((128, True, False), (64, False, False), (32, True, True), (128, False, False))):
        constexprs = dict(HEAD_DIM=128, DIM=128, GROUPS=groups, BLOCK_M=BWD_M, BLOCK_N=BWD_N, DQ_COLS=dq_cols(128),
                          IS_CAUSAL=causal, DETERMINISTIC=False, DQ_WRITER=False, P_BESIDE_DP=False, WITH_DQ=True,
                          ROWS_BY_LOADER=True, THREAD_RELEASE=True, DQ_LAG=False, STAGGER=False, LEAN_WRITER=False,
                          DQ_STORE=True, DELTA_IN_KERNEL=not causal, ROT_DIM=rot, INTERLEAVED=interleaved,
                          HAS_POS=has_pos, PAIR_CHUNK=dq_cols(128) // 2 if rot == 128 and not interleaved else 0)
        form = f"{'i' if interleaved else 's'}{rot}{'_pos' if has_pos else ''}"
        yield Build(f"flash_gluon_bwd_dq_store_unrotate_{form}_bf16_d128{'_causal' if causal else ''}_gqa",
                    _flash_bwd_ws_kernel, "bf16", constexprs, dict(num_warps=4))
    # D 96 in 128-wide tiles with dQ stored (PADDED_HEAD_DIMS: tensor maps of one head's [rows, 1, 96] boxes), as
    # the defaults run it: GQA with the delta rows in the kernel, causal GQA with the delta pass, interleaved rotary
    # rotated back over every channel, and causal split halves over every channel on q and k in the paired-chunk
    # order of 16 (each rotary half's columns stored apart through maps of [rows, 1, 48] half-heads).
    for causal, rot, interleaved in ((False, 0, False), (True, 0, False), (False, 96, True), (True, 96, False)):
        constexprs = dict(HEAD_DIM=128, DIM=96, GROUPS=4, BLOCK_M=BWD_M, BLOCK_N=BWD_N, DQ_COLS=dq_cols(96),
                          IS_CAUSAL=causal, DETERMINISTIC=False, DQ_WRITER=False, P_BESIDE_DP=False, WITH_DQ=True,
                          ROWS_BY_LOADER=True, THREAD_RELEASE=True, DQ_LAG=False, STAGGER=False, LEAN_WRITER=False,
                          DQ_STORE=True, DELTA_IN_KERNEL=not causal, ROT_DIM=rot, INTERLEAVED=interleaved,
                          HAS_POS=False, PAIR_CHUNK=pair_chunk(96, rot, interleaved) if rot else 0)
        form = f"_unrotate_{'i' if interleaved else 's'}96" if rot else ""
        if constexprs["PAIR_CHUNK"]:
            form += f"_paired{constexprs['PAIR_CHUNK']}"
        yield Build(f"flash_gluon_bwd_dq_store{form}_bf16_d96{'_causal' if causal else ''}_gqa",
                    _flash_bwd_ws_kernel, "bf16", constexprs, dict(num_warps=4))
    # Split halves over part of the channels in paired chunks (PAIRED_PARTIAL), the pass-through columns among a
    # consumer's rotary ones stored apart: 48 of 96 channels (chunks of 8, the piece in consumer 0, GQA with the
    # delta rows in the kernel), 96 of 128 (chunks of 16, the piece in consumer 1, causal).
    for dim, rot, causal in ((96, 48, False), (128, 96, True)):
        constexprs = dict(HEAD_DIM=128, DIM=dim, GROUPS=4, BLOCK_M=BWD_M, BLOCK_N=BWD_N, DQ_COLS=dq_cols(dim),
                          IS_CAUSAL=causal, DETERMINISTIC=False, DQ_WRITER=False, P_BESIDE_DP=False, WITH_DQ=True,
                          ROWS_BY_LOADER=True, THREAD_RELEASE=True, DQ_LAG=False, STAGGER=False, LEAN_WRITER=False,
                          DQ_STORE=True, DELTA_IN_KERNEL=not causal, ROT_DIM=rot, INTERLEAVED=False,
                          HAS_POS=False, PAIR_CHUNK=pair_chunk(dim, rot, False))
        yield Build(f"flash_gluon_bwd_dq_store_unrotate_s{rot}_paired{constexprs['PAIR_CHUNK']}_bf16_d{dim}"
                    f"{'_causal' if causal else ''}_gqa", _flash_bwd_ws_kernel, "bf16", constexprs, dict(num_warps=4))
    # dK, dV without dQ's terms over 128 query rows a step at D 64 (DKDV_ONLY_WIDE_HEAD_DIMS).
    for causal, groups in ((False, 1), (True, 4)):
        constexprs = dict(HEAD_DIM=64, DIM=64, GROUPS=groups, BLOCK_M=128, BLOCK_N=BWD_N, DQ_COLS=dq_cols(64),
                          IS_CAUSAL=causal, DETERMINISTIC=False, DQ_WRITER=True, P_BESIDE_DP=False, WITH_DQ=False,
                          ROWS_BY_LOADER=False, THREAD_RELEASE=False, DQ_LAG=False,
                          STAGGER=False, LEAN_WRITER=False, DQ_STORE=False, DELTA_IN_KERNEL=False, **_NO_UNROTATE)
        yield Build(f"flash_gluon_bwd_dkdv_only_m128_bf16_d64{'_causal_gqa' if causal else ''}",
                    _flash_bwd_ws_kernel, "bf16", constexprs, dict(num_warps=4))


def required_copies(build: Build) -> Tuple[str, ...]:
    """Copy instructions a build's PTX must hold: TMA copies for tensor-map loads, asynchronous
    copies for the hopper kernels (every tile); for the warp-specialized kernels TMA copies (full
    blocks), asynchronous copies (ragged ones) and the partitions' register reallocation."""
    if build.name.startswith("ws_"):
        return (TMA_COPY, ASYNC_COPY, SET_MAX_REGISTERS)
    if build.name.startswith(("flash_gluon_", "fp8_gluon_", "fp8_linear_gluon_")):
        return (TMA_COPY, MBARRIER_WAIT, SET_MAX_REGISTERS)
    if build.name.startswith("sm100_"):
        return SM100_REQUIRED
    if build.constexprs.get("TMA"):
        return (TMA_COPY,)
    if build.name.endswith(("_hopper", WIDE_HOPPER_SUFFIX)):
        return (ASYNC_COPY,)
    if build.name.startswith("fp8_"):
        return (FP8_CONVERT,)
    return ()


def _fp8_builds(capability: int) -> Iterator[Build]:
    """The fp8 (e4m3) forward (``block.fp8_fwd``), from sm_89 on: D 64 / 128, rotary or none, one
    query head per kv head with per-head factors, or two (causal) with per-sequence factors;
    one 128-row tile. bfloat16 products and output."""
    if capability < 89:
        return
    import triton.language as tl

    from .block.fp8_fwd import _fp8_fwd_kernel, e4m3_scores

    shapes = [(64, dim, rot, groups) for dim in (64, 128) for rot in (False, True) for groups in (1, 2)]
    for block, dim, rot, groups in shapes + [(128, 128, True, 1)]:
        batched = groups > 1
        constexprs = _block_constexprs(dim, groups, block, dim if rot else 0, False, batched, 512)
        constexprs.update(QD_BATCH=batched, KD_BATCH=batched, VD_BATCH=batched, DOT_DTYPE=tl.bfloat16,
                          E4M3_SCORES=e4m3_scores(dim if rot else 0, dim))
        options = dict(num_warps=4 if block * dim <= 128 * 128 else 8, num_stages=1)
        name = (f"fp8_fwd_b{block}_d{dim}{'_rope' if rot else ''}{'_gqa_causal_per_sequence' if batched else ''}")
        yield Build(name, _fp8_fwd_kernel, "fp8", _kernel_constexprs(_fp8_fwd_kernel, constexprs), options)
    yield from _fp8_ws_builds(capability)
    from .fp8_linear import _linear_e4m3_kernel, linear_meta

    for in_dim, out_dim, dtype in ((256, 768, "bf16"), (256, 384, "fp16"), (64, 192, "bf16")):
        meta = linear_meta(in_dim, out_dim, True, False)
        options = {key: meta.pop(key) for key in ("num_warps", "num_stages")}
        yield Build(f"fp8_linear_e{in_dim}_n{out_dim}_{dtype}", _linear_e4m3_kernel, dtype, meta, options)
    yield from _linear_ws_builds(capability)


def _linear_ws_builds(capability: int) -> Iterator[Build]:
    """The warp-specialized e4m3 projection for sm_90 (``sm90.linear``): the ranking models' width
    (E 256 to 768 outputs) in 128- and 256-column slices, ``x`` in 64-channel chunks (``CHUNKED``,
    the default) or whole tiles, a narrow one (E 64, 208 outputs, no bias), and the ranking width
    without ``PINGPONG`` and ``BIAS_ONCE`` (both taken by default), with rotary in its epilogue
    (``PairRotary``; the bias per tile then, as ``linear_ws`` launches it: held once it spilled 136-268 B), and
    with the chunks' slots released by every consumer thread (``THREAD_RELEASE``, a candidate)."""
    if capability // 10 != 9 or gluon_import_error() is not None:
        return
    from .sm90.linear import CHUNK, _linear_ws_kernel, stages

    for in_dim, out_dim, bias, block_n, dtype, chunked, options in (
            (256, 768, True, 256, "bf16", False, ""), (256, 768, True, 128, "bf16", False, ""),
            (256, 384, True, 256, "fp16", False, ""), (64, 208, False, 128, "bf16", False, ""),
            (256, 768, True, 256, "bf16", True, ""), (256, 768, True, 256, "bf16", True, "no_pingpong"),
            (256, 768, True, 256, "bf16", True, "no_pingpong_bias_per_tile"),
            (256, 768, True, 256, "bf16", True, "rotary_d128_bias_per_tile"),
            (256, 768, True, 256, "bf16", True, "rotary_d64_bias_per_tile"),
            (256, 768, True, 256, "bf16", True, "thread_release")):
        constexprs = dict(IN_DIM=in_dim, OUT_DIM=out_dim, HAS_BIAS=bias, BLOCK_N=block_n,
                          STAGES=stages(in_dim, block_n), CHUNK=CHUNK if chunked else in_dim,
                          PINGPONG="no_pingpong" not in options, BIAS_ONCE="bias_per_tile" not in options,
                          HEAD_DIM=64, ROT_DIM=64, ROT_END=0, THREAD_RELEASE=options == "thread_release")
        if "rotary" in options:  # q and k rotated in the epilogue (PairRotary), prod's D 128 H2 / D 64 H4
            dim = 128 if "d128" in options else 64
            constexprs.update(HEAD_DIM=dim, ROT_DIM=dim, ROT_END=2 * out_dim // 3)
        name = (f"fp8_linear_gluon_e{in_dim}_n{out_dim}{'_chunked' if chunked else ''}"
                f"{'_' + options if options else ''}_{block_n}cols_{dtype}")
        yield Build(name, _linear_ws_kernel, dtype, constexprs, dict(num_warps=4))


def _fp8_ws_builds(capability: int) -> Iterator[Build]:
    """The warp-specialized e4m3 forward for sm_90 (``sm90.fp8_fwd``): D 64 / 128, rotary (split
    halves over every channel) or none, one query head per kv head with per-head factors and
    64-token blocks' outputs by TMA stores (the default, ``OUT_TMA``), or two (causal, rotary at
    given positions) with per-sequence factors and masked stores only; bf16 output."""
    if capability // 10 != 9 or gluon_import_error() is not None:
        return
    from .sm90.fp8_fwd import CONSUMERS, _fp8_ws_fwd_kernel, stages

    for dim, groups, rotary in itertools.product((64, 128), (1, 2), (False, True)):
        batched = groups > 1
        constexprs = dict(HEAD_DIM=dim, GROUPS=groups, STAGES=stages(dim, rotary), ROTARY=rotary,
                          HAS_POS=batched and rotary, IS_CAUSAL=batched, INLINE_SEQS=0, QD_BATCH=batched,
                          KD_BATCH=batched, VD_BATCH=batched, OUT_TMA=not batched, CONSUMERS=CONSUMERS,
                          F16_ROTATION=True)
        name = (f"fp8_gluon_fwd_d{dim}{'_rope' if rotary else ''}{'_gqa_causal_per_sequence' if batched else ''}"
                f"{'_masked_out' if batched else ''}")
        yield Build(name, _fp8_ws_fwd_kernel, "fp8", constexprs, dict(num_warps=4))
        if rotary:  # off the default: q and k rotated in float32 (F16_ROTATION off)
            yield Build(name.replace("_rope", "_rope_f32"), _fp8_ws_fwd_kernel, "fp8",
                        dict(constexprs, F16_ROTATION=False), dict(num_warps=4))


def _pass_builds(capability: int) -> Iterator[Build]:
    """The row passes around the block backwards: the rotation pass (``block.rotation``: split halves
    over every channel at D128 and D256, interleaved pairs over part of D96 at given positions; copies
    and in place, the transpose rotation; bf16 D128 copies in the paired-chunk order) and the group sums
    (``common.head_sums``: bf16 D256 of 4 heads, fp16 D96 of 2, fp32 D128 of 8), with the launchers' constexprs and
    options."""
    from .block.rotation import ROWS, _rotation_kernel
    from .common.head_sums import _head_sums_kernel, sums_meta
    from .common.meta import tile_extent

    forms = ((128, 128, False, False), (256, 256, False, False), (96, 64, True, True))
    for dtype, (dim, rot, interleaved, has_pos), in_place in itertools.product(
            ("bf16", "fp16", "fp32"), forms, (False, True)):
        constexprs = dict(HEAD_DIM=dim, BLOCK_M=ROWS, BLOCK_R=tile_extent(rot // 2),
                          BLOCK_P=tile_extent(max(dim - rot, 1)), ROT_DIM=rot, INTERLEAVED=interleaved,
                          HAS_POS=has_pos, INVERSE=in_place, COPY_PASS=not in_place, FAST_TRIG=True, INT64=False,
                          INLINE_SEQS=512, PAIR_CHUNK=0)
        form = f"{'interleaved' if interleaved else 'split'}{rot}{'_pos' if has_pos else ''}"
        name = f"rotation_{dtype}_d{dim}_{form}_{'back_in_place' if in_place else 'copy'}"
        options = dict(num_warps=8 if dim > 128 else 4, num_stages=1)
        yield Build(name, _rotation_kernel, dtype, _kernel_constexprs(_rotation_kernel, constexprs), options)
        if (dim, rot, in_place) == (128, 128, False) and dtype == "bf16":  # copies in the paired-chunk order
            constexprs["PAIR_CHUNK"] = 32
            yield Build(f"rotation_{dtype}_d{dim}_{form}_paired32_copy", _rotation_kernel, dtype,
                        _kernel_constexprs(_rotation_kernel, constexprs), options)
    for dtype, dim, groups in (("bf16", 256, 4), ("fp16", 96, 2), ("fp32", 128, 8)):
        constexprs = sums_meta(groups, dim)
        options = dict(num_warps=constexprs.pop("num_warps"))
        yield Build(f"head_sums_{dtype}_d{dim}_g{groups}", _head_sums_kernel, dtype, constexprs, options)


def builds(capability: int) -> Iterator[Build]:
    """Every shipped kernel build, with the launch options used on GPUs of ``capability``."""
    yield from _pass_builds(capability)
    yield from _fp8_builds(capability)
    yield from _block_builds(capability)
    yield from _lse_builds(capability)
    yield from _packed_builds(capability)
    yield from _hopper_builds(capability)
    yield from _hopper_packed_builds(capability)
    yield from _hopper_wide_builds(capability)
    yield from _hopper_ws_builds(capability)
    yield from _sm100_builds(capability)
    yield from _flash_builds(capability)
    yield from _flash_gluon_builds(capability)


def compile_build(build: Build, capability: int) -> str:
    """PTX of one build."""
    return _compile(build, capability).asm["ptx"]


def _compile(build: Build, capability: int):
    signature, attrs = _signature(build.kernel, build.dtype, build.constexprs)
    gluon = GluonJITFunction is not None and isinstance(build.kernel, GluonJITFunction)
    source = GluonASTSource if gluon else ASTSource
    src = source(fn=build.kernel, signature=signature, constexprs=build.constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=build.options)


# Budgets a build must keep (sm_100, per program): registers per thread, bytes of spill stores
# (ptxas -v), shared memory (227 KB per block), tensor-memory columns.
MAX_REGISTERS = 255
MAX_SPILL_BYTES = 256
# The hopper builds' spill budget: their rotary GQA backward at D128 (auto's choice since the
# variant was measured on the H200) spills 112-556 bytes (0.6-1.0 KB before its angles moved to
# shared memory in session 25).
HOPPER_MAX_SPILL_BYTES = 1024
MAX_SHARED = 227 * 1024
MAX_TMEM_COLUMNS = 512


class Usage(NamedTuple):
    """What a compiled build uses: registers per thread and spill stores (bytes) as ptxas reports
    them (None where ptxas could not be run), shared memory (bytes), tensor-memory columns."""

    registers: Optional[int]
    spill_bytes: Optional[int]
    shared: int
    tmem_columns: int

    def over_budget(self, max_spill_bytes: int = MAX_SPILL_BYTES) -> List[str]:
        over = []
        if self.registers is not None and self.registers > MAX_REGISTERS:
            over.append(f"{self.registers} registers > {MAX_REGISTERS}")
        if self.spill_bytes is not None and self.spill_bytes > max_spill_bytes:
            over.append(f"{self.spill_bytes} bytes spilled > {max_spill_bytes}")
        if self.shared > MAX_SHARED:
            over.append(f"{self.shared} bytes of shared memory > {MAX_SHARED}")
        if self.tmem_columns > MAX_TMEM_COLUMNS:
            over.append(f"{self.tmem_columns} tensor-memory columns > {MAX_TMEM_COLUMNS}")
        return over

    def __str__(self) -> str:
        regs = "?" if self.registers is None else self.registers
        spill = "?" if self.spill_bytes is None else self.spill_bytes
        return f"regs {regs} spill {spill} B smem {self.shared} B tmem {self.tmem_columns} cols"

    def programs_per_sm(self, warps: int, capability: int) -> Optional[int]:
        """How many programs of ``warps`` warps an SM of this generation holds at once, as its
        registers (allocated per warp in 256s), shared memory (1 KB more per program), threads and
        tensor memory allow; None where ptxas could not report the registers."""
        if self.registers is None:
            return None
        per_warp = -(-self.registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
        limits = [SM_REGISTERS // (per_warp * warps), SM_SHARED[capability] // (self.shared + SHARED_PER_PROGRAM),
                  SM_THREADS[capability] // (32 * warps), MAX_PROGRAMS_PER_SM]
        if self.tmem_columns:
            limits.append(MAX_TMEM_COLUMNS // self.tmem_columns)
        return min(limits)


# What an SM holds, for ``Usage.programs_per_sm``: 64 K 32-bit registers on every generation here;
# shared memory (bytes) and threads by compute capability (CUDA programming guide, occupancy).
SM_REGISTERS = 65536
REGISTER_GRANULE = 256
SM_SHARED = {80: 167936, 89: 102400, 90: 233472, 100: 233472}
SHARED_PER_PROGRAM = 1024
SM_THREADS = {80: 2048, 89: 1536, 90: 2048, 100: 2048}
MAX_PROGRAMS_PER_SM = 32


def ptxas_usage(ptx: str, capability: int) -> Tuple[Optional[int], Optional[int]]:
    """``(registers, spill store bytes)`` of a kernel's PTX from the Triton wheel's ptxas (``-v``),
    or ``(None, None)`` where it cannot be run."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        path = get_ptxas(capability).path
        arch = sm_arch_from_capability(capability)
    except Exception:  # no ptxas in this Triton
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        result = subprocess.run([path, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                                capture_output=True, text=True)
    if result.returncode != 0:
        return None, None
    regs = re.search(r"Used (\d+) registers", result.stderr)
    spill = re.search(r"(\d+) bytes spill stores", result.stderr)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else 0)


def usage(compiled, capability: int) -> Usage:
    """Registers, spills, shared memory and tensor memory of a compiled build."""
    registers, spill = ptxas_usage(compiled.asm["ptx"], capability)
    meta = compiled.metadata
    return Usage(registers, spill, int(getattr(meta, "shared", 0) or 0), int(getattr(meta, "tmem_size", 0) or 0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="",
                        help="compile only variants whose name contains this (or one of these, comma-separated)")
    parser.add_argument("--usage", action="store_true",
                        help="print every build's registers, spills, shared memory and programs per SM "
                             "(by default the Gluon builds' only)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failures = []
    count = 0
    for build in builds(ARCHS[args.arch]):
        if not any(part in build.name for part in args.only.split(",")):
            continue
        count += 1
        try:
            compiled = _compile(build, ARCHS[args.arch])
            ptx = compiled.asm["ptx"]
        except Exception as err:  # report every build that fails, not just the first
            failures.append(f"{build.name}: does not compile: {type(err).__name__}: {str(err).splitlines()[-1][:200]}")
            continue
        (args.out / f"{build.name}.ptx").write_text(ptx)
        wanted = required_products(build, args.arch) + required_copies(build)
        missing = [" or ".join(ins) if isinstance(ins, tuple) else ins for ins in wanted
                   if not any(alt in ptx for alt in (ins if isinstance(ins, tuple) else (ins,)))]
        if missing:
            failures.append(f"{build.name}: no {', '.join(missing)}")
        hopper = build.name.endswith(("_hopper", PACKED_HOPPER_SUFFIX, WIDE_HOPPER_SUFFIX))
        if not (GluonJITFunction is not None and isinstance(build.kernel, GluonJITFunction)):
            # Every Triton build's shared memory (the Gluon builds' is in their usage below).
            over = Usage(None, None, int(getattr(compiled.metadata, "shared", 0) or 0), 0).over_budget()
            if over:
                failures.append(f"{build.name}: over budget: {'; '.join(over)}")
        gluon_build = build.name.startswith(("sm100_", "flash_gluon_")) or hopper
        if gluon_build or args.usage:
            used = usage(compiled, ARCHS[args.arch])
            # (The compiled kernel's warps: with warp specialization, every partition's.)
            held = used.programs_per_sm(compiled.metadata.num_warps, ARCHS[args.arch])
            print(f"{build.name}: {used}, {held} programs per SM")
        if gluon_build:
            over = used.over_budget(HOPPER_MAX_SPILL_BYTES if hopper else MAX_SPILL_BYTES)
            if used.registers is None:
                over.append("ptxas could not report registers")
            if over:
                failures.append(f"{build.name}: over budget: {'; '.join(over)}")
    print(f"{args.arch}: {count} variants, {count - len(failures)} without failures, PTX in {args.out}")
    for line in failures:
        print("FAIL", line)
    return 1 if failures or count == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
