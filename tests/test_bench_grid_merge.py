"""CPU tests of merging grid slices into the record (``bench.grid_merge``) and of the kernel
variant each grid point records (``bench.ours.block_kernels``)."""
from __future__ import annotations

import csv

import pytest
import torch

import blockattn_layers
from blockattn_layers.bench import grid, grid_merge, ours
from blockattn_layers.bench.common import RunConfig

COLUMNS = ["case", "block", "dim", "heads", "rotary", "causal", "lengths", "T", "slice", "fwd_variant",
           "fwd_floor_ms", "fwd_ms", "fwd_x_floor", "fwd_peer", "fwd_peer_ms", "fwd_speedup", "bwd_variant",
           "bwd_floor_ms", "bwd_ms", "bwd_x_floor", "bwd_peer", "bwd_peer_ms", "bwd_speedup", "ours", "date",
           "commit", "device_name", "torch", "triton", "dtype", "bandwidth_bytes_per_s"]


def _point(block: int, fwd_ms: float, bwd_ms: float, peer_ms: float = 4.0, variant: str = "hopper") -> dict:
    name = grid.point_name(block, 64, (8, 2), "none", False, "prod")
    p = dict(case=name, block=block, dim=64, heads="8x2", rotary="none", causal="no", lengths="prod", T=100,
             ours="triton")
    for mode, ms, floor in (("fwd", fwd_ms, 1.0), ("bwd", bwd_ms, 2.0)):
        p.update({f"{mode}_variant": variant, f"{mode}_floor_ms": floor, f"{mode}_ms": ms,
                  f"{mode}_x_floor": ms / floor, f"{mode}_peer": "fa2_varlen", f"{mode}_peer_ms": peer_ms,
                  f"{mode}_speedup": peer_ms / ms})
    return p


def _write(path, rows, columns):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def test_slices_replace_their_points_and_add_new_ones(tmp_path, capsys):
    """A slice's rows take the place of the record's rows of the same points (named after the
    slice), new points follow, the record keeps its columns; the summary counts the bounds."""
    stamp = dict(date="2026-12-01", commit="aaa", device_name="NVIDIA H200", torch="2.11", triton="3.6",
                 dtype="bfloat16", bandwidth_bytes_per_s=4.27e12)
    record = [dict(_point(16, 1.5, 3.0), slice="S20a", **stamp), dict(_point(32, 1.05, 2.4), slice="S20b", **stamp)]
    _write(tmp_path / "record.csv", record, COLUMNS)
    meta = dict(stamp, commit="bbb", date="2026-12-04")
    new = [_point(16, 1.02, 2.4, variant="hopper_packed"), _point(64, 2.0, 3.0, peer_ms=1.0)]
    slice_csv = grid.write_csv(str(tmp_path / "slice"), new, meta)
    assert grid_merge.main([f"S27={slice_csv}", "--csv", str(tmp_path / "record.csv"),
                            "--png", str(tmp_path / "grid.png"), "--label", "S20a..S27"]) == 0
    columns, rows = grid_merge.read_rows(str(tmp_path / "record.csv"))
    assert columns == COLUMNS
    assert [(r["block"], r["slice"], r["commit"], r["fwd_variant"]) for r in rows] == [
        ("16", "S27", "bbb", "hopper_packed"), ("32", "S20b", "aaa", "hopper"), ("64", "S27", "bbb", "hopper")]
    assert float(rows[0]["fwd_ms"]) == 1.02
    out = capsys.readouterr().out
    assert "3 points" in out
    assert "fwd: timed 3, <= 1.10x floor at 2, <= 1.5x at 2; a peer is faster at 1: grid/b64-d64-h8x2" in out
    assert "bwd: timed 3, <= 1.25x floor at 2, <= 1.5x at 3; a peer is faster at 1" in out
    assert (tmp_path / "grid.png").stat().st_size > 1000


def test_points_of_another_dtype_are_other_points(tmp_path, capsys):
    """An fp16 slice adds rows beside the bf16 rows of the same cases; the summary counts its dtype."""
    bf16 = dict(date="d", commit="a", device_name="H200", torch="2.11", triton="3.6", dtype="bfloat16",
                bandwidth_bytes_per_s=1.0)
    _write(tmp_path / "record.csv", [dict(_point(16, 1.5, 3.0), slice="S1", **bf16)], COLUMNS)
    slice_csv = grid.write_csv(str(tmp_path / "slice"), [_point(16, 1.0, 2.0)], dict(bf16, dtype="float16"))
    assert grid_merge.main([f"S2={slice_csv}", "--csv", str(tmp_path / "record.csv")]) == 0
    _, rows = grid_merge.read_rows(str(tmp_path / "record.csv"))
    assert [(r["dtype"], r["slice"]) for r in rows] == [("bfloat16", "S1"), ("float16", "S2")]
    assert capsys.readouterr().out.startswith("1 points")


