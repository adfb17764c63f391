"""``python -m blockattn_layers verify-arch``: on the CPU (interpreter) it checks the Triton variant
against the float64 reference and writes its report; a deliberately wrong variant fails it even
though the self-check at first use would have hidden the error (the tool suspends it)."""
import os

import pytest

from blockattn_layers.cli import verify_arch
from blockattn_layers.kernels.block import variants
from tests.test_self_check import _stand_in

pytestmark = pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="needs TRITON_INTERPRET=1 on CPU")


@pytest.fixture
def short(monkeypatch):
    monkeypatch.setattr(verify_arch, "EDGE_LENGTHS", [0, 1, 63, 64, 65, 7])


_ALL_CASES = verify_arch._cases


def _quick_cases(device, quick):
    return _ALL_CASES(device, quick)[:3]


def test_the_triton_variant_passes_and_the_report_is_written(tmp_path, short, monkeypatch, capsys):
    monkeypatch.setattr(verify_arch, "_cases", _quick_cases)
    out = tmp_path / "report.md"
    assert verify_arch.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert "### simple: 3 of 3 cases pass" in text and "| float16, D64, H2/2, block 64 | simple |" in text
    assert "report written to" in capsys.readouterr().out


def test_a_wrong_variant_fails(tmp_path, short, monkeypatch):
    variant, _ = _stand_in("wrong_for_verify", fwd_factor=1.5)
    monkeypatch.setitem(variants.VARIANTS, variant.name, variant)
    monkeypatch.setattr(verify_arch, "_cases", _quick_cases)
    out = tmp_path / "report.md"
    assert verify_arch.main(["--device", "cpu", "--variants", "wrong_for_verify", "--out", str(out)]) == 1
    assert "### wrong_for_verify: 0 of 3 cases pass" in out.read_text()


def test_unknown_variant_names_are_refused(tmp_path, capsys):
    assert verify_arch.main(["--device", "cpu", "--variants", "nope", "--out", str(tmp_path / "r.md")]) == 2
    assert "unknown variants ['nope']" in capsys.readouterr().err
