"""Results out: the printed table, CSV and JSON files, a PNG plot, and a Markdown snippet.

``python -m blockattn_layers.bench.report --markdown bench_out/results.json`` prints the
Markdown tables for BENCHMARKS.md from a saved run.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
from typing import Dict, Iterable, List, Optional

from .env import bandwidth_text

MODES = ("fwd", "bwd", "fwd+bwd")
_SHORT = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "f+b"}
_META_IN_CSV = ("date", "commit", "gpu", "torch", "triton", "python", "cuda", "dtype", "bandwidth_bytes_per_s",
                "bandwidth_source", "device_name")
_ROW_FIELDS = ("case", "shape", "method", "kind", "status", "err", "tol")
_CASE_FIELDS = ("B", "T", "max_len", "H", "H_kv", "D", "block", "causal", "rotary", "rotary_dim", "rope_theta")
# A grid point's coordinates that are not case fields already (bench/grid.py); empty elsewhere.
_GRID_FIELDS = ("heads", "lengths")
_PER_MODE = ("ms", "floor_ms", "x_floor", "speedup", "tflops", "peak_mib", "error", "rounds")


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def ms_text(x: Optional[float]) -> str:
    """Milliseconds in at most 6 characters."""
    if x is None:
        return "-"
    return format(x, ".3f") if x < 10 else format(x, ".1f") if x < 1000 else format(x, ".0f")


def ratio_text(x: Optional[float]) -> str:
    """A ratio in at most 5 characters."""
    if x is None:
        return "-"
    for limit, fmt in ((10, ".2f"), (100, ".1f"), (1e4, ".0f")):
        if x < limit:
            return format(x, fmt)
    return format(x, ".0e")


def _status(row: Dict[str, object], width: int) -> str:
    text = str(row["status"])
    if row.get("reason"):
        text += f": {row['reason']}"
    errors = [f"{_SHORT[m]}: {row[f'{m}_error']}" for m in MODES if row.get(f"{m}_error")]
    if errors:
        text += " | " + "; ".join(errors)
    return text if len(text) <= width else text[:width - 3] + "..."


def _device(meta: Dict[str, object]) -> object:
    """The device's name (stamps written before ``device_name`` existed name the GPU only)."""
    return meta.get("device_name") or meta.get("gpu")


def _floor_source(meta: Dict[str, object]) -> str:
    """``floor at <bandwidth>, <where it came from>``."""
    bandwidth = meta.get("bandwidth_bytes_per_s")
    if not bandwidth:
        return "floor: no bandwidth in the stamp"
    source = meta.get("bandwidth_source")
    return f"floor at {bandwidth_text(float(bandwidth))}" + (f", {source}" if source else "")


def format_table(rows: List[Dict[str, object]], summaries: Dict[str, Dict[str, object]],
                 meta: Dict[str, object]) -> str:
    """The compact table printed at the end of a run (one block per case)."""
    lines = [
        f"blockattn bench | {_device(meta)} | torch {meta.get('torch')} | triton {meta.get('triton')} | "
        f"{meta.get('dtype')} | commit {str(meta.get('commit'))[:12]} | {meta.get('date')}",
        "ms: median; x: time / memory floor; spd: best checked baseline / this; MiB: fwd+bwd peak; "
        "err: max rel error vs reference",
        f"memory {_floor_source(meta)}",
    ]
    head = f"  {'method':<15}" + "".join(f"{_SHORT[m] + ' ms':>9}{'x':>6}{'spd':>6}" for m in MODES)
    head += f"{'MiB':>8} {'err':>8}  status"
    for name, summary in summaries.items():
        floors = " ".join(f"{_SHORT[m]} {summary[f'{m}_floor_ms']:.3g}" for m in MODES if summary.get(f"{m}_floor_ms"))
        lines.append(f"== {name}: {summary['describe']}" + (f" | floor ms {floors}" if floors else ""))
        lines.append(head)
        skipped: Dict[str, List[str]] = {}
        for r in (r for r in rows if r["case"] == name):
            if r["status"] == "skipped":
                skipped.setdefault(str(r["reason"]), []).append(str(r["method"]))
                continue
            if r["status"] == "failed":
                lines.append(f"  {r['method']:<15}{_status(r, 90)}")
                continue
            cells = "".join(
                f"{ms_text(r.get(f'{m}_ms')):>9}{ratio_text(r.get(f'{m}_x_floor')):>6}"
                f"{ratio_text(r.get(f'{m}_speedup')):>6}"
                for m in MODES
            )
            lines.append(
                f"  {r['method']:<15}{cells}{_num(r.get('fwd+bwd_peak_mib'), '.0f'):>8} "
                f"{_num(r.get('err'), '.1e'):>8}  {_status(r, 40)}"
            )
        for reason, methods in skipped.items():
            text = f"  skipped {', '.join(methods)}: {reason}"
            lines.append(text if len(text) <= 110 else text[:107] + "...")
    return "\n".join(lines)