def test_a_new_record_takes_the_slices_columns(tmp_path):
    slice_csv = grid.write_csv(str(tmp_path / "slice"), [_point(16, 1.0, 2.0)], dict(commit="ccc"))
    assert grid_merge.main([f"S1={slice_csv}", "--csv", str(tmp_path / "new.csv")]) == 0
    columns, rows = grid_merge.read_rows(str(tmp_path / "new.csv"))
    assert columns[0] == "slice" and "case" in columns and rows[0]["slice"] == "S1"


def test_summary_counts_targets_beyond_the_fastest_attention_rate(tmp_path, capsys):
    """The record's rows (no rate columns) get their target rates from their coordinates; a slice's
    new rate columns join the record. The b128 D128 8x2 backward needs 2.5 x 4 x pairs x 8 x 128
    FLOP: over a 1 ms floor at 1.25x that is beyond 521 TFLOP/s, over a 10 ms floor it is not."""
    stamp = dict(date="d", commit="a", device_name="H200", torch="2.11", triton="3.6", dtype="bfloat16",
                 bandwidth_bytes_per_s=1.0)
    (case,) = grid.cases(dict(grid.DEFAULTS, block=(128,), dim=(128,), heads=((8, 2),), rotary=("none",),
                              causal=(False,)))
    fast = dict(_point(128, 2.0, 3.0), dim=128, case=case.name, T=case.total, bwd_floor_ms=1.0)
    slow = dict(fast, case=grid.point_name(128, 128, (8, 2), "none", True, "prod"), causal="yes", bwd_floor_ms=10.0)
    _write(tmp_path / "record.csv", [dict(fast, slice="S1", **stamp), dict(slow, slice="S1", **stamp)], COLUMNS)
    new = dict(_point(16, 1.0, 2.0), fwd_tflops=50.0, fwd_target_tflops=600.0, bwd_tflops=40.0,
               bwd_target_tflops=100.0)
    slice_csv = grid.write_csv(str(tmp_path / "slice"), [new], stamp)
    assert grid_merge.main([f"S2={slice_csv}", "--csv", str(tmp_path / "record.csv")]) == 0
    columns, rows = grid_merge.read_rows(str(tmp_path / "record.csv"))
    assert columns[:len(COLUMNS)] == COLUMNS and columns[len(COLUMNS):] == [
        "fwd_tflops", "fwd_target_tflops", "bwd_tflops", "bwd_target_tflops"]
    assert rows[0]["bwd_target_tflops"] == "" and rows[2]["bwd_target_tflops"] == "100.0"
    out = capsys.readouterr().out
    assert "fwd: timed 3" in out and "more than 549 TFLOP/s (the fastest attention measured on the H200) at 1 of 3" in out
    assert "more than 521 TFLOP/s (the fastest attention measured on the H200) at 1 of 3" in out


def test_bad_slice_arguments(tmp_path):
    with pytest.raises(SystemExit):
        grid_merge.main(["no-equals-sign", "--csv", str(tmp_path / "x.csv")])


class _Spec:
    name = "triton"

    def __init__(self, reasons):
        self._reasons = reasons

    def variant_reasons(self, req):
        return self._reasons


@pytest.mark.parametrize("reasons,want", [
    ({"hopper": ["block_size 16 < 33"], "hopper_packed": [], "simple": []}, ("hopper_packed", "hopper_packed")),
    ({"hopper": [], "simple": [], "backward: flash": []}, ("hopper", "flash")),
    ({"hopper": [], "simple": [], "backward: hopper": ["slower"], "backward: simple": []}, ("hopper", "simple")),
])
def test_points_record_the_variant_auto_runs(monkeypatch, reasons, want):
    """The variant of each mode: the first without reasons; the backward's own where it chooses apart."""
    monkeypatch.setattr(blockattn_layers.dispatch, "select_backend", lambda backend, req: _Spec(reasons))
    case = grid.cases(grid.parse_slice(["block=16", "dim=64", "heads=8x2", "rotary=none", "causal=no"]), batch=2,
                      max_len=20)[0]
    got = ours.block_kernels(case, RunConfig(device=torch.device("cpu"), dtype=torch.float32))
    assert (got["fwd"], got["bwd"]) == want
    summaries = {case.name: dict(grid=dict(case.coords), T=case.total, fwd_floor_ms=1.0, bwd_floor_ms=1.0,
                                 kernels=got)}
    rows = [dict(case=case.name, method="triton", kind="ours", status="ok", fwd_ms=1.0, bwd_ms=1.0)]
    (p,) = grid.points(rows, summaries)
    assert (p["fwd_variant"], p["bwd_variant"]) == want


def test_no_variant_where_the_backend_has_none():
    case = grid.cases(grid.parse_slice(["block=16", "dim=64", "heads=8x2", "rotary=none", "causal=no"]), batch=2,
                      max_len=20)[0]
    assert ours.block_kernels(case, RunConfig(device=torch.device("cpu"), dtype=torch.float32)) == {
        "fwd": None, "bwd": None}
