"""``python -m blockattn_layers verify-arch``: check and time every block-kernel variant on this GPU.

What the owner of a GPU generation with no recorded hardware run here (a B200: the ``sm100``
kernels) runs to find out in minutes whether those kernels are right and fast, writing a
Markdown report to paste into an issue:

1. every variant declared for this GPU's generation (or those named with ``--variants``) is
   forced, with the self-check at first use suspended so that its own results are measured, on
   every case it admits of a grid of edge lengths (0, 1, around the block size, longer), dtypes,
   head dims, GQA, rotary (implicit and given positions) and causal; forward and gradients are
   compared with the float64 reference: an error above twice (forward) or three times
   (gradients) the same-dtype reference's own error, with a floor, fails;
2. each variant is timed at the production shape (``--quick``: a smaller batch) beside the
   simple Triton kernels and FA2 varlen (where this torch has it), as ms and ``x floor``.

Exit status 1 if any case fails. Off the GPU (``--device cpu`` with ``TRITON_INTERPRET=1``) only
the Triton variant runs, in float16, without timing: a check of the tool itself.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from .. import reference
from ..bench.env import device_name, git_commit, measure_bandwidth
from ..functional import block_attention
from ..kernels.block import self_check, variants
from ..kernels.common.meta import major_of

EDGE_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 200, 1, 0, 7, 300]
FLOOR = 2e-3  # relative error below which a case passes whatever the reference's own error


def _cases(device: str, quick: bool) -> List[dict]:
    dtypes = [torch.float16] if device == "cpu" else [torch.bfloat16, torch.float16]
    dims = [64] if device == "cpu" else [64, 128]
    heads = [(2, 2), (4, 2)]
    rotary = [None, "implicit", "positions"]
    blocks = [64, 128] if device != "cpu" else [64]
    grid = itertools.product(dtypes, dims, heads, rotary, (False, True), blocks)
    cases = [dict(dtype=d, dim=dim, heads=h, rotary=r, causal=c, block_size=b) for d, dim, h, r, c, b in grid]
    if quick:
        cases = [c for c in cases if c["dtype"] == dtypes[0] and c["dim"] == dims[-1] and c["block_size"] == 64]
    return cases


def _facts(case: dict, device: torch.device) -> variants.CallFacts:
    """The backward's facts: every variant computes a backward (some a backward only, their forward
    another variant's: ``Variant.forward_of``)."""
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None
    heads, kv_heads = case["heads"]
    rot = case["dim"] if case["rotary"] else 0
    return variants.CallFacts(device.type, major, case["dtype"], case["dim"], heads // kv_heads, case["block_size"],
                              rot, False, False, case["rotary"] == "positions", True)


def _inputs(case: dict, device: torch.device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.tensor(EDGE_LENGTHS)
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device)
    total = int(lengths.sum())
    heads, kv_heads = case["heads"]
    q, k, v = (torch.randn(total, h, case["dim"], generator=g).to(device, case["dtype"])
               for h in (heads, kv_heads, kv_heads))
    kw = dict(causal=case["causal"])
    if case["rotary"]:
        kw["rope_theta"] = 10000.0
        if case["rotary"] == "positions":
            kw["positions"] = (torch.rand(total, generator=g) * 4000).to(device)
    return (q, k, v), offsets, kw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def _reference(q, k, v, offsets, block_size, kw, grad_out, dtype=None):
    """Forward and gradients of the reference: in float64 (``dtype=None`` with float64 inputs), or
    the same attention computed in ``dtype`` with the rotation in float64 (the kernels rotate in
    float32 and compute attention in the input dtype: so the rotary angles do not set the bound)."""
    theta, positions = kw.get("rope_theta"), kw.get("positions")
    scale = q.shape[-1] ** -0.5
    if dtype is not None and theta is not None:
        pos = positions if positions is not None else reference.sequence_positions(offsets, q.shape[0])
        angles = reference.rotary_angles(pos, theta, q.shape[-1], torch.float64)
        qr, kr = (reference.apply_rotary(x.double(), angles, q.shape[-1], False).to(dtype) for x in (q, k))
        args = (offsets, block_size, scale, kw["causal"], None, None, 0, False, None, None)
        out = reference.attention_forward(qr, kr, v, *args, dtype=dtype)
        dq, dk, dv = reference.attention_backward(grad_out, qr, kr, v, *args, dtype=dtype)
        dq, dk = (reference.apply_rotary(g.double(), angles, q.shape[-1], False, inverse=True) for g in (dq, dk))
        return out, dq, dk, dv
    args = (offsets, block_size, scale, kw["causal"], theta, positions, q.shape[-1] if theta else 0, False, None, None)
    out = reference.attention_forward(q, k, v, *args, dtype=dtype)
    return (out, *reference.attention_backward(grad_out, q, k, v, *args, dtype=dtype))


