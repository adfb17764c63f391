"""Execute ``quickstart.ipynb`` and store it with its outputs: ``.venv/bin/python notebooks/execute.py``.

The notebook runs top to bottom in a Jupyter kernel of this very interpreter (a kernelspec
installed into a temporary directory, found before any other ``python3`` kernel), with one
intra-op thread (its ops are small: one thread is fastest on small, shared CPU machines) and
without ``TRITON_INTERPRET`` (which the test suite sets for itself), as a user runs it.
The stored notebook keeps outputs and execution counts but no execution timings, has each cell's
consecutive prints to one stream joined into one output (how a loop's prints split into outputs
depends on when the kernel flushed them), and keeps its own kernelspec and language metadata.
``tests/test_notebook.py`` executes it with :func:`execute` and checks that the stored outputs
are those of the current code: re-run this script after changing the notebook or what it prints.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import tempfile
from typing import Dict, Iterator, List, Optional

import nbformat
from ipykernel.kernelspec import install
from nbclient import NotebookClient

KERNEL = "blockattn-layers-notebook"
QUICKSTART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quickstart.ipynb")


def _set_environ(values: Dict[str, Optional[str]]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def _environ(values: Dict[str, Optional[str]]) -> Iterator[None]:
    """Set (a string) or unset (None) environment variables for the block, then restore them."""
    before = {name: os.environ.get(name) for name in values}
    _set_environ(values)
    try:
        yield
    finally:
        _set_environ(before)


def _join_streams(nb) -> None:
    """Join each code cell's consecutive outputs to the same stream (stdout, stderr) into one."""
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        joined = []
        for out in cell.outputs:
            prev = joined[-1] if joined else None
            if prev is not None and out.output_type == prev.output_type == "stream" and out.name == prev.name:
                prev.text += out.text
            else:
                joined.append(out)
        cell.outputs = joined


def execute(path: str = QUICKSTART, timeout: int = 600):
    """The notebook at ``path`` executed in its own directory (an ``nbformat`` node; not written)."""
    nb = nbformat.read(path, as_version=4)
    metadata = copy.deepcopy(nb.metadata)
    with tempfile.TemporaryDirectory() as prefix:
        install(kernel_name=KERNEL, prefix=prefix)
        jupyter_path = os.path.join(prefix, "share", "jupyter")
        with _environ({"JUPYTER_PATH": jupyter_path, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": None}):
            client = NotebookClient(
                nb, kernel_name=KERNEL, timeout=timeout, record_timing=False,
                resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
            )
            client.execute()
    nb.metadata = metadata
    _join_streams(nb)
    return nb


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Execute a notebook and store it with its outputs.")
    parser.add_argument("path", nargs="?", default=QUICKSTART, help="notebook (default: quickstart.ipynb)")
    args = parser.parse_args(argv)
    nbformat.write(execute(args.path), args.path)
    print(f"executed and wrote {args.path}")


if __name__ == "__main__":
    main()
