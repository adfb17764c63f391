"""CPU tests of the benchmark's shape grid (issue 25): enumeration, slices, GQA floors, a tiny run,
the table's and the heat map's marks."""
from __future__ import annotations

import csv
import dataclasses
import itertools
import json

import pytest
import torch

from blockattn_layers.bench import cli, env, grid, runner, shapes
from blockattn_layers.bench.common import Case
from tests import test_triton_gpu as gpu

pytestmark = pytest.mark.usefixtures("single_thread")


def test_grid_enumerates_the_issue_product():
    cases = grid.cases(batch=4, max_len=50)
    issue = set(itertools.product((16, 32, 64, 128), (32, 64, 96, 128, 256), ((2, 2), (8, 2), (4, 1)),
                                  ("none", "split", "interleaved", "partial"), (False, True)))
    got = {(c.block_size, c.head_dim, (c.num_heads, c.kv_heads), c.rotary_form, c.causal) for c in cases}
    assert len(cases) == len(issue) == grid.n_points() == 480 and got == issue
    assert len({c.name for c in cases}) == 480 and all(c.shape == "grid" for c in cases)
    lengths = cases[0].lengths
    assert all(torch.equal(c.lengths, lengths) for c in cases)  # prod-like lengths, shared
    assert torch.equal(lengths, grid.grid_lengths(4, 50)) and int(lengths.min()) >= 1 and int(lengths.max()) <= 50
    full = grid.grid_lengths()
    assert full.numel() == grid.DEFAULT_BATCH and 1 <= int(full.min()) and int(full.max()) <= 4000
    by = {c.name: c for c in cases}
    partial = by["grid/b64-d96-h8x2-partial-causal"]
    assert partial.rotary_dim == 48 and not partial.rotary_interleaved and partial.rope_theta == grid.ROPE_THETA
    inter = by["grid/b16-d32-h4x1-interleaved-nocausal"]
    assert inter.rotary_interleaved and inter.rotary_dim is None and inter.kv_heads == 1
    assert by["grid/b128-d256-h2x2-none-nocausal"].rope_theta is None
    # points sharing compiled rotary graphs are consecutive
    keys = [c.compile_key for c in cases]
    assert len({k for k, _ in itertools.groupby(keys)}) == len(set(keys)) == 3 * 5 * 4
    # not part of 'all'; named explicitly it is the full grid at the default size
    assert "grid" not in shapes.resolve("all") and shapes.resolve("grid") == ["grid"]


def test_slices_parse_and_reject_bad_values():
    sel = grid.parse_slice(["block=128,64", "dim=128,256", "heads=2x2", "rotary=none,split", "causal=no"])
    assert sel["block"] == (64, 128) and sel["dim"] == (128, 256) and sel["heads"] == ((2, 2),)
    assert sel["rotary"] == ("none", "split") and sel["causal"] == (False,) and sel["lengths"] == ("prod",)
    assert grid.n_points(sel) == 8 and len(grid.cases(sel, batch=3, max_len=40)) == 8
    assert grid.parse_slice(["block=64 causal=yes lengths=prod,aligned"])["lengths"] == ("prod", "aligned")
    assert grid.parse_slice(None) == grid.DEFAULTS
    aligned = grid.cases(grid.parse_slice(["block=64", "dim=32", "heads=2x2", "rotary=none", "causal=no",
                                            "lengths=aligned"]), batch=5, max_len=300)
    assert len(aligned) == 1 and aligned[0].aligned and aligned[0].name.endswith("-aligned")
    for tokens, words in [
        (["block=48"], ["--grid block=48", "16, 32, 64, 128"]),
        (["dim=80"], ["--grid dim=80", "32, 64, 96, 128, 256"]),
        (["heads=2x1"], ["--grid heads=2x1", "2x2, 8x2, 4x1"]),
        (["rotary=yarn"], ["--grid rotary=yarn", "none, split, interleaved, partial"]),
        (["causal=maybe"], ["--grid causal=maybe", "no, yes"]),
        (["width=3"], ["--grid", "unknown axis 'width'"]),
        (["block=64", "block=128"], ["--grid", "given twice"]),
        (["block"], ["--grid takes AXIS="]),
        (["dim="], ["--grid dim=", "no values"]),
    ]:
        with pytest.raises(ValueError) as err:
            grid.parse_slice(tokens)
        assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(SystemExit, match="--grid block=48"):
        cli.main(["--device", "cpu", "--grid", "block=48"])


