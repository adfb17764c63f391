"""``python -m blockattn_layers.bench.variant_ab``: block-kernel variants timed against each other.

The tool behind the variant choices in ``kernels/block/variants.py`` (where ``auto`` takes a
variant is decided from its numbers; the published figures come from the benchmark script). Each
variant runs in its own process with its own Triton cache (``BLOCKATTN_KERNELS`` forces it):
first all of them at once to compile, then one at a time to time. Per point a process checks the
variant on a small jagged batch (empty, 1-token and ragged sequences around the block size)
against the float64 reference, then times it on the grid's prod-like lengths (``bench.grid``):
``--calls`` calls between two CUDA events, no sync between calls, the median of ``--rounds``;
the forward under ``no_grad``, the backward as ``autograd.grad`` of a kept graph.

A point is ``kind:block:dim:heads:kv_heads:rotary_dim:causal`` (``kind`` fwd or bwd;
``rotary_dim`` 0 without rotary, a ``i`` suffix for interleaved pairs; ``causal`` 0 or 1), e.g.
``python -m blockattn_layers.bench.variant_ab --variants hopper,simple fwd:64:128:2:2:64:0``.
On the CPU (``--device cpu``) the calls run the reference backend and nothing is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, NamedTuple, Sequence

import torch

from blockattn_layers.jagged import lengths_to_offsets

SMALL_LENGTHS = (0, 1, 63, 64, 65, 127, 128, 129, 200, 7, 300, 1)


class Point(NamedTuple):
    kind: str
    block: int
    dim: int
    heads: int
    kv_heads: int
    rotary_dim: int
    interleaved: bool
    causal: bool

    @classmethod
    def parse(cls, text: str) -> "Point":
        parts = text.split(":")
        if len(parts) != 7 or parts[0] not in ("fwd", "bwd") or parts[6] not in ("0", "1"):
            raise ValueError(f"point {text!r}: expected kind:block:dim:heads:kv_heads:rotary_dim:causal "
                             "(kind fwd or bwd, causal 0 or 1)")
        rot = parts[5]
        interleaved = rot.endswith("i")
        numbers = [int(p) for p in parts[1:5]] + [int(rot.rstrip("i"))]
        return cls(parts[0], *numbers, interleaved, parts[6] == "1")

    def keywords(self) -> dict:
        """``block_attention``'s keywords of this point, offsets and block size aside."""
        rotary = self.rotary_dim > 0
        return dict(causal=self.causal, rope_theta=1e4 if rotary else None,
                    rotary_dim=self.rotary_dim if rotary else None, rotary_interleaved=self.interleaved)


def _inputs(point: Point, total: int, device: str, grad: bool, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(total, h, point.dim, device=device, generator=g).to(torch.bfloat16).requires_grad_(grad)
            for h in (point.heads, point.kv_heads, point.kv_heads)]


def max_errors(point: Point, device: str) -> Dict[str, float]:
    """The variant's largest absolute error per output (o, or dq, dk, dv) against the float64
    reference on a small jagged batch (bf16 inputs)."""
    from blockattn_layers.functional import block_attention

    offsets = lengths_to_offsets(torch.tensor(SMALL_LENGTHS), torch.int32).to(device)
    backward = point.kind == "bwd"
    q, k, v = _inputs(point, sum(SMALL_LENGTHS), device, backward)
    exact = [x.detach().double().requires_grad_(backward) for x in (q, k, v)]
    kw = point.keywords()
    want = block_attention(*exact, offsets, point.block, backend="reference", **kw)
    got = block_attention(q, k, v, offsets, point.block, **kw)
    if not backward:
        return {"o": float((got.double() - want).abs().max())}
    grad_out = torch.randn_like(want)
    wants = torch.autograd.grad(want, exact, grad_out)
    gots = torch.autograd.grad(got, (q, k, v), grad_out.to(got.dtype))
    return {f"d{name}": float((a.double() - b).abs().max()) for name, a, b in zip("qkv", gots, wants)}


def time_ms(point: Point, device: str, calls: int, rounds: int) -> float:
    """Median ms per call of the point at the grid's lengths (0.0 off the GPU)."""
    from blockattn_layers.bench.grid import grid_lengths
    from blockattn_layers.functional import block_attention

    if device != "cuda":
        return 0.0
    lengths = grid_lengths()
    offsets = lengths_to_offsets(lengths, torch.int32).to(device)
    backward = point.kind == "bwd"
    q, k, v = _inputs(point, int(lengths.sum()), device, backward)
    kw = point.keywords()
    if backward:
        out = block_attention(q, k, v, offsets, point.block, **kw)
        grad_out = torch.randn_like(out)

        def call():
            torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    else:
        def call():
            with torch.no_grad():
                block_attention(q, k, v, offsets, point.block, **kw)
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def variant_run(point: Point, device: str) -> str:
    """The block-kernel variant that computes the point here (the forced one where it admits the
    call, else ``auto``'s: a forced variant that cannot take a point is not what gets timed)."""
    from blockattn_layers.kernels.block import variants

    if device != "cuda":
        return "reference"
    q, k, v = (torch.empty(64, h, point.dim, device=device, dtype=torch.bfloat16)
               for h in (point.heads, point.kv_heads, point.kv_heads))
    facts = variants.call_facts(q, k, point.block, point.rotary_dim, point.interleaved, False,
                                backward=point.kind == "bwd")
    return variants.choose(facts, q, (q, k, v)).name


