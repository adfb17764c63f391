"""Compile every block-kernel variant (simple and persistent) for a GPU architecture on a
machine without a GPU.

``python -m blockattn_layers.kernels.compile_check --arch sm_100 --out DIR`` writes
``DIR/<variant>.ptx`` for each variant and fails unless the matrix instructions of that
generation are in the PTX: ``mma.sync`` (sm_80), ``wgmma`` (sm_90), ``tcgen05.mma`` (sm_100).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Dict, Iterator, Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ._common import head_loop, max_registers
from .block_bwd import _block_bwd_kernel
from .block_fwd import _block_fwd_kernel

ARCHS = {"sm_80": 80, "sm_90": 90, "sm_100": 100}
EXPECTED = {"sm_80": ("mma.sync",), "sm_90": ("wgmma",), "sm_100": ("tcgen05.mma",)}
_DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _signature(kernel, dtype: str, constexprs: Dict[str, object]) -> Tuple[Dict[str, str], Dict]:
    """Signature and attributes as the JIT sees a contiguous ``[T, H, D]`` launch.

    Unit strides are specialized to the constant 1 and pointers and other strides are
    16-divisible, as the JIT does at run time, so the PTX shows the real (vectorized) loads.
    """
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in ("Sched", "Pos"):
            sig[name] = "*i32"
        elif name[0].isupper():
            sig[name] = _DTYPES[dtype]
        elif name in ("qk_scale", "scale", "log2_theta"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if name[0].isupper() or (name.startswith("stride_") and not name.endswith("d")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def variants() -> Iterator[Tuple[str, object, str, Dict[str, object]]]:
    """(name, kernel, dtype, constexprs) for every shipped block-kernel variant."""
    kernels = (("fwd", _block_fwd_kernel), ("bwd", _block_bwd_kernel))
    kinds = ("simple", "persistent")
    for (kind, kernel), dtype, (block, dim), rotary, causal, variant in itertools.product(
        kernels, ("bf16", "fp16", "fp32"), ((64, 128), (64, 64), (128, 128)), (False, True), (False, True), kinds,
    ):
        name = (f"{kind}_{dtype}_b{block}_d{dim}{'_rope' if rotary else ''}{'_causal' if causal else ''}"
                f"{'' if variant == 'simple' else '_' + variant}")
        rot = dim if rotary else 0
        constexprs = dict(
            HEAD_DIM=dim, GROUPS=1, BLOCK_M=block, BLOCK_D=dim, BLOCK_R=max(16, rot // 2),
            BLOCK_P=max(16, dim - rot), ROT_DIM=rot, INTERLEAVED=False, HAS_POS=False, IS_CAUSAL=causal,
            FAST_TRIG=True, INT64=False, PRECISION="tf32", INLINE_SEQS=0, PERSISTENT=variant != "simple",
        )
        constexprs.update({name: 1 for name in kernel.arg_names if name.startswith("stride_") and name.endswith("d")})
        if kernel is _block_fwd_kernel:
            constexprs["HEAD_LOOP"] = head_loop(constexprs, variant)
        yield name, kernel, dtype, constexprs


def compile_variant(kernel, dtype: str, constexprs: Dict[str, object], capability: int, num_warps: int = 4) -> str:
    """PTX of one variant with the launch options the launchers use."""
    signature, attrs = _signature(kernel, dtype, constexprs)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=1)
    variant = "persistent" if constexprs["PERSISTENT"] else "simple"
    regs = max_registers(constexprs, variant, kernel is not _block_fwd_kernel, capability // 10,
                         4 if dtype == "fp32" else 2)
    if regs:
        options["maxnreg"] = regs
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
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
    for name, kernel, dtype, constexprs in variants():
        if args.only not in name:
            continue
        count += 1
        try:
            ptx = compile_variant(kernel, dtype, constexprs, ARCHS[args.arch])
        except Exception as err:  # report every variant that does not build, not just the first
            failures.append(f"{name}: does not compile: {type(err).__name__}: {str(err).splitlines()[-1][:200]}")
            continue
        (args.out / f"{name}.ptx").write_text(ptx)
        missing = [ins for ins in EXPECTED[args.arch] if ins not in ptx]
        if missing:
            failures.append(f"{name}: no {', '.join(missing)}")
    print(f"{args.arch}: {count} variants, {count - len(failures)} without failures, PTX in {args.out}")
    for line in failures:
        print("FAIL", line)
    return 1 if failures or count == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
