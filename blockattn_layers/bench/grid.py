"""The shape grid of issue 25: block x head dim x heads x rotary x causal on prod-like lengths.

``python -m blockattn_layers.bench --shapes grid`` runs every point (480, the issue's product);
``--grid block=64,128 dim=128,256 heads=8x2 rotary=none,split causal=no`` runs a slice (an axis left
out keeps all its values; ``--grid`` alone implies ``--shapes grid``). Axes and values:

* ``block``: 16, 32, 64, 128
* ``dim``: 32, 64, 96, 128, 256
* ``heads``: 2x2, 8x2, 4x1 (query x k/v heads: MHA, GQA 4:1, MQA)
* ``rotary``: none, split (rotary_dim = D), interleaved (rotary_dim = D), partial (rotary_dim = D/2, split)
* ``causal``: no, yes
* ``lengths``: prod (the default: uniform in [1, 4000], seeded) and/or aligned (the same lengths
  rounded up to a multiple of the block, where SDPA's cuDNN backend runs on the dense block view)

Every point shares one set of lengths: ``--grid-batch`` sequences (default 512, T ~ 1.0M) uniform
in ``[1, --grid-max-len]`` (default 4000). Floors as PERFORMANCE.md, with q, o, dO, dq at the query
heads and k, v, dk, dv at the k/v heads.

Peers per point (each checked against the reference before it is timed, as every row is): FA2
varlen on the block bounds (``fa2_varlen``; rotary points: ``rope_comp+fa2``, rotary under
torch.compile then FA2; ``rope_eager+fa2`` runs with ``--backends``), SDPA cuDNN on the aligned
block view (``sdpa_cudnn`` / ``rope_comp+cudnn``, ``lengths=aligned`` points only: skipped with
that reason elsewhere), FlashAttention-4 varlen (``fa4_varlen``, where ``flash_attn.cute``
imports, skipped with the import error otherwise; no rotary). Ours: the ``triton`` backend (what
``auto`` runs on the GPU).

Time of the full grid at the default size (H200, compile caches warm), the arithmetic: the timed
part does not depend on B (do_bench runs each mode for its repetition time, here 10 ms warm-up +
40 ms), so a method costs a point ~30 ms of check + 2 modes x ~70 ms + one garbage collection
(~0.1 s) ~ 0.27 s; a non-rotary point runs 3 methods (ours, FA2, FA4), a rotary point 2 (ours,
compiled rotary + FA2); add ~0.15 s for the inputs, the float32 oracle and the floors: 120 x 0.95 s
+ 360 x 0.7 s ~ 6 min. Not measured yet, and compiles come on top on a fresh machine: every grid
point is a new specialization of our Triton kernels (head dim, block, causal, group size and
rotary form are constexprs), the rotary's torch.compile runs once per lengths x heads x D x rotary
form (45 graphs; consecutive points share them) and FA4's CuTe JIT once per D x heads x causal.
``--precompile N`` compiles them first in N processes (``bench/precompile.py``); run slices
(e.g. one rotary form at a time, 120 points) until the cold-compile cost is known.
B only sets the GPU time per call: at B=512 (T = 1,066,526) the smallest point (D32, 2x2) moves
0.55 GB forward (a 0.13 ms floor), above the ~30-60 us host time of a call, and the largest
(D256, 8x2) 10.9 GB (2.6 ms floor); its float32 oracle needs an estimated 50-60 GB of the H200's 139.
"""
from __future__ import annotations

import csv
import math
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .common import Case
from .report import ms_text, ratio_text
from .runner import FLOP_PER_PAIR, attention_pairs