def run_points(points: Sequence[Point], device: str, calls: int, rounds: int) -> List[dict]:
    """This process's rows: per point the variant that ran, its errors and, unless ``calls`` is 0,
    its time."""
    rows = []
    for point in points:
        errors = max_errors(point, device)
        ms = time_ms(point, device, calls, rounds) if calls else None
        rows.append(dict(point=":".join(map(str, _text(point))), ran=variant_run(point, device), errors=errors,
                         ms=ms))
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _text(point: Point) -> list:
    rot = f"{point.rotary_dim}{'i' if point.interleaved else ''}"
    return [point.kind, point.block, point.dim, point.heads, point.kv_heads, rot, int(point.causal)]


def _child(variant: str, args: argparse.Namespace, out: str, cache: str, calls: int) -> subprocess.Popen:
    env = dict(os.environ, BLOCKATTN_KERNELS=variant, TRITON_CACHE_DIR=cache)
    cmd = [sys.executable, "-m", "blockattn_layers.bench.variant_ab", "--device", args.device, "--calls", str(calls),
           "--rounds", str(args.rounds), "--rows-to", out, *args.points]
    return subprocess.Popen(cmd, env=env)


def compare(args: argparse.Namespace) -> Dict[str, List[dict]]:
    """Every variant's rows: compiled in parallel processes, then timed one process at a time."""
    variants = args.variants.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        caches = {v: os.path.join(args.cache_root or tmp, f"triton_{v}") for v in variants}
        warm = [_child(v, args, os.path.join(tmp, f"warm_{v}.json"), caches[v], 1) for v in variants]
        if any(p.wait() for p in warm):
            raise RuntimeError("a variant's warm-up process failed (its output is above)")
        for v in variants:
            out = os.path.join(tmp, f"rows_{v}.json")
            if _child(v, args, out, caches[v], args.calls).wait():
                raise RuntimeError(f"variant {v}'s timing process failed (its output is above)")
            with open(out) as f:
                results[v] = json.load(f)
    return results


def table(results: Dict[str, List[dict]], tolerance: float) -> str:
    """One line per point: each variant's ms (and the first one's time over each other's), its
    largest error, ``!`` past ``tolerance``; ``(name)`` after the ms where another variant ran."""
    variants = list(results)
    lines = ["point".ljust(24) + "".join(f"{v + ' ms':>14}{'max err':>10}" for v in variants)
             + "".join(f"{variants[0] + '/' + v:>16}" for v in variants[1:])]
    for i, row in enumerate(results[variants[0]]):
        line = row["point"].ljust(24)
        for v in variants:
            r = results[v][i]
            err = max(r["errors"].values())
            ms = f"{r['ms'] or 0.0:.3f}" + ("" if r["ran"] in (v, "reference") else f" ({r['ran']})")
            line += f"{ms:>14}{err:>9.4f}{'!' if err > tolerance else ' '}"
        first = row["ms"]
        for v in variants[1:]:
            other = results[v][i]["ms"]
            line += f"{first / other:>16.3f}" if first and other else f"{'-':>16}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m blockattn_layers.bench.variant_ab", description=__doc__.split("\n")[0])
    p.add_argument("points", nargs="+", help="kind:block:dim:heads:kv_heads:rotary_dim:causal")
    p.add_argument("--variants", default="hopper,simple", help="comma-separated block-kernel variants")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=20, help="calls between the CUDA events of a round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tolerance", type=float, default=0.05, help="largest error that passes (bf16 outputs)")
    p.add_argument("--cache-root", default=None, help="folder for the per-variant Triton caches (default: temporary)")
    p.add_argument("--out", default=None, help="JSON file for every variant's rows")
    p.add_argument("--rows-to", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    points = [Point.parse(t) for t in args.points]
    if args.rows_to:  # one variant's process (forced through BLOCKATTN_KERNELS)
        with open(args.rows_to, "w") as f:
            json.dump(run_points(points, args.device, args.calls, args.rounds), f)
        return 0
    results = compare(args)
    print(table(results, args.tolerance))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    bad = [v for v, rows in results.items() for r in rows if max(r["errors"].values()) > args.tolerance]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
