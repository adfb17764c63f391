"""Command line of ``python -m blockattn_layers.bench``."""
from __future__ import annotations

import argparse
import os
import time
from typing import Iterable, List, Optional

import torch

from . import grid
from .baselines import BASELINES
from .common import Method, RunConfig
from .env import bandwidth_text, device_name, floor_bandwidth, metadata
from .layer import LAYER_METHODS
from .precompile import precompile
from .ours import block_kernels, our_methods
from .report import format_table, plot, write_results
from .runner import MODES, Timing, case_summary, finalize, run_case
from .shapes import SHAPES, build_cases, resolve

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GROUPS = {"ours": "ours", "baselines": "baseline"}


def all_methods() -> List[Method]:
    return our_methods() + BASELINES + LAYER_METHODS


def select_methods(spec: Optional[str]) -> List[Method]:
    """``None`` = every method but the opt-in ones; else names and/or the groups ``ours`` and
    ``baselines``, comma-separated (a group leaves out its opt-in methods; a name takes any)."""
    methods = all_methods()
    if not spec:
        return [m for m in methods if not m.opt_in]
    wanted = {t.strip() for t in spec.split(",") if t.strip()}
    known = {m.name for m in methods} | set(GROUPS)
    unknown = sorted(wanted - known)
    if unknown:
        raise SystemExit(f"unknown --backends {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    kinds = {GROUPS[t] for t in wanted if t in GROUPS}
    return [m for m in methods if m.name in wanted or (m.kind in kinds and not m.opt_in)]


def grid_methods(spec: Optional[str], methods: List[Method], device: torch.device) -> List[Method]:
    """Methods run on grid points: as --backends says, else the grid's default set for the device."""
    if spec:
        return methods
    wanted = grid.default_methods(device)
    return [m for m in methods if m.name in wanted]


def _modes(spec: str) -> List[str]:
    modes = list(MODES) if spec == "all" else [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes takes a comma list of {', '.join(MODES)} (or all), got {spec!r}")
    return modes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m blockattn_layers.bench",
        description="Check and time our block-attention backends against built-in baselines.",
    )
    p.add_argument("--shapes", default=None,
                   help=f"comma list of {', '.join(SHAPES)}; 'default' = prod,prod_aligned,small (the default "
                        "with CUDA; tiny without); 'all' = every shape but tiny and grid (issue 25's "
                        f"{grid.n_points()}-point grid, see --grid)")
    p.add_argument("--grid", nargs="+", default=None, metavar="AXIS=V1,V2",
                   help="run a slice of the shape grid (implies --shapes grid), e.g. --grid block=64,128 "
                        "dim=128,256 heads=2x2,8x2 rotary=none,split causal=no; axes (all values unless "
                        "sliced): block 16,32,64,128; dim 32,64,96,128,256; heads 2x2,8x2,4x1 (query x kv); "
                        "rotary none,split,interleaved,partial (rotary_dim D/2); causal no,yes; lengths "
                        "prod,aligned (default prod; aligned = rounded up to the block, where cuDNN runs). "
                        "Grid points time fwd,bwd with 10 ms warm-up / 40 ms repetition unless --modes, "
                        "--warmup, --rep or --quick say otherwise, run the grid's peers unless --backends is "
                        "given, and add grid.csv, grid_table.txt and (with --plot) grid.png. The full grid "
                        "at the default size: ~6 min on an H200 with warm compile caches, estimated, plus "
                        "cold compiles on a fresh machine (bench/grid.py)")
    p.add_argument("--grid-batch", type=int, default=grid.DEFAULT_BATCH,
                   help=f"sequences per grid point (default {grid.DEFAULT_BATCH}: T ~ 1.0M; fewer for a quick look)")
    p.add_argument("--grid-max-len", type=int, default=grid.DEFAULT_MAX_LEN,
                   help=f"grid lengths are uniform in [1, this] (default {grid.DEFAULT_MAX_LEN}, as prod)")
    p.add_argument("--precompile", type=int, default=0, metavar="N",
                   help="first fill the Triton / Inductor disk caches from N processes (one untimed forward and "
                        "backward of each compiling method per case): a cold grid run compiles every point")
    p.add_argument("--backends", default=None,
                   help="comma list of method names and/or 'ours', 'baselines' (default: all); see --list")
    p.add_argument("--modes", default=None,
                   help="comma list of fwd, bwd, fwd+bwd (default: all; fwd,bwd on grid points)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="shorter warm-up and repetition (rough numbers)")
    p.add_argument("--warmup", type=int, default=None, help="do_bench warm-up, ms (default 25; quick 10)")
    p.add_argument("--rep", type=int, default=None, help="do_bench repetition time, ms (default 150; quick 50)")
    p.add_argument("--out", default="bench_out", help="directory for results.csv/json, table.txt, results.png")
    p.add_argument("--plot", action="store_true", help="also write results.png (needs matplotlib)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="bytes/s (read + write) for the memory floor (default: 4.27e12, the H200's copy, on an "
                        "H200; else measured on the device: a 4 GiB device copy on other GPUs, a 256 MiB host "
                        "copy on the CPU)")
    p.add_argument("--measure-bandwidth", action="store_true",
                   help="measure the floor's bandwidth on an H200 too, instead of taking 4.27e12")
    p.add_argument("--with-reference", action="store_true", help="time the reference backend at large sizes too")
    p.add_argument("--host-offsets", action="store_true", help="pass cpu_offsets and max_seqlen to our backends")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no per-method progress lines")
    p.add_argument("--list", action="store_true", help="list shapes and methods, then exit")
    return p


def _list() -> None:
    print("shapes:")
    for name, build in SHAPES.items():
        if name == "grid":
            print(f"  {'grid':<20} {grid.describe()} (see --grid)")
            continue
        for case in build():
            print(f"  {case.name:<20} {case.describe()}")
    print("methods:")
    for m in all_methods():
        note = f" [opt-in, run only when --backends names it: {m.opt_in}]" if m.opt_in else ""
        print(f"  {m.name:<16} {m.kind:<9} {m.description}{note}")


def main(argv: Optional[Iterable[str]] = None) -> int:
    args = parser().parse_args(None if argv is None else list(argv))
    if args.list:
        _list()
        return 0
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    try:
        spec = args.shapes or ("grid" if args.grid else "default" if device.type == "cuda" else "tiny")
        names = resolve(spec)
        if args.grid and "grid" not in names:
            names.append("grid")
        selection = grid.parse_slice(args.grid)
        cases = build_cases(names, selection, args.grid_batch, args.grid_max_len)
    except ValueError as err:
        raise SystemExit(str(err))
    methods = select_methods(args.backends)
    gmethods = grid_methods(args.backends, methods, device)
    modes = _modes(args.modes or "all")
    gmodes = grid.modes_for(args.modes is not None, modes)
    timing = Timing(
        warmup_ms=args.warmup or (10 if args.quick else 25), rep_ms=args.rep or (50 if args.quick else 150),
        cpu_reps=1 if args.quick else 5,
    )
    gtiming = Timing(warmup_ms=args.warmup or grid.WARMUP_MS, rep_ms=args.rep or grid.REP_MS,
                     cpu_reps=1 if args.quick else 3)
    if "grid" in names:
        print(f"grid: {grid.describe(selection, args.grid_batch, args.grid_max_len)}; modes {','.join(gmodes)}; "
              f"methods {', '.join(m.name for m in gmethods)}", flush=True)
    bandwidth, source = floor_bandwidth(device, args.bandwidth, args.measure_bandwidth)
    print(f"device {device_name(device)} | memory floor at {bandwidth_text(bandwidth)}: {source}", flush=True)
    if device.type != "cuda":
        print("no CUDA device: GPU-only baselines are skipped; timings are host-clock medians", flush=True)
    cfg = RunConfig(device=device, dtype=dtype, with_reference=args.with_reference, host_offsets=args.host_offsets)

    if args.precompile > 0:
        warm_s, problems = precompile(cases, methods, gmethods, cfg, args.precompile, args.seed)
        print(f"precompiled {len(cases)} cases in {args.precompile} processes: {warm_s:.1f} s"
              + "".join(f"\n  {p}" for p in problems), flush=True)
    start = time.perf_counter()
    rows, summaries = [], {}
    previous_key = None
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        summaries[case.name] = case_summary(case, dtype, bandwidth)
        on_grid = case.coords is not None
        if on_grid:
            summaries[case.name]["kernels"] = block_kernels(case, cfg)
        # Consecutive grid points with one compile key keep their compiled rotary graphs.
        reset = case.compile_key is None or case.compile_key != previous_key
        previous_key = case.compile_key
        case_rows = run_case(case, gmethods if on_grid else methods, cfg, gtiming if on_grid else timing,
                             gmodes if on_grid else modes, args.seed, progress=not args.quiet,
                             reset_compiled=reset)
        rows += case_rows
        print(f"[{i + 1}/{len(cases)}] {case.name}: {len(case_rows)} rows in {time.perf_counter() - t0:.1f} s",
              flush=True)
    finalize(rows, summaries)

    meta = metadata(device, dtype, bandwidth, source)
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    grid_names = {c.name for c in cases if c.coords is not None}
    other = {n: s for n, s in summaries.items() if n not in grid_names}
    other_rows = [r for r in rows if r["case"] in other]
    table = format_table(rows, summaries, meta)
    printed = [format_table(other_rows, other, meta)] if other else []
    pts = grid.points(rows, summaries, gmodes) if grid_names else []
    if pts:
        grid_table = grid.format_table(pts, meta, gmodes)
        table += "\n\n" + grid_table
        printed.append(grid_table)
    paths = write_results(args.out, rows, summaries, meta, table)
    if pts:
        paths.append(grid.write_csv(args.out, pts, meta))
        paths.append(os.path.join(args.out, "grid_table.txt"))
        with open(paths[-1], "w") as f:
            f.write(grid_table + "\n")
    if args.plot:
        try:
            if other:
                paths.append(plot(args.out, other_rows, other, meta))
            if pts:
                paths.append(grid.heatmap(args.out, pts, meta, gmodes))
        except ImportError as err:
            print(f"--plot skipped: {err}")
    print("\n\n".join(printed))
    print(f"wrote {', '.join(paths)} ({meta['wall_s']} s)")
    return 0