def check_case(variant: variants.Variant, case: dict, device: torch.device, seed: int) -> dict:
    """One case: the variant's forward and gradients against the float64 reference."""
    (q, k, v), offsets, kw = _inputs(case, device, seed)
    grad_out = torch.randn_like(q)
    oracle = _reference(*(x.double() for x in (q, k, v)), offsets, case["block_size"], kw, grad_out.double())
    same_dtype = _reference(q, k, v, offsets, case["block_size"], kw, grad_out, dtype=q.dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with variants.forced_variant(variant.name), self_check.suspended():
        chosen = variants.choose(_facts(case, device), q, (q, k, v)).name
        out = block_attention(*leaves, offsets, case["block_size"], backend="triton", **kw)
        got = (out, *torch.autograd.grad(out, leaves, grad_out))
    names = ("out", "dq", "dk", "dv")
    errors = {n: _rel(g, o) for n, g, o in zip(names, got, oracle)}
    bounds = {n: max((2 if n == "out" else 3) * _rel(r, o), FLOOR) for n, r, o in zip(names, same_dtype, oracle)}
    ok = chosen == variant.name and all(errors[n] <= bounds[n] for n in names)
    return dict(case=case, ran=chosen, errors=errors, bounds=bounds, ok=ok)


def _describe(case: dict) -> str:
    heads, kv_heads = case["heads"]
    parts = [str(case["dtype"]).replace("torch.", ""), f"D{case['dim']}", f"H{heads}/{kv_heads}",
             f"block {case['block_size']}"]
    if case["rotary"]:
        parts.append(f"rotary ({case['rotary']})")
    if case["causal"]:
        parts.append("causal")
    return ", ".join(parts)


def _time(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def time_variants(names: Sequence[str], device: torch.device, quick: bool) -> List[dict]:
    """ms forward and backward at the production shape (block 64, D128 H2, bf16) per variant,
    the simple kernels and FA2 varlen; ``x floor`` against this GPU's measured copy bandwidth."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4001, (128 if quick else 1152,), generator=g)
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device)
    total = int(lengths.sum())
    q, k, v = (torch.randn(total, 2, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
    grad_out = torch.randn_like(q)
    bandwidth = measure_bandwidth(device)
    floor_fwd = 4 * q.numel() * q.element_size() / bandwidth * 1e3
    floor_bwd = 7 * q.numel() * q.element_size() / bandwidth * 1e3
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    rows = []
    for name in [*names, "simple"]:
        with variants.forced_variant(name), self_check.suspended():
            def forward():
                return block_attention(*leaves, offsets, 64, backend="triton")

            fwd_ms = _time(forward)
            both_ms = _time(lambda: torch.autograd.grad(forward(), leaves, grad_out))
        rows.append(dict(method=f"triton[{name}]", fwd=fwd_ms, bwd=both_ms - fwd_ms))
    fa2 = _fa2_times(q, k, v, lengths, grad_out)
    if fa2 is not None:
        rows.append(dict(method="fa2_varlen", fwd=fa2[0], bwd=fa2[1]))
    for row in rows:
        row.update(fwd_floor=row["fwd"] / floor_fwd, bwd_floor=row["bwd"] / floor_bwd)
    return rows


def _block_sizes(lengths: torch.Tensor, block: int) -> torch.Tensor:
    """Token counts of every block, in token order: ``min(block, n - block * j)`` for block ``j``
    of a sequence of ``n`` tokens."""
    blocks = (lengths + block - 1) // block
    first = (blocks.cumsum(0) - blocks).repeat_interleave(blocks)
    j = torch.arange(int(blocks.sum())) - first
    return torch.clamp(lengths.repeat_interleave(blocks) - block * j, max=block)


def _fa2_times(q, k, v, lengths, grad_out) -> Optional[tuple]:
    """FA2 varlen over the same 64-token blocks, or None where this torch has no such kernel."""
    from ..bench.baselines import FlashVarlen

    cu = torch.nn.functional.pad(_block_sizes(lengths, 64).cumsum(0), (1, 0)).to(q.device, torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    try:
        fwd_ms = _time(lambda: FlashVarlen.apply(*leaves, cu, 64, q.shape[-1] ** -0.5))
        both_ms = _time(lambda: torch.autograd.grad(FlashVarlen.apply(*leaves, cu, 64, q.shape[-1] ** -0.5), leaves,
                                                    grad_out))
    except (RuntimeError, NotImplementedError):
        return None
    return fwd_ms, both_ms - fwd_ms


def report(device: torch.device, checks: Dict[str, List[dict]], timings: List[dict]) -> str:
    """The Markdown report."""
    name = device_name(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    import triton

    lines = [f"## verify-arch: {name}" + (f" (sm_{capability[0]}{capability[1]})" if capability else ""),
             "", f"torch {torch.__version__}, triton {triton.__version__}, blockattn-layers commit {git_commit()[0]}", ""]
    for variant, results in checks.items():
        passed = sum(r["ok"] for r in results)
        lines += [f"### {variant}: {passed} of {len(results)} cases pass", "",
                  "| case | ran | out | dq | dk | dv | ok |", "|---|---|---|---|---|---|---|"]
        for r in results:
            cells = [f"{r['errors'][n]:.2e} (<= {r['bounds'][n]:.1e})" for n in ("out", "dq", "dk", "dv")]
            lines.append(f"| {_describe(r['case'])} | {r['ran']} | {' | '.join(cells)} | {'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    if timings:
        lines += ["### speed, prod shape (bf16, D128 H2, block 64)", "",
                  "| method | fwd ms (x floor) | bwd ms (x floor) |", "|---|---|---|"]
        lines += [f"| {t['method']} | {t['fwd']:.3f} ({t['fwd_floor']:.2f}x) | {t['bwd']:.3f} ({t['bwd_floor']:.2f}x) |"
                  for t in timings]
        lines.append("")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default=None, help="comma list of variants (default: those declared for this GPU)")
    p.add_argument("--device", default=None, help="cuda (default when available), cuda:1, ...; cpu needs "
                   "TRITON_INTERPRET=1 and checks the Triton variant only")
    p.add_argument("--quick", action="store_true", help="fewer cases and a smaller timing shape")
    p.add_argument("--no-bench", action="store_true", help="correctness only")
    p.add_argument("--out", default="verify_arch_report.md", help="where the Markdown report goes")


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("verify-arch: no CUDA device here; on the CPU it checks the Triton kernels through Triton's "
              "interpreter: run it with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in variants.VARIANTS]
        if unknown:
            print(f"verify-arch: unknown variants {unknown}; known: {', '.join(variants.VARIANTS)}", file=sys.stderr)
            return 2
    elif device.type == "cuda":
        major = major_of(torch.empty(0, device=device))
        # The generation's own variants, and the rotation pass (Triton, every generation) around them.
        names = [v.name for v in variants.VARIANTS.values()
                 if (v.generations is not None and major in v.generations) or v.rotation_pass]
    else:
        names = ["simple"]
    checks = {}
    for name in names:
        variant = variants.VARIANTS[name]
        cases = [c for c in _cases(device.type, args.quick) if not variant.call_reasons(_facts(c, device))]
        checks[name] = [check_case(variant, c, device, seed) for seed, c in enumerate(cases)]
        passed = sum(r["ok"] for r in checks[name])
        print(f"{name}: {passed} of {len(cases)} cases pass", flush=True)
    timings = [] if args.no_bench or device.type != "cuda" else time_variants(
        [n for n in names if n != "simple"], device, args.quick)
    text = report(device, checks, timings)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"verify-arch: report written to {args.out}")
    return 0 if all(r["ok"] for results in checks.values() for r in results) else 1


def main(argv: Optional[Iterable[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blockattn_layers verify-arch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(None if argv is None else list(argv)))
