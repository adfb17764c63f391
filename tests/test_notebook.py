"""``notebooks/quickstart.ipynb`` is stored executed (outputs and chart, no execution timings), and
executing it again (on CPU here) gives the stored outputs, numbers aside.

After changing the notebook or what it prints: ``.venv/bin/python notebooks/execute.py``.
"""
from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
_NUMBER = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?")


def _executor():
    spec = importlib.util.spec_from_file_location("notebook_execute", os.path.join(ROOT, "notebooks", "execute.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def _text(nb) -> str:
    return "".join(o.text for cell in _code_cells(nb) for o in cell.outputs if o.output_type == "stream")


def _outline(nb):
    """Per code cell, each output as (kind, text with every number replaced by '#')."""
    cells = []
    for cell in _code_cells(nb):
        outs = []
        for o in cell.outputs:
            if o.output_type == "stream":
                outs.append((o.name, _NUMBER.sub("#", o.text)))
            else:
                outs.append((o.output_type, " ".join(sorted(o.get("data", {})))))
        cells.append(outs)
    return cells


def test_notebook_is_stored_executed():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = _code_cells(nb)
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert all(cell.outputs for cell in code)
    outputs = [o for cell in code for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error" or o.get("name") == "stderr"]
    assert not [cell for cell in code if "execution" in cell.metadata]
    assert nb.metadata.kernelspec.name == "python3"
    text = _text(nb)
    assert "max |jagged - padded| on valid tokens" in text and "held-out AUC" in text
    assert "CUDA: False" in text  # the stored run is the CPU one (the chart of the committed results)
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1
    assert os.path.getsize(NOTEBOOK) < 200_000


def test_notebook_runs_and_matches_its_stored_outputs():
    pytest.importorskip("torchrec")
    fresh = _executor().execute(NOTEBOOK)
    text = _text(fresh)
    assert "max |jagged - padded| on valid tokens" in text and "held-out AUC" in text
    if torch.cuda.is_available():
        return  # with a GPU the notebook runs a live benchmark; the stored outputs are of a CPU run
    stored = nbformat.read(NOTEBOOK, as_version=4)
    assert _outline(fresh) == _outline(stored), (
        "the stored outputs of notebooks/quickstart.ipynb are not those of its code: "
        "re-run .venv/bin/python notebooks/execute.py"
    )
