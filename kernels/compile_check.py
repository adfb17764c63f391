"""Compile every kernel variant (the simple block kernels, and for sm_90 the Gluon hopper kernels
and the experimental warp-specialized hopper_ws ones; the flash forward, dK/dV and dQ kernels
with pointer and tensor-map loads) for a GPU architecture on a machine without a GPU.

``python -m blockattn_layers.kernels.compile_check --arch sm_100 --out DIR`` writes
``DIR/<variant>.ptx`` for each variant and fails unless the matrix instructions of that
generation are in the PTX: ``mma.sync`` (sm_80), ``wgmma`` (sm_90), ``tcgen05.mma`` (sm_100),
and the tensor-map variants' loads are TMA copies (``cp.async.bulk.tensor``), the hopper kernels
copy their tiles with asynchronous copies (``cp.async``), and the warp-specialized kernels
reallocate registers between partitions (``setmaxnreg``). Tiles and launch options are the ones
the launchers use on that generation.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Dict, Iterator, NamedTuple, Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

try:
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
except ImportError:  # no Gluon: no hopper variants either (``_hopper_variants``)
    GluonASTSource = GluonJITFunction = None

from .block.bwd import _block_bwd_kernel
from .block.fwd import _block_fwd_kernel
from .block.plan import head_loop, max_registers
from .block.variants import HOPPER, HOPPER_WS, SIMPLE, gluon_import_error
from .flash.bwd import _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel, bwd_launch_options
from .flash.fwd import _flash_fwd_kernel, fwd_launch_options
from .flash.schedule import flash_tiles

ARCHS = {"sm_80": 80, "sm_90": 90, "sm_100": 100}
EXPECTED = {"sm_80": ("mma.sync",), "sm_90": ("wgmma",), "sm_100": ("tcgen05.mma",)}
TMA_COPY = "cp.async.bulk.tensor"
SET_MAX_REGISTERS = "setmaxnreg"
ASYNC_COPY = "cp.async.cg.shared.global"
_DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
# Tensor-descriptor arguments of the flash kernels: which tile rows (constexpr) each one loads.
_DESCRIPTORS = {"KD": "BLOCK_N", "VD": "BLOCK_N", "QD": "BLOCK_M", "DOD": "BLOCK_M"}


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
            sig[name] = f"tensordesc<{_DTYPES[dtype][1:]}[{rows},{constexprs['BLOCK_D']}]>"
            continue
        if name in ("Sched", "Table", "Pos"):
            sig[name] = "*i32"
        elif name in ("Lse", "Delta"):
            sig[name] = "*fp32"
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
        PRECISION="tf32", INLINE_SEQS=inline_seqs,
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
        size = 4 if dtype == "fp32" else 2
        options = dict(num_warps=4, num_stages=1)
        regs = max_registers(constexprs, SIMPLE, backward, capability // 10, size)
        if regs:
            options["maxnreg"] = regs
        yield Build(name, kernel, dtype, _kernel_constexprs(kernel, constexprs), options)


def _hopper_builds(capability: int) -> Iterator[Build]:
    """The Gluon kernels of the hopper variant (sm_90 only): 16-bit dtypes, D 64 / 128, rotary,
    causal, one or two query heads per kv head, the block table or the in-kernel schedule."""
    if capability // 10 != 9 or gluon_import_error() is not None:
        return
    from .sm90.block import _hopper_bwd_kernel, _hopper_fwd_kernel

    for (kind, kernel), dtype, dim, rotary, causal, groups in itertools.product(
        (("fwd", _hopper_fwd_kernel), ("bwd", _hopper_bwd_kernel)), ("bf16", "fp16"), (64, 128), (False, True),
        (False, True), (1, 2),
    ):
        constexprs = _block_constexprs(dim, groups, 64, dim if rotary else 0, rotary and causal, causal,
                                       512 if groups == 2 else 0)
        constexprs["HEAD_LOOP"] = kind == "fwd" and head_loop(constexprs, HOPPER.name)
        options = dict(num_warps=4, num_stages=1)
        regs = max_registers(constexprs, HOPPER, kind == "bwd", 9, 2)
        if regs:
            options["maxnreg"] = regs
        name = (f"{kind}_{dtype}_b64_d{dim}{'_rope' if rotary else ''}{'_causal' if causal else ''}"
                f"{'_gqa' if groups > 1 else ''}_hopper")
        yield Build(name, kernel, dtype, _kernel_constexprs(kernel, constexprs), options)


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


def _flash_builds(capability: int) -> Iterator[Build]:
    """GQA (2 query heads per kv head), causal, D = 128: plain heads (tensor-map loads from sm_90
    on) and half rotary (pointer loads), with the tiles and options of full attention."""
    major, dim = capability // 10, 128
    for dtype, rot in itertools.product(("bf16", "fp16", "fp32"), (0, 64)):
        size = 4 if dtype == "fp32" else 2
        tiles = flash_tiles(dim, "cuda", size, major)
        for kind, kernel in (("fwd", _flash_fwd_kernel), ("dkv", _flash_bwd_dkdv_kernel), ("dq", _flash_bwd_dq_kernel)):
            outer, inner = tiles[kind]
            block_m, block_n = (inner, outer) if kind == "dkv" else (outer, inner)
            tma = rot == 0 and major >= 9
            constexprs = dict(
                HEAD_DIM=dim, GROUPS=2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=dim, BLOCK_R=max(16, rot // 2),
                BLOCK_P=dim - rot, ROT_DIM=rot, INTERLEAVED=False, HAS_POS=False, IS_CAUSAL=True,
                FAST_TRIG=True, INT64=False, PRECISION="tf32", TMA=tma,
            )
            if kind == "fwd":
                options = fwd_launch_options(outer, dim, "cuda", major)
            else:
                options = bwd_launch_options(outer, dim, "cuda", inner if kind == "dkv" else 64)
            name = f"flash_{kind}_{dtype}_d{dim}_causal_gqa{'_rope' if rot else '_tma' if tma else ''}"
            yield Build(name, kernel, dtype, _kernel_constexprs(kernel, constexprs), options)


def required_copies(build: Build) -> Tuple[str, ...]:
    """Copy instructions a build's PTX must hold: TMA copies for tensor-map loads, asynchronous
    copies for the hopper kernels (every tile); for the warp-specialized kernels TMA copies (full
    blocks), asynchronous copies (ragged ones) and the partitions' register reallocation."""
    if build.name.startswith("ws_"):
        return (TMA_COPY, ASYNC_COPY, SET_MAX_REGISTERS)
    if build.constexprs.get("TMA"):
        return (TMA_COPY,)
    if build.name.endswith("_hopper"):
        return (ASYNC_COPY,)
    return ()