AXES: Dict[str, Tuple[object, ...]] = {
    "block": (16, 32, 64, 128),
    "dim": (32, 64, 96, 128, 256),
    "heads": ((2, 2), (8, 2), (4, 1)),
    "rotary": ("none", "split", "interleaved", "partial"),
    "causal": (False, True),
    "lengths": ("prod", "aligned"),
}
# Axes whose values all run unless a slice says otherwise; ``lengths`` defaults to prod only.
DEFAULTS: Dict[str, Tuple[object, ...]] = dict(AXES, lengths=("prod",))
DEFAULT_BATCH = 512
DEFAULT_MAX_LEN = 4000
ROPE_THETA = 10000.0
LENGTHS_SEED = 0
# Timing of grid points unless --warmup / --rep / --quick say otherwise (ms).
WARMUP_MS, REP_MS = 10, 40
GRID_MODES = ("fwd", "bwd")
# Methods run on grid points when --backends is not given.
GPU_METHODS = ("triton", "fa2_varlen", "rope_comp+fa2", "sdpa_cudnn", "rope_comp+cudnn", "fa4_varlen")
CPU_METHODS = ("reference", "eager")
# The targets (x floor), shown in the summary line.
TARGET_X = {"fwd": 1.10, "bwd": 1.25}
# The fastest attention measured on the H200 (PERFORMANCE.md: FlashAttention-4 varlen, full attention over seed3's
# 1-3k-token sequences, bf16, the backward's FLOPs counted as 2.5x the forward's), TFLOP/s. A point whose target
# needs a higher rate asks its block kernel to out-run the strongest long-sequence kernel on this GPU.
BEST_ATTENTION_TFLOPS = {"fwd": 549.0, "bwd": 521.0}
_CAUSAL_WORDS = {"no": False, "yes": True, "false": False, "true": True, "0": False, "1": True}


def _value_text(axis: str, value: object) -> str:
    if axis == "heads":
        return f"{value[0]}x{value[1]}"
    if axis == "causal":
        return "yes" if value else "no"
    return str(value)


def _parse_value(axis: str, text: str) -> object:
    """One value of ``axis`` from its text; ValueError naming the option and the allowed values."""
    allowed = ", ".join(_value_text(axis, v) for v in AXES[axis])
    bad = ValueError(f"--grid {axis}={text}: {text!r} is not a grid value; {axis} takes {allowed}")
    t = text.strip().lower()
    if axis in ("block", "dim"):
        value: object = int(t) if t.isdigit() else None
    elif axis == "heads":
        parts = t.split("x")
        value = tuple(int(p) for p in parts) if len(parts) == 2 and all(p.isdigit() for p in parts) else None
    elif axis == "causal":
        value = _CAUSAL_WORDS.get(t)
    else:
        value = t
    if value is None or value not in AXES[axis]:
        raise bad
    return value


def parse_slice(tokens: Optional[Sequence[str]]) -> Dict[str, Tuple[object, ...]]:
    """``["block=64,128", "dim=128"]`` (or one string with spaces) -> every axis' values, in grid order.

    An axis left out keeps its default values; ValueError (naming ``--grid``) on an unknown axis,
    an axis given twice, a token without ``=``, an empty or unknown value."""
    selection = dict(DEFAULTS)
    seen = set()
    for token in (t for part in (tokens or ()) for t in part.split()):
        if "=" not in token:
            raise ValueError(f"--grid takes AXIS=V1,V2 ... ({', '.join(AXES)}), got {token!r}")
        axis, _, values = token.partition("=")
        axis = axis.strip().lower()
        if axis not in AXES:
            raise ValueError(f"--grid: unknown axis {axis!r}; axes: {', '.join(AXES)}")
        if axis in seen:
            raise ValueError(f"--grid: axis {axis!r} given twice")
        seen.add(axis)
        texts = [v for v in values.split(",") if v.strip()]
        if not texts:
            raise ValueError(f"--grid {axis}=: no values; {axis} takes "
                             f"{', '.join(_value_text(axis, v) for v in AXES[axis])}")
        wanted = {_parse_value(axis, v) for v in texts}
        selection[axis] = tuple(v for v in AXES[axis] if v in wanted)
    return selection