def test_floors_count_kv_at_their_own_heads():
    lengths = torch.tensor([100, 28])
    es = 2  # bf16
    T, D = 128, 64
    gqa = Case("g", "grid", lengths, 8, D, 64, num_kv_heads=2)
    mha = Case("m", "grid", lengths, 2, D, 64)
    bw = 1e12
    s_gqa, s_mha = runner.case_summary(gqa, torch.bfloat16, bw), runner.case_summary(mha, torch.bfloat16, bw)
    # fwd: q and o at 8 heads, k and v at 2; bwd: q, dO, dq at 8, k, v, dk, dv at 2
    assert s_gqa["fwd_floor_ms"] == pytest.approx(1e3 * T * D * es * (2 * 8 + 2 * 2) / bw)
    assert s_gqa["bwd_floor_ms"] == pytest.approx(1e3 * T * D * es * (3 * 8 + 4 * 2) / bw)
    assert s_gqa["fwd+bwd_floor_ms"] == pytest.approx(s_gqa["fwd_floor_ms"] + s_gqa["bwd_floor_ms"])
    # MHA as before: 4 and 7 tensors of T * H * D
    assert s_mha["fwd_floor_ms"] == pytest.approx(1e3 * 4 * T * 2 * D * es / bw)
    assert s_mha["bwd_floor_ms"] == pytest.approx(1e3 * 7 * T * 2 * D * es / bw)
    assert s_gqa["H_kv"] == 2 and s_mha["H_kv"] == 2
    # causal halves (exactly: n (n + 1) / 2 pairs) the in-unit FLOP, not the floor
    causal = Case("c", "grid", lengths, 8, D, 64, num_kv_heads=2, causal=True)
    s_c = runner.case_summary(causal, torch.bfloat16, bw)
    pairs = 64 * 65 / 2 + 36 * 37 / 2 + 28 * 29 / 2
    assert s_c["fwd_flop"] == pytest.approx(4 * pairs * 8 * D) and s_c["fwd_floor_ms"] == s_gqa["fwd_floor_ms"]


