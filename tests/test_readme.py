"""The README's Python examples run as written."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, single_thread):
    code = BLOCKS[index]
    if "torchrec" in code:
        pytest.importorskip("torchrec")
    exec(compile(code, f"README.md example {index}", "exec"), {})


def test_readme_has_examples():
    assert len(BLOCKS) >= 4
