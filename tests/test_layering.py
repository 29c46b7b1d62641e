"""Imports point down only: cli -> service -> planning -> workers -> parallelism -> spec (DESIGN.md; the planning
layer, trainctl.planning, is the planner the service and the offline `trainctl plan` share), with the wire (proto
conversions, error details, credentials: trainctl.wire) below cli and service and above spec; and no module imports
itself round a circle (function-level imports included, `if TYPE_CHECKING:` ones not). The planning layer loads
neither torch, Ray, gRPC nor protobuf (checked in a fresh interpreter).

`observability` (the Grafana dashboards, read by deploy/render.py, and the run report, drawn by the CLI
and the service) sits below cli and service: it imports none of the layers, only the generated code
(trainctl.v1, the Job message the report draws), and no layer below the service imports it. Every form
of import is followed: `import x`, `from x import y`, relative imports (`from . import x`,
`from ..service import y`), and `importlib.import_module(...)` / `__import__(...)` with a literal name
(an f-string counts by its literal prefix). A call whose module name the checker cannot read is an
offence of its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trainctl"
UNREADABLE = "<a module name the checker cannot read>"
IMPORT_CALLS = ("import_module", "__import__")

# For each layer, the modules it must never import (third-party or trainctl's own upper layers).
FORBIDDEN = {
    "spec": ("torch", "ray", "grpc", "trainctl.parallelism", "trainctl.workers", "trainctl.planning", "trainctl.service",
             "trainctl.cli", "trainctl.wire", "trainctl.observability"),
    "parallelism": ("ray", "grpc", "trainctl.workers", "trainctl.planning", "trainctl.service", "trainctl.cli",
                    "trainctl.v1", "trainctl.wire", "trainctl.observability"),
    "workers": ("grpc", "trainctl.planning", "trainctl.service", "trainctl.cli", "trainctl.v1", "trainctl.wire",
                "trainctl.observability"),
    "planning": ("torch", "ray", "grpc", "google.protobuf", "trainctl.v1", "trainctl.wire", "trainctl.service",
                 "trainctl.cli", "trainctl.observability"),
    "wire": ("torch", "ray", "trainctl.parallelism", "trainctl.workers", "trainctl.service", "trainctl.cli",
             "trainctl.observability"),
    "service": ("trainctl.cli",),
    "observability": ("torch", "ray", "grpc", "trainctl.spec", "trainctl.parallelism", "trainctl.workers",
                      "trainctl.planning", "trainctl.service", "trainctl.cli", "trainctl.wire"),
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
        "importlib.import_module('trainctl.service.api.servicer')\n"
        "__import__('grpc')\n"
        "importlib.import_module(f'trainctl.v1.{name}')\n"
        "importlib.import_module(name)\n"
        "importlib.import_module('..runtime', package=__package__)\n"
    )
    assert [m for _, m in imported_modules(bad, tmp_path)] == [
        "os", "trainctl.service.store", "ray.util", "trainctl.workers.sub.sibling", "trainctl.workers.placement",
        "trainctl.cli", "importlib", "trainctl.service.api.servicer", "grpc", "trainctl.v1", UNREADABLE,
        "trainctl.workers.runtime",
    ]
    assert [o.split(" imports ")[1] for o in offences("workers", [bad], tmp_path)] == [
        "trainctl.service.store", "trainctl.cli", "trainctl.service.api.servicer", "grpc", "trainctl.v1", UNREADABLE,
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


@pytest.mark.parametrize("layer", ["spec", "parallelism", "workers", "planning", "wire", "service"])
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


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Lines inside `if TYPE_CHECKING:` blocks: imports for annotations only, never executed."""
    return {
        inner.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
        if hasattr(inner, "lineno")
    }


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at run time (anywhere in the file: a function-level
    import closes a circle as surely as a top-level one). `from a import b` counts as a.b when that is a
    module, else as a."""
    root = package.parent
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_lines(tree)
        named = [  # `from a import b, c`: a.b and a.c, which known() takes back to a where they are not modules
            (node.lineno, f"{_absolute(node.module, node.level, _package_of(path, root))}.{alias.name}")
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        ]
        graph[name] = {
            target for line, module in [*imported_modules(path, root), *named]
            if line not in skipped and (target := known(module)) is not None and target != name
        }
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle() -> None:
    circles = import_circles(import_graph(PACKAGE))
    assert not circles, "modules that import each other (directly or round a circle):\n" + "\n".join(map(str, circles))


def test_checker_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "trainctl"
    (package / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model" / "__init__.py").write_text("")
    (package / "model" / "a.py").write_text("from trainctl.model.b import thing\n")
    (package / "model" / "b.py").write_text("def thing():\n    from trainctl.model import c\n")
    (package / "model" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainctl.model import b\n"
                                            "from . import a\n")
    (package / "model" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainctl.model import a\n")
    (package / "model" / "e.py").write_text("from trainctl.model import d\n")
    assert import_circles(import_graph(package)) == [["trainctl.model.a", "trainctl.model.b", "trainctl.model.c"]]


SERVER_COMMANDS = ("serve_cmd.py", "demo.py")
"""CLI modules that run a service in their process, and so may import it."""


def test_client_commands_import_nothing_of_the_service() -> None:
    """Offline planning (`plan --cluster`, `--suggest`) included: it imports the planning layer, not the service."""
    files = [p for p in _layer_files("cli") if p.name not in SERVER_COMMANDS]
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in files
        for line, module in imported_modules(path)
        if module == "trainctl.service" or module.startswith("trainctl.service.")
    ]
    assert not found, "client commands importing the server (the wire, trainctl.wire, is what they share):\n" + "\n".join(found)


PLANNING_IMPORTS = """
import sys
import trainctl.planning.layout_search, trainctl.planning.plan
heavy = ("torch", "ray", "grpc", "google.protobuf", "trainctl.v1", "trainctl.wire", "trainctl.service", "trainctl.cli")
print(sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + "." for h in heavy))))
"""


def test_the_planning_layer_loads_no_engine_runtime_or_rpc_stack() -> None:
    """What the import check above cannot see: nothing the planning layer imports, at any depth, loads torch,
    Ray, gRPC or protobuf (the offline plan and the service's admission both start without them)."""
    done = subprocess.run([sys.executable, "-c", PLANNING_IMPORTS], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout[-2000:]