def _flat(row: Dict[str, object], summary: Dict[str, object], meta: Dict[str, object]) -> Dict[str, object]:
    out = {k: row.get(k) for k in _ROW_FIELDS}
    out.update({k: summary.get(k) for k in _CASE_FIELDS})
    coords = summary.get("grid") or {}
    out.update({k: coords.get(k) for k in _GRID_FIELDS})
    out["reason"] = row.get("reason")
    for m in MODES:
        for f in _PER_MODE:
            key = f"{m}_{f}"
            out[key] = summary.get(key) if f == "floor_ms" else row.get(key)
    out.update({k: meta.get(k) for k in _META_IN_CSV})
    return out


def write_results(out_dir: str, rows: List[Dict[str, object]], summaries: Dict[str, Dict[str, object]],
                  meta: Dict[str, object], table: str) -> List[str]:
    """Write ``results.csv``, ``results.json`` and ``table.txt`` under ``out_dir``; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("results.csv", "results.json", "table.txt")]
    flat = [_flat(r, summaries[r["case"]], meta) for r in rows]
    with open(paths[0], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]) if flat else list(_ROW_FIELDS))
        writer.writeheader()
        writer.writerows(flat)
    with open(paths[1], "w") as f:
        json.dump(dict(meta=meta, cases=summaries, rows=rows), f, indent=1, default=str)
    with open(paths[2], "w") as f:
        f.write(table + "\n")
    return paths


def plot(out_dir: str, rows: List[Dict[str, object]], summaries: Dict[str, Dict[str, object]],
         meta: Dict[str, object]) -> str:
    """``results.png``: per case, ms of every timed method in each mode (log scale), floors dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summaries)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 3.2 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        timed = [r for r in rows if r["case"] == name and any(r.get(f"{m}_ms") for m in MODES)]
        width = 0.8 / len(MODES)
        for j, mode in enumerate(MODES):
            xs = [i + (j - 1) * width for i in range(len(timed))]
            ax.bar(xs, [r.get(f"{mode}_ms") or 0.0 for r in timed], width, label=mode)
            floor = summaries[name].get(f"{mode}_floor_ms")
            if floor:
                ax.axhline(floor, linestyle="--", linewidth=0.8, color=f"C{j}")
        ax.set_xticks(range(len(timed)))
        ax.set_xticklabels([r["method"] for r in timed], rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"{name}: {summaries[name]['describe']}", fontsize=9)
        ax.legend(fontsize=7)
    commit = str(meta.get("commit"))[:12]
    fig.suptitle(f"{_device(meta)} | torch {meta.get('torch')} | {meta.get('dtype')} | {commit}")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    path = os.path.join(out_dir, "results.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _md_cell(row: Dict[str, object], mode: str) -> str:
    ms = row.get(f"{mode}_ms")
    if ms is None:
        return "-"
    x = row.get(f"{mode}_x_floor")
    return f"{ms_text(ms)} ({ratio_text(x)}x)" if x is not None else ms_text(ms)


def markdown(results: Dict[str, object]) -> str:
    """Markdown tables (one per case) for BENCHMARKS.md from a ``results.json`` document."""
    meta, summaries, rows = results["meta"], results["cases"], results["rows"]
    out: List[str] = [
        f"Measured {meta.get('date')} on {_device(meta)}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
        f"Python {meta.get('python')}, {meta.get('dtype')}, commit `{meta.get('commit')}`. Median ms; "
        f"x = time / memory {_floor_source(meta)}; speedup vs the best checked baseline per mode; "
        "peak = extra memory of one fwd+bwd.",
    ]
    for name, s in summaries.items():
        floors = ", ".join(f"{m} {s[f'{m}_floor_ms']:.3g} ms" for m in MODES if s.get(f"{m}_floor_ms"))
        out += ["", f"### {name}", "", f"{s['describe']}" + (f"; floor {floors}" if floors else ""), ""]
        out.append("| method | fwd ms | bwd ms | fwd+bwd ms | speedup fwd / bwd / f+b | peak MiB | max rel err "
                   "| status |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r["case"] == name):
            speed = " / ".join(_num(r.get(f"{m}_speedup"), ".2f") for m in MODES)
            status = _status(r, 120).replace("|", "/")
            out.append(
                f"| {r['method']} | {_md_cell(r, 'fwd')} | {_md_cell(r, 'bwd')} | {_md_cell(r, 'fwd+bwd')} | "
                f"{speed} | {_num(r.get('fwd+bwd_peak_mib'), '.0f')} | {_num(r.get('err'), '.1e')} | {status} |"
            )
    return "\n".join(out)


def main(argv: Optional[Iterable[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m blockattn_layers.bench.report", description=__doc__)
    parser.add_argument("--markdown", metavar="RESULTS_JSON", required=True, help="results.json of a run")
    args = parser.parse_args(None if argv is None else list(argv))
    with open(args.markdown) as f:
        print(markdown(json.load(f)))


if __name__ == "__main__":
    main()