def test_tiny_grid_slice_runs_end_to_end_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(env, "CPU_COPY_BYTES", 8 << 20)
    argv = ["--device", "cpu", "--dtype", "fp32", "--quick", "--grid", "block=16,64", "dim=32", "heads=8x2",
            "rotary=none", "causal=yes", "--grid-batch", "3", "--grid-max-len", "90", "--plot", "--quiet",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["cases"]) == {"grid/b16-d32-h8x2-none-causal", "grid/b64-d32-h8x2-none-causal"}
    for row in results["rows"]:  # ours = reference, peer = eager (GQA and causal), both checked
        assert row["method"] in grid.CPU_METHODS and row["status"] == "ok", row
        assert row["err"] < 1e-5 and row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and "fwd+bwd_ms" not in row
    with open(tmp_path / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert {(r["block"], r["D"], r["H"], r["H_kv"], r["heads"], r["rotary"], r["causal"], r["lengths"])
            for r in csv_rows} == {("16", "32", "8", "2", "8x2", "none", "True", "prod"),
                                   ("64", "32", "8", "2", "8x2", "none", "True", "prod")}
    with open(tmp_path / "grid.csv") as f:
        pts = list(csv.DictReader(f))
    assert len(pts) == 2 and all(p["ours"] == "reference" and p["fwd_peer"] == "eager" for p in pts)
    table = (tmp_path / "grid_table.txt").read_text()
    assert "best fwd peer" in table and "2 points" in table and table in (tmp_path / "table.txt").read_text()
    assert (tmp_path / "grid.png").stat().st_size > 1000


def _points():
    base = dict(dim=64, heads="8x2", rotary="none", causal="no", lengths="prod", T=100, ours="triton")
    fast = dict(base, case="a", block=64, fwd_ms=1.0, fwd_x_floor=1.05, fwd_peer="fa2_varlen", fwd_peer_ms=2.0,
                fwd_speedup=2.0, bwd_ms=2.0, bwd_x_floor=1.2, bwd_peer="fa2_varlen", bwd_peer_ms=8.0, bwd_speedup=4.0)
    slow = dict(base, case="b", block=128, fwd_ms=1.0, fwd_x_floor=1.43, fwd_peer="fa2_varlen", fwd_peer_ms=0.96,
                fwd_speedup=0.96, bwd_ms=2.0, bwd_x_floor=1.86, bwd_peer="fa2_varlen", bwd_peer_ms=3.4,
                bwd_speedup=1.7)
    missing = dict(base, case="c", block=16, ours=None, fwd_ms=None, fwd_x_floor=None, fwd_peer=None, fwd_peer_ms=None,
                   fwd_speedup=None, bwd_ms=None, bwd_x_floor=None, bwd_peer=None, bwd_peer_ms=None, bwd_speedup=None)
    return [fast, slow, missing]


def test_table_marks_slower_points():
    lines = grid.format_table(_points(), dict(device_name="NVIDIA H200", dtype="bfloat16")).splitlines()
    fast, slow = (next(l for l in lines if l.lstrip().startswith(b)) for b in ("64 ", "128 "))
    assert "0.96!" in slow and "1.70" in slow and "1.70!" not in slow
    assert "!" not in fast and "2.00" in fast and "4.00" in fast
    assert "slower than the best peer at 1" in lines[-1] and "<= 1.10x floor at 1" in lines[-1]


def test_points_pick_ours_and_the_best_checked_peer():
    summaries = {"p": dict(grid=dict(block=64, dim=64, heads="2x2", rotary="none", causal="no", lengths="prod"),
                           T=10, fwd_floor_ms=0.5, bwd_floor_ms=1.0, fwd_flop=1.1e12, bwd_flop=2.5e12)}
    rows = [dict(case="p", method="triton[simple]", kind="ours", status="ok", fwd_ms=0.1, bwd_ms=0.1),
            dict(case="p", method="triton", kind="ours", status="ok", fwd_ms=1.0, bwd_ms=2.0),
            dict(case="p", method="reference", kind="ours", status="ok", fwd_ms=9.0, bwd_ms=9.0),
            dict(case="p", method="wrong", kind="baseline", status="FAILED", fwd_ms=0.01, bwd_ms=0.01),
            dict(case="p", method="fa2_varlen", kind="baseline", status="ok", fwd_ms=0.8, bwd_ms=4.0),
            dict(case="p", method="fa4_varlen", kind="baseline", status="ok", fwd_ms=0.9, bwd_ms=3.0)]
    runner.finalize(rows, summaries)
    (p,) = grid.points(rows, summaries)
    assert p["ours"] == "triton" and p["fwd_x_floor"] == pytest.approx(2.0)
    assert p["fwd_peer"] == "fa2_varlen" and p["fwd_speedup"] == pytest.approx(0.8) and grid.slower(p, "fwd")
    assert p["bwd_peer"] == "fa4_varlen" and p["bwd_speedup"] == pytest.approx(1.5) and not grid.slower(p, "bwd")
    # ours' rate, and the rate at the target: 1.1 TFLOP in 1.10 x 0.5 ms; 2.5 TFLOP in 1.25 x 1.0 ms
    assert p["fwd_tflops"] == pytest.approx(1100.0) and p["bwd_tflops"] == pytest.approx(1250.0)
    assert p["fwd_target_tflops"] == pytest.approx(2000.0) and p["bwd_target_tflops"] == pytest.approx(2000.0)


def test_point_flop_counts_the_points_in_block_pairs():
    """``point_flop`` rebuilds a recorded point's case from its coordinates: the FLOP the bench's
    summary gives that case, causal halving the pairs; a record of other lengths gets none."""
    (case,) = grid.cases(dict(grid.DEFAULTS, block=(128,), dim=(96,), heads=((8, 2),), rotary=("none",),
                              causal=(True,)))
    s = runner.case_summary(case, torch.bfloat16, 4.27e12)
    row = dict(case=case.name, **dict(case.coords), T=str(case.total))
    assert grid.point_flop(row, "fwd") == pytest.approx(s["fwd_flop"])
    assert grid.point_flop(row, "bwd") == pytest.approx(s["bwd_flop"]) == pytest.approx(2.5 * s["fwd_flop"])
    full = grid.point_flop(dict(row, causal="no"), "fwd")
    assert 1.9 < full / s["fwd_flop"] < 2.0  # n^2 against n (n + 1) / 2 per block
    assert grid.point_flop(dict(row, T="100"), "fwd") is None
    assert grid.target_tflops(2.2e12, 2.0, "fwd") == pytest.approx(1000.0)
    assert grid.target_tflops(None, 2.0, "fwd") is None and grid.target_tflops(1.0, 2.0, "fwd+bwd") is None


def test_heatmap_from_results(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    annotations = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "text",
                        lambda self, x, y, s, *a, **k: annotations.append(s) or original(self, x, y, s, *a, **k))
    path = grid.heatmap(str(tmp_path), _points(), dict(device_name="NVIDIA H200", dtype="bfloat16"))
    assert path == str(tmp_path / "grid.png") and (tmp_path / "grid.png").stat().st_size > 1000
    # one facet (8x2, causal no) x 2 columns (fwd, bwd for rotary none), 3 blocks x 1 dim per panel
    assert sorted(annotations) == sorted(["1.05", "1.43!", "-", "1.20", "1.86", "-"])
    with pytest.raises(ValueError):
        grid.heatmap(str(tmp_path), [], {})


def test_precompile_chunks_cover_every_case_once():
    from blockattn_layers.bench.precompile import chunks

    for n, workers in [(1, 4), (7, 3), (480, 8), (5, 5)]:
        parts = chunks(n, workers)
        assert len(parts) == min(n, workers) and all(len(p) > 0 for p in parts)
        assert [i for p in parts for i in p] == list(range(n))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_precompile_runs_each_compiling_method_and_reports_failures(monkeypatch):
    from blockattn_layers.bench import precompile
    from blockattn_layers.bench.common import RunConfig

    cases = grid.cases(grid.parse_slice(["block=16", "dim=32", "heads=8x2", "rotary=none,split", "causal=no"]), 3, 40)
    cfg = RunConfig(device=torch.device("cpu"), dtype=torch.float32)
    methods = [m for m in cli.all_methods() if m.name in ("reference", "eager")]
    assert [m.name for m in methods if precompile.compiling(m)] == ["reference"]
    # In two spawned processes: every case runs without a failure.
    seconds, problems = precompile.precompile(cases, [], methods, cfg, workers=2)
    assert problems == [] and seconds > 0
    # In this process, with the reference's setup broken: each case's failure is reported.
    calls = []

    def broken(case, inp, cfg):
        calls.append(case.name)
        raise RuntimeError("planted")

    monkeypatch.setattr(cli, "all_methods", lambda: [dataclasses.replace(methods[0], setup=broken)])
    problems = precompile._warm(([(c, ["reference"]) for c in cases], cfg, 0))
    assert calls == [c.name for c in cases]
    assert problems == [f"{c.name} reference: RuntimeError: planted" for c in cases]


def test_gpu_grid_cases_cover_the_grid_axes():
    """The GPU tests' covering set of the shape grid (``tests.test_triton_gpu.GRID_CASES``): each
    block with every rotary form, both dtypes and both causal settings, each head dim with every
    head layout."""
    for block in gpu.GRID_BLOCKS:
        cases = [c for c in gpu.GRID_CASES if c["block_size"] == block]
        forms = {("partial" if "rotary_dim" in c else "interleaved" if c.get("rotary_interleaved") else "split")
                 if "rope_theta" in c else "none" for c in cases}
        assert forms == set(gpu.GRID_ROTARY) and {c["dtype"] for c in cases} == {"fp16", "bf16"}
        assert {c["causal"] for c in cases} == {False, True}
    for dim in gpu.GRID_DIMS:
        assert {(c["heads"], c["kv_heads"]) for c in gpu.GRID_CASES if c["dim"] == dim} == set(gpu.GRID_HEADS)