def grid_lengths(batch: int = DEFAULT_BATCH, max_len: int = DEFAULT_MAX_LEN) -> torch.Tensor:
    """``batch`` host int64 lengths uniform in ``[1, max_len]``, seeded (prod-like)."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"--grid-batch and --grid-max-len must be >= 1, got {batch} and {max_len}")
    gen = torch.Generator().manual_seed(LENGTHS_SEED)
    return torch.randint(1, max_len + 1, (batch,), generator=gen, dtype=torch.int64)


def point_name(block: int, dim: int, heads: Tuple[int, int], rotary: str, causal: bool, lengths: str) -> str:
    name = f"grid/b{block}-d{dim}-h{heads[0]}x{heads[1]}-{rotary}-{'causal' if causal else 'nocausal'}"
    return name + ("-aligned" if lengths == "aligned" else "")


def _rotary_args(rotary: str, dim: int) -> dict:
    if rotary == "none":
        return {}
    return dict(rope_theta=ROPE_THETA, rotary_interleaved=rotary == "interleaved",
                rotary_dim=dim // 2 if rotary == "partial" else None)


def cases(selection: Optional[Dict[str, Tuple[object, ...]]] = None, batch: int = DEFAULT_BATCH,
          max_len: int = DEFAULT_MAX_LEN) -> List[Case]:
    """The grid's points as cases, ordered so that points sharing compiled rotary graphs (same
    lengths, heads, D and rotary form) are consecutive: block and causal vary fastest."""
    sel = dict(DEFAULTS) if selection is None else selection
    base = grid_lengths(batch, max_len)
    out = []
    for lengths in sel["lengths"]:
        for heads in sel["heads"]:
            for dim in sel["dim"]:
                for rotary in sel["rotary"]:
                    for causal in sel["causal"]:
                        for block in sel["block"]:
                            lens = base if lengths == "prod" else (base + block - 1) // block * block
                            coords = (("block", block), ("dim", dim), ("heads", f"{heads[0]}x{heads[1]}"),
                                      ("rotary", rotary), ("causal", "yes" if causal else "no"),
                                      ("lengths", lengths))
                            out.append(Case(
                                point_name(block, dim, heads, rotary, causal, lengths), "grid", lens, heads[0],
                                dim, block, num_kv_heads=heads[1], causal=causal, coords=coords,
                                **_rotary_args(rotary, dim),
                            ))
    return out


def point_flop(p: Dict[str, object], mode: str) -> Optional[float]:
    """FLOP of ``mode`` (``runner.FLOP_PER_PAIR``) at the grid point ``p`` (a ``points`` dict or a
    record row): its in-block (query, key) pairs at the grid's default lengths x query heads x D;
    ``None`` where the point's ``T`` is not those lengths' total (a run with other ``--grid-batch`` /
    ``--grid-max-len``)."""
    (case,) = cases({axis: (_parse_value(axis, str(p[axis])),) for axis in AXES})
    if p.get("T") not in (None, "") and int(p["T"]) != case.total:
        return None
    return FLOP_PER_PAIR[mode] * attention_pairs(case) * case.num_heads * case.head_dim


def target_tflops(flop: Optional[float], floor_ms: Optional[float], mode: str) -> Optional[float]:
    """TFLOP/s a kernel must sustain to run ``flop`` within ``TARGET_X[mode]`` of a ``floor_ms`` floor."""
    if not flop or not floor_ms or mode not in TARGET_X:
        return None
    return flop / (TARGET_X[mode] * floor_ms * 1e-3) / 1e12


def n_points(selection: Optional[Dict[str, Tuple[object, ...]]] = None) -> int:
    sel = dict(DEFAULTS) if selection is None else selection
    return math.prod(len(v) for v in sel.values())


def default_methods(device: torch.device) -> Tuple[str, ...]:
    return GPU_METHODS if device.type == "cuda" else CPU_METHODS


# ----------------------------------------------------------------------------- results per point
def _ours(rows: Sequence[Dict[str, object]]) -> Optional[Dict[str, object]]:
    """The first checked backend of ours in priority order (forced-variant rows left out)."""
    for r in rows:
        if r["kind"] == "ours" and "[" not in str(r["method"]) and r["status"] == "ok":
            return r
    return None


def points(rows: Sequence[Dict[str, object]], summaries: Dict[str, Dict[str, object]],
           modes: Sequence[str] = GRID_MODES) -> List[Dict[str, object]]:
    """One dict per grid point: its coordinates, floors, ours (ms, x floor, TFLOP/s) and, per mode, the
    kernel variant ours ran (the summary's ``kernels``, where recorded), the TFLOP/s the target needs
    (``target_tflops``), the best checked peer (name, ms) and ``speedup = peer ms / ours ms`` (< 1:
    ours is slower)."""
    by_case: Dict[str, List[Dict[str, object]]] = {}
    for r in rows:
        by_case.setdefault(str(r["case"]), []).append(r)
    out = []
    for name, s in summaries.items():
        if not s.get("grid"):
            continue
        case_rows = by_case.get(name, [])
        ours = _ours(case_rows)
        p: Dict[str, object] = dict(case=name, **s["grid"], T=s.get("T"), ours=ours["method"] if ours else None)
        for mode in modes:
            p[f"{mode}_variant"] = (s.get("kernels") or {}).get(mode)
            floor = s.get(f"{mode}_floor_ms")
            p[f"{mode}_floor_ms"] = floor
            ms = ours.get(f"{mode}_ms") if ours else None
            p[f"{mode}_ms"] = ms
            p[f"{mode}_x_floor"] = ms / floor if ms and floor else None
            p[f"{mode}_tflops"] = ours.get(f"{mode}_tflops") if ours else None  # (``runner.finalize``'s)
            p[f"{mode}_target_tflops"] = target_tflops(s.get(f"{mode}_flop"), floor, mode)
            peers = [r for r in case_rows if r["kind"] == "baseline" and r["status"] == "ok" and r.get(f"{mode}_ms")]
            best = min(peers, key=lambda r: r[f"{mode}_ms"]) if peers else None
            p[f"{mode}_peer"] = best["method"] if best else None
            p[f"{mode}_peer_ms"] = best[f"{mode}_ms"] if best else None
            p[f"{mode}_speedup"] = best[f"{mode}_ms"] / ms if best and ms else None
        out.append(p)
    return out


def slower(p: Dict[str, object], mode: str) -> bool:
    spd = p.get(f"{mode}_speedup")
    return spd is not None and spd < 1.0


def _speedup(p: Dict[str, object], mode: str) -> str:
    spd = p.get(f"{mode}_speedup")
    return ratio_text(spd) + ("!" if slower(p, mode) else "")


def format_table(pts: Sequence[Dict[str, object]], meta: Dict[str, object], modes: Sequence[str] = GRID_MODES) -> str:
    """One line per grid point: ours ms and x floor, the best peer and our speedup per mode;
    a trailing ``!`` marks a speedup below 1 (the peer is faster)."""
    lines = [
        f"grid | {meta.get('device_name') or meta.get('gpu')} | torch {meta.get('torch')} | {meta.get('dtype')} | "
        f"commit {str(meta.get('commit'))[:12]} | {meta.get('date')}",
        "ms: median; x: ours / memory floor (k, v at their own heads); spd: best checked peer ms / ours ms, "
        "'!' = ours slower",
    ]
    head = f"{'block':>5} {'D':>4} {'heads':>5} {'rotary':<11} {'causal':<6} {'lengths':<7} {'ours':<9}"
    for m in modes:
        head += f" | {m + ' ms':>8} {'x':>5} {'best ' + m + ' peer':<16} {'ms':>8} {'spd':>6}"
    lines.append(head)
    for p in pts:
        line = (f"{p['block']:>5} {p['dim']:>4} {p['heads']:>5} {p['rotary']:<11} {p['causal']:<6} "
                f"{p['lengths']:<7} {str(p['ours'] or '-'):<9}")
        for m in modes:
            line += (f" | {ms_text(p.get(f'{m}_ms')):>8} {ratio_text(p.get(f'{m}_x_floor')):>5} "
                     f"{str(p.get(f'{m}_peer') or '-'):<16} {ms_text(p.get(f'{m}_peer_ms')):>8} {_speedup(p, m):>6}")
        lines.append(line)
    lines.append(summary_line(pts, modes))
    return "\n".join(lines)


def summary_line(pts: Sequence[Dict[str, object]], modes: Sequence[str] = GRID_MODES) -> str:
    parts = [f"{len(pts)} points"]
    for m in modes:
        timed = [p for p in pts if p.get(f"{m}_x_floor") is not None]
        target = TARGET_X.get(m)
        text = f"{m}: ours timed at {len(timed)}, slower than the best peer at {sum(slower(p, m) for p in pts)}"
        if target and timed:
            text += f", <= {target:.2f}x floor at {sum(p[f'{m}_x_floor'] <= target for p in timed)}"
            text += f", worst {max(p[f'{m}_x_floor'] for p in timed):.2f}x"
        parts.append(text)
    return "; ".join(parts)


def write_csv(out_dir: str, pts: Sequence[Dict[str, object]], meta: Dict[str, object]) -> str:
    """``grid.csv``: one row per point (coordinates, ours, best peers, speedups) stamped like results.csv."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "grid.csv")
    stamp = {k: meta.get(k) for k in ("date", "commit", "device_name", "torch", "triton", "dtype",
                                       "bandwidth_bytes_per_s")}
    rows = [dict(p, **stamp) for p in pts]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["case"])
        writer.writeheader()
        writer.writerows(rows)
    return path


