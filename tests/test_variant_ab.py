"""``bench.variant_ab`` on the CPU: its points parse (and bad ones are refused by name), and a run of
two variants, each in its own processes, checks every point against the float64 reference and
prints one line per point (the CPU runs the reference backend; nothing is timed there)."""
import json

import pytest

from blockattn_layers.bench import variant_ab


def test_points_parse():
    p = variant_ab.Point.parse("bwd:128:96:8:2:64i:1")
    assert p == variant_ab.Point("bwd", 128, 96, 8, 2, 64, True, True)
    assert p.keywords() == dict(causal=True, rope_theta=1e4, rotary_dim=64, rotary_interleaved=True)
    assert variant_ab.Point.parse("fwd:64:128:2:2:0:0").keywords()["rope_theta"] is None
    for bad in ("fwd:64:128:2:2:0", "back:64:128:2:2:0:0", "fwd:64:128:2:2:0:2"):
        with pytest.raises(ValueError, match="kind:block:dim:heads:kv_heads:rotary_dim:causal"):
            variant_ab.Point.parse(bad)


def test_two_variants_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "ab.json"
    rc = variant_ab.main(["--device", "cpu", "--variants", "simple,packed", "--out", str(out),
                          "--cache-root", str(tmp_path), "fwd:64:32:2:1:16:1", "bwd:16:32:2:2:32i:0"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["point", "simple", "ms"]
    assert [line.split()[0] for line in lines[1:]] == ["fwd:64:32:2:1:16:1", "bwd:16:32:2:2:32i:0"]
    results = json.loads(out.read_text())
    assert list(results) == ["simple", "packed"]
    for rows in results.values():
        assert [r["ran"] for r in rows] == ["reference", "reference"]  # the CPU runs the reference backend
        assert set(rows[0]["errors"]) == {"o"} and set(rows[1]["errors"]) == {"dq", "dk", "dv"}
        assert all(0 <= e < 0.05 for r in rows for e in r["errors"].values())


def test_the_table_names_a_variant_that_ran_instead():
    rows = {"hopper": [dict(point="fwd:16:64:2:2:0:0", ran="hopper_packed", errors={"o": 0.01}, ms=0.5)],
            "simple": [dict(point="fwd:16:64:2:2:0:0", ran="simple", errors={"o": 0.2}, ms=1.0)]}
    line = variant_ab.table(rows, 0.05).splitlines()[1]
    assert "0.500 (hopper_packed)" in line and "0.2000!" in line and line.endswith("0.500")
