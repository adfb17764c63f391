"""Merge grid slices into the repository's record of the shape grid and redraw its heat map.

``python -m blockattn_layers.bench.grid_merge --csv BENCHMARKS_grid.csv --png BENCHMARKS_grid.png
S27i=/path/to/grid.csv S27s=other/grid.csv`` reads each slice's ``grid.csv`` (what ``--grid`` runs
write beside their results), names its rows after the slice, puts them in place of the record's
rows of the same points (``case`` and ``dtype``) and adds the others, then writes the record in its
own column order and, with ``--png``, the heat map of every recorded point of the slices' dtype
(``grid.heatmap``). It prints, for that dtype, how many points are recorded, how many are within
the issue's bounds (forward <= 1.10x floor, backward <= 1.25x; also 1.5x) and where a peer is
faster.

A slice's rows carry the kernel variant ours ran per mode (``fwd_variant``, ``bwd_variant``) when
the bench recorded it; a record column the slice lacks is left empty in its rows, and a slice column
the record lacks (ours' TFLOP/s and the rate the target needs, ``fwd_tflops``, ``fwd_target_tflops``
and the backward's, since session 53) is added, empty in the older rows. The summary also counts the
points whose target needs more TFLOP/s than the fastest attention measured on the H200.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from . import grid

_INT_COLUMNS = ("block", "dim")


def read_rows(path: str) -> Tuple[List[str], List[Dict[str, str]]]:
    """``(columns, rows)`` of a CSV file."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def merge(record: Sequence[Dict[str, str]], columns: Sequence[str],
          slices: Sequence[Tuple[str, Sequence[Dict[str, str]]]]) -> List[Dict[str, str]]:
    """The record with each slice's rows (named ``slice``) in place of its rows of the same point
    (``case`` and ``dtype``), in the record's order, then the slices' new points in their order."""
    merged = {_key(r): dict(r) for r in record}
    for name, rows in slices:
        for row in rows:
            merged[_key(row)] = dict({c: ("" if row.get(c) is None else row[c]) for c in columns}, slice=name)
    return [{c: row.get(c, "") for c in columns} for row in merged.values()]


def _key(row: Dict[str, str]) -> Tuple[str, str]:
    return row["case"], row.get("dtype") or ""


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def as_points(rows: Sequence[Dict[str, str]]) -> List[Dict[str, object]]:
    """Rows read back as ``grid.points`` gives them (numbers as numbers, empty cells as ``None``)."""
    pts = []
    for r in rows:
        p: Dict[str, object] = dict(r)
        for c in _INT_COLUMNS:
            p[c] = int(r[c])
        for c, v in r.items():
            if c.endswith(("_ms", "_x_floor", "_speedup", "_tflops")):
                p[c] = _number(v)
        pts.append(p)
    return pts


def summary(pts: Sequence[Dict[str, object]]) -> str:
    """Points recorded, within the bounds (and 1.5x) per mode, and where a peer is faster."""
    lines = [f"{len(pts)} points"]
    for mode, bound in grid.TARGET_X.items():
        xs = [p[f"{mode}_x_floor"] for p in pts if p.get(f"{mode}_x_floor") is not None]
        faster = [str(p["case"]) for p in pts if grid.slower(p, mode)]
        lines.append(f"{mode}: timed {len(xs)}, <= {bound:.2f}x floor at {sum(x <= bound for x in xs)}, "
                     f"<= 1.5x at {sum(x <= 1.5 for x in xs)}; a peer is faster at {len(faster)}"
                     + (": " + ", ".join(faster) if faster else "") + "; " + _rate_text(pts, mode))
    return "\n".join(lines)


def _rate_text(pts: Sequence[Dict[str, object]], mode: str) -> str:
    """Where the target needs more TFLOP/s than the fastest attention measured on the H200
    (``grid.BEST_ATTENTION_TFLOPS``): the target rates of the record's rows are worked out from their
    coordinates and floors (``grid.point_flop``) when the row does not carry them."""
    best = grid.BEST_ATTENTION_TFLOPS[mode]
    need = {}
    for p in pts:
        rate = p.get(f"{mode}_target_tflops")
        if rate is None and p.get(f"{mode}_floor_ms") is not None:
            rate = grid.target_tflops(grid.point_flop(p, mode), p[f"{mode}_floor_ms"], mode)
        if rate is not None:
            need[str(p["case"])] = rate
    beyond = [name for name, rate in need.items() if rate > best]
    top = max(need.values(), default=0.0)
    return (f"the target needs more than {best:.0f} TFLOP/s (the fastest attention measured on the H200) at "
            f"{len(beyond)} of {len(need)} points (at most {top:.0f})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("slices", nargs="+", metavar="NAME=GRID_CSV", help="a slice's name and its grid.csv")
    parser.add_argument("--csv", required=True, help="the record to update (created if absent)")
    parser.add_argument("--png", help="also draw the heat map of every recorded point here")
    parser.add_argument("--label", default="", help="the heat map's commit line (e.g. the slices' range)")
    args = parser.parse_args(argv)
    slices = []
    for spec in args.slices:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"a slice is NAME=GRID_CSV, got {spec!r}")
        slices.append((name, read_rows(path)[1]))
    if os.path.exists(args.csv):
        columns, record = read_rows(args.csv)
    else:
        columns, record = ["slice"] + read_rows(args.slices[0].partition("=")[2])[0], []
    columns += [c for _, slice_rows in slices for c in (slice_rows[0] if slice_rows else {}) if c != "slice"]
    columns = list(dict.fromkeys(columns))
    rows = merge(record, columns, slices)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    dtype = slices[0][1][0].get("dtype") if slices[0][1] else None
    pts = as_points([r for r in rows if dtype is None or r.get("dtype") == dtype])
    if args.png:
        first = pts[0]
        meta = {"commit": args.label or first.get("commit"), "device_name": first.get("device_name"),
                "torch": first.get("torch"), "dtype": first.get("dtype")}
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(grid.heatmap(tmp, pts, meta), args.png)
    print(summary(pts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