# ----------------------------------------------------------------------------- heat map
def _present(pts: Sequence[Dict[str, object]], axis: str) -> List[object]:
    order = [_value_text(axis, v) if axis in ("heads", "causal") else v for v in AXES[axis]]
    have = {p[axis] for p in pts}
    return [v for v in order if v in have]


def heatmap(out_dir: str, pts: Sequence[Dict[str, object]], meta: Dict[str, object],
            modes: Sequence[str] = GRID_MODES) -> str:
    """``grid.png``: x floor of ours as block x D heat maps, one row of panels per heads / causal /
    lengths combination, one column per rotary form and mode (forward columns first). Each cell is
    annotated with its x floor; ``!`` marks a point where the best peer is faster; ``-`` untimed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize

    if not pts:
        raise ValueError("no grid points to plot")
    blocks, dims = _present(pts, "block"), _present(pts, "dim")
    facets = [(h, c, l) for l in _present(pts, "lengths") for h in _present(pts, "heads")
              for c in _present(pts, "causal")]
    facets = [f for f in facets if any((p["heads"], p["causal"], p["lengths"]) == f for p in pts)]
    rotaries = _present(pts, "rotary")
    columns = [(m, r) for m in modes for r in rotaries]
    index = {(p["heads"], p["causal"], p["lengths"], p["rotary"], p["block"], p["dim"]): p for p in pts}
    values = [p[f"{m}_x_floor"] for p in pts for m in modes if p.get(f"{m}_x_floor") is not None]
    vmax = max(2.0, min(4.0, max(values))) if values else 2.0
    norm = Normalize(vmin=1.0, vmax=vmax)
    cmap = matplotlib.colormaps["RdYlGn_r"].with_extremes(bad="#d9d9d9")

    width = 0.42 * len(dims) + 0.6
    height = 0.32 * len(blocks) + 0.7
    fig, axes = plt.subplots(len(facets), len(columns), squeeze=False, layout="constrained",
                             figsize=(max(6.0, width * len(columns) + 1.2), max(3.0, height * len(facets) + 1.0)))
    image = None
    for i, (heads, causal, lengths) in enumerate(facets):
        for j, (mode, rotary) in enumerate(columns):
            ax = axes[i, j]
            grid = [[math.nan] * len(dims) for _ in blocks]
            for bi, block in enumerate(blocks):
                for di, dim in enumerate(dims):
                    p = index.get((heads, causal, lengths, rotary, block, dim))
                    x = p.get(f"{mode}_x_floor") if p else None
                    text = "-" if x is None else ratio_text(x) + ("!" if slower(p, mode) else "")
                    if x is not None:
                        grid[bi][di] = x
                    ax.text(di, bi, text, ha="center", va="center", fontsize=6,
                            fontweight="bold" if p and slower(p, mode) else "normal")
            image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
            ax.set_xticks(range(len(dims)))
            ax.set_xticklabels([str(d) for d in dims], fontsize=6)
            ax.set_yticks(range(len(blocks)))
            ax.set_yticklabels([str(b) for b in blocks], fontsize=6)
            if i == 0:
                ax.set_title(f"{mode} | rotary {rotary}", fontsize=7)
            if i == len(facets) - 1:
                ax.set_xlabel("D", fontsize=6)
            if j == 0:
                suffix = "" if lengths == "prod" else f"\n{lengths}"
                ax.set_ylabel(f"H {heads}\ncausal {causal}{suffix}\nblock", fontsize=6)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="x floor")
    fig.suptitle(f"ours x floor | {meta.get('device_name') or meta.get('gpu')} | torch {meta.get('torch')} | "
                 f"{meta.get('dtype')} | {str(meta.get('commit'))[:12]} | '!' = the best peer is faster", fontsize=8)
    path = os.path.join(out_dir, "grid.png")
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def describe(selection: Optional[Dict[str, Tuple[object, ...]]] = None, batch: int = DEFAULT_BATCH,
             max_len: int = DEFAULT_MAX_LEN) -> str:
    sel = dict(DEFAULTS) if selection is None else selection
    axes = " ".join(f"{a}={','.join(_value_text(a, v) for v in vals)}" for a, vals in sel.items())
    lengths = grid_lengths(batch, max_len)
    return f"{n_points(sel)} points ({axes}); B {batch}, T {int(lengths.sum()):,}, lengths uniform in [1, {max_len}]"


def modes_for(spec_given: bool, modes: Iterable[str]) -> List[str]:
    """Grid points time fwd and bwd unless --modes was given."""
    return list(modes) if spec_given else list(GRID_MODES)
