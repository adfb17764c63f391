"""``notebooks/quickstart.ipynb`` executes top to bottom (on CPU here) and is stored without outputs."""
from __future__ import annotations

import os

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
KERNEL = "blockattn-layers-test"


def _text_outputs(nb) -> str:
    return "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []) if o["output_type"] == "stream")


def test_notebook_is_saved_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


def test_notebook_runs(tmp_path, monkeypatch):
    pytest.importorskip("torchrec")
    from ipykernel.kernelspec import install
    from nbclient import NotebookClient

    # A kernelspec for this very interpreter, found first, whatever other "python3" kernels exist.
    install(kernel_name=KERNEL, prefix=str(tmp_path))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    # The notebook's ops are small: one thread is fastest on small, shared CPU machines (see conftest).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, kernel_name=KERNEL, timeout=600, resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
    )
    client.execute()

    text = _text_outputs(nb)
    assert "max |jagged - padded| on valid tokens" in text
    assert "held-out AUC" in text
    images = [o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    has_csv = os.path.isfile(os.path.join(ROOT, "BENCHMARKS.csv"))
    assert images if has_csv else "skipping the chart" in text
