"""Imports point down only: cli -> service -> workers -> parallelism -> spec (DESIGN.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trainctl"

# For each layer, the modules it must never import (third-party or trainctl's own upper layers).
FORBIDDEN = {
    "spec": ("torch", "ray", "grpc", "trainctl.parallelism", "trainctl.workers", "trainctl.service", "trainctl.cli"),
    "parallelism": ("ray", "grpc", "trainctl.workers", "trainctl.service", "trainctl.cli", "trainctl.v1"),
    "workers": ("grpc", "trainctl.service", "trainctl.cli", "trainctl.v1"),
    "service": ("trainctl.cli",),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute module name a file imports, with its line number."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _layer_files(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_down(layer: str) -> None:
    files = _layer_files(layer)
    assert files, f"trainctl/{layer} has no Python files"
    offences = []
    for path in files:
        for line, module in imported_modules(path):
            for banned in FORBIDDEN[layer]:
                if module == banned or module.startswith(banned + "."):
                    offences.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not offences, "imports that point up a layer:\n" + "\n".join(offences)


def test_checker_catches_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom trainctl.service.store import JobStore\nimport ray.util\n")
    assert [m for _, m in imported_modules(bad)] == ["os", "trainctl.service.store", "ray.util"]


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
    bad.write_text("import importlib\nmod = importlib.import_module('trainctl.parallelism.pipeline')\nx = __import__('os')\n")
    assert dynamic_imports(bad) == [(2, "import_module"), (3, "__import__")]
