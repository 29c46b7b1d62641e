"""Imports point down only: cli -> service -> workers -> parallelism -> spec (DESIGN.md).

`observability` (the Grafana dashboards, read by deploy/render.py) sits beside the layers: it imports
none of them, and none of them imports it. Every form of import is followed: `import x`, `from x import y`,
relative imports (`from . import x`, `from ..service import y`), and `importlib.import_module(...)` /
`__import__(...)` with a literal name (an f-string counts by its literal prefix). A call whose module
name the checker cannot read is an offence of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trainctl"
UNREADABLE = "<a module name the checker cannot read>"
IMPORT_CALLS = ("import_module", "__import__")

# For each layer, the modules it must never import (third-party or trainctl's own upper layers).
FORBIDDEN = {
    "spec": ("torch", "ray", "grpc", "trainctl.parallelism", "trainctl.workers", "trainctl.service", "trainctl.cli",
             "trainctl.observability"),
    "parallelism": ("ray", "grpc", "trainctl.workers", "trainctl.service", "trainctl.cli", "trainctl.v1",
                    "trainctl.observability"),
    "workers": ("grpc", "trainctl.service", "trainctl.cli", "trainctl.v1", "trainctl.observability"),
    "service": ("trainctl.cli", "trainctl.observability"),
    "observability": ("torch", "ray", "grpc", "trainctl.spec", "trainctl.parallelism", "trainctl.workers",
                      "trainctl.service", "trainctl.cli", "trainctl.v1"),
}


def _package_of(path: Path, root: Path) -> list[str]:
    """The dotted package a file belongs to (an `__init__.py` is its own package), as parts."""
    return list(path.relative_to(root).parts[:-1])


def _absolute(name: str, level: int, package: list[str]) -> str:
    """`name` imported with `level` leading dots from `package`, as an absolute module name."""
    if level == 0:
        return name
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _called_import(node: ast.Call) -> str | None:
    """The module an `importlib.import_module(...)` / `__import__(...)` call names (None: not such a call)."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in IMPORT_CALLS:
        return None
    if not node.args:
        return UNREADABLE
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        return prefix.rsplit(".", 1)[0] if "." in prefix else UNREADABLE
    return UNREADABLE


def imported_modules(path: Path, root: Path = PACKAGE.parent) -> list[tuple[int, str]]:
    """Every module a file imports, as an absolute name, with its line number."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package_of(path, root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node.module or "", node.level, package)
            if node.module is None:  # `from . import x`: x is a module of the package
                found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
            else:
                found.append((node.lineno, module))
        elif isinstance(node, ast.Call) and (name := _called_import(node)) is not None:
            found.append((node.lineno, _absolute(name.lstrip("."), len(name) - len(name.lstrip(".")), package)))
    return sorted(found, key=lambda item: item[0])


def _layer_files(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


def offences(layer: str, files: list[Path], root: Path = PACKAGE.parent) -> list[str]:
    """`file:line imports module` for every import in `files` that `layer` must not make."""
    found = []
    for path in files:
        for line, module in imported_modules(path, root):
            banned = [b for b in FORBIDDEN[layer] if module == b or module.startswith(b + ".")]
            if banned or module == UNREADABLE:
                found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_down(layer: str) -> None:
    files = _layer_files(layer)
    assert files, f"trainctl/{layer} has no Python files"
    found = offences(layer, files)
    assert not found, "imports that point up a layer:\n" + "\n".join(found)


def test_checker_reads_every_form_of_import(tmp_path: Path) -> None:
    layer = tmp_path / "trainctl" / "workers" / "sub"
    layer.mkdir(parents=True)
    bad = layer / "bad.py"
    bad.write_text(
        "import os\n"
        "from trainctl.service.store import JobStore\n"
        "import ray.util\n"
        "from . import sibling\n"
        "from ..placement import place\n"
        "from ... import cli\n"
        "import importlib\n"
        "importlib.import_module('trainctl.service.api')\n"
        "__import__('grpc')\n"
        "importlib.import_module(f'trainctl.v1.{name}')\n"
        "importlib.import_module(name)\n"
        "importlib.import_module('..runtime', package=__package__)\n"
    )
    assert [m for _, m in imported_modules(bad, tmp_path)] == [
        "os", "trainctl.service.store", "ray.util", "trainctl.workers.sub.sibling", "trainctl.workers.placement",
        "trainctl.cli", "importlib", "trainctl.service.api", "grpc", "trainctl.v1", UNREADABLE,
        "trainctl.workers.runtime",
    ]
    assert [o.split(" imports ")[1] for o in offences("workers", [bad], tmp_path)] == [
        "trainctl.service.store", "trainctl.cli", "trainctl.service.api", "grpc", "trainctl.v1", UNREADABLE,
    ]


DYNAMIC_IMPORTS = ("import_module", "__import__")
"""Calls that load a module by name, out of sight of the checker above (and of every other tool)."""


def dynamic_imports(path: Path) -> list[tuple[int, str]]:
    """Every call of importlib.import_module / __import__ in a file, with its line number."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in DYNAMIC_IMPORTS:
                found.append((node.lineno, name))
    return found


@pytest.mark.parametrize("layer", ["spec", "parallelism", "workers", "service"])
def test_layer_imports_are_static(layer: str) -> None:
    offences = [
        f"{path.relative_to(PACKAGE.parent)}:{line} calls {name}"
        for path in _layer_files(layer)
        for line, name in dynamic_imports(path)
    ]
    assert not offences, "modules loaded by name (import them statically):\n" + "\n".join(offences)


def test_checker_catches_a_dynamic_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import importlib\nmod = importlib.import_module('trainctl.parallelism.layouts.pipeline')\nx = __import__('os')\n")
    assert dynamic_imports(bad) == [(2, "import_module"), (3, "__import__")]