def builds(capability: int) -> Iterator[Build]:
    """Every shipped kernel build, with the launch options used on GPUs of ``capability``."""
    yield from _block_builds(capability)
    yield from _hopper_builds(capability)
    yield from _hopper_ws_builds(capability)
    yield from _flash_builds(capability)


def compile_build(build: Build, capability: int) -> str:
    """PTX of one build."""
    signature, attrs = _signature(build.kernel, build.dtype, build.constexprs)
    gluon = GluonJITFunction is not None and isinstance(build.kernel, GluonJITFunction)
    source = GluonASTSource if gluon else ASTSource
    src = source(fn=build.kernel, signature=signature, constexprs=build.constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=build.options)
    return compiled.asm["ptx"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default="", help="compile only variants whose name contains this")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failures = []
    count = 0
    for build in builds(ARCHS[args.arch]):
        if args.only not in build.name:
            continue
        count += 1
        try:
            ptx = compile_build(build, ARCHS[args.arch])
        except Exception as err:  # report every build that fails, not just the first
            failures.append(f"{build.name}: does not compile: {type(err).__name__}: {str(err).splitlines()[-1][:200]}")
            continue
        (args.out / f"{build.name}.ptx").write_text(ptx)
        wanted = EXPECTED[args.arch] + required_copies(build)
        missing = [ins for ins in wanted if ins not in ptx]
        if missing:
            failures.append(f"{build.name}: no {', '.join(missing)}")
    print(f"{args.arch}: {count} variants, {count - len(failures)} without failures, PTX in {args.out}")
    for line in failures:
        print("FAIL", line)
    return 1 if failures or count == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
