"""Command line of ``python -m blockattn_layers.bench``."""
from __future__ import annotations

import argparse
import time
from typing import Iterable, List, Optional

import torch

from .baselines import BASELINES
from .common import Method, RunConfig
from .env import bandwidth_text, device_name, floor_bandwidth, metadata
from .layer import LAYER_METHODS
from .ours import our_methods
from .report import format_table, plot, write_results
from .runner import MODES, Timing, case_summary, finalize, run_case
from .shapes import SHAPES, build_cases, resolve

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GROUPS = {"ours": "ours", "baselines": "baseline"}


def all_methods() -> List[Method]:
    return our_methods() + BASELINES + LAYER_METHODS


def select_methods(spec: Optional[str]) -> List[Method]:
    """``None`` = every method; else names and/or the groups ``ours`` and ``baselines``, comma-separated."""
    methods = all_methods()
    if not spec:
        return methods
    wanted = {t.strip() for t in spec.split(",") if t.strip()}
    known = {m.name for m in methods} | set(GROUPS)
    unknown = sorted(wanted - known)
    if unknown:
        raise SystemExit(f"unknown --backends {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    kinds = {GROUPS[t] for t in wanted if t in GROUPS}
    return [m for m in methods if m.name in wanted or m.kind in kinds]


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
                        "with CUDA; tiny without); 'all' = every shape but tiny")
    p.add_argument("--backends", default=None,
                   help="comma list of method names and/or 'ours', 'baselines' (default: all); see --list")
    p.add_argument("--modes", default="all", help="comma list of fwd, bwd, fwd+bwd (default: all)")
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
        for case in build():
            print(f"  {case.name:<20} {case.describe()}")
    print("methods:")
    for m in all_methods():
        print(f"  {m.name:<16} {m.kind:<9} {m.description}")


def main(argv: Optional[Iterable[str]] = None) -> int:
    args = parser().parse_args(None if argv is None else list(argv))
    if args.list:
        _list()
        return 0
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    try:
        names = resolve(args.shapes or ("default" if device.type == "cuda" else "tiny"))
    except ValueError as err:
        raise SystemExit(str(err))
    cases = build_cases(names)
    methods = select_methods(args.backends)
    modes = _modes(args.modes)
    timing = Timing(
        warmup_ms=args.warmup or (10 if args.quick else 25), rep_ms=args.rep or (50 if args.quick else 150),
        cpu_reps=1 if args.quick else 5,
    )
    bandwidth, source = floor_bandwidth(device, args.bandwidth, args.measure_bandwidth)
    print(f"device {device_name(device)} | memory floor at {bandwidth_text(bandwidth)}: {source}", flush=True)
    if device.type != "cuda":
        print("no CUDA device: GPU-only baselines are skipped; timings are host-clock medians", flush=True)
    cfg = RunConfig(device=device, dtype=dtype, with_reference=args.with_reference, host_offsets=args.host_offsets)

    start = time.perf_counter()
    rows, summaries = [], {}
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        summaries[case.name] = case_summary(case, dtype, bandwidth)
        case_rows = run_case(case, methods, cfg, timing, modes, args.seed, progress=not args.quiet)
        rows += case_rows
        print(f"[{i + 1}/{len(cases)}] {case.name}: {len(case_rows)} rows in {time.perf_counter() - t0:.1f} s",
              flush=True)
    finalize(rows, summaries)

    meta = metadata(device, dtype, bandwidth, source)
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    table = format_table(rows, summaries, meta)
    paths = write_results(args.out, rows, summaries, meta, table)
    if args.plot:
        try:
            paths.append(plot(args.out, rows, summaries, meta))
        except ImportError as err:
            print(f"--plot skipped: {err}")
    print(table)
    print(f"wrote {', '.join(paths)} ({meta['wall_s']} s)")
    return 0
