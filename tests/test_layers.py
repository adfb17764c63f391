"""The import graph follows the layers of DESIGN.md: data flows down, nothing imports up.

Read from the source with ``ast`` (imports inside functions count too), so a lazy import
cannot hide an upward dependency.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "blockattn_layers"

# Lowest first. A module may import its own layer and those below it.
LAYERS = [
    ("kernels", "reference", "_params", "runtime", "determinism"),
    ("dispatch",),
    ("ops", "_validation", "fp8"),
    ("_checked_calls",),
    ("functional", "jagged"),
    ("modules",),
    ("config",),
    ("cli", "bench", "distributed_check", "__init__", "__main__", "presets"),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _source_files():
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        yield f"{PACKAGE}." + ".".join(path.relative_to(ROOT / PACKAGE).with_suffix("").parts), path
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        yield f"{PACKAGE}.kernels." + ".".join(path.relative_to(ROOT / "kernels").with_suffix("").parts), path


def _imports(module: str, path: pathlib.Path):
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                yield target
            else:  # ``from .. import name``: the submodules named
                yield from (f"{target}.{alias.name}" for alias in node.names)


def _layer(module: str):
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    top = parts[1] if len(parts) > 1 else "__init__"
    # ``from blockattn_layers import name`` of a name that is no module: the package's __init__
    return RANK.get(top, RANK["__init__"])


def test_every_top_level_module_has_a_layer():
    tops = {module.split(".")[1] for module, _ in _source_files()}
    assert tops <= set(RANK), sorted(tops - set(RANK))


@pytest.mark.parametrize("module,path", list(_source_files()), ids=lambda x: x if isinstance(x, str) else "")
def test_no_module_imports_a_higher_layer(module, path):
    own = _layer(module)
    upward = sorted({target for target in _imports(module, path)
                     if _layer(target) is not None and _layer(target) > own})
    assert not upward, f"{module} (layer {own}) imports {upward}"


def test_every_package_is_listed_for_installation():
    """setup.cfg names every package folder (an editable install would hide a missing one)."""
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    folders = set()
    for root, prefix in ((ROOT / PACKAGE, PACKAGE), (ROOT / "kernels", f"{PACKAGE}.kernels")):
        for init in root.rglob("__init__.py"):
            folders.add(".".join([prefix, *init.parent.relative_to(root).parts]))
    assert folders <= listed, sorted(folders - listed)
