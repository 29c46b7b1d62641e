"""The runtime requirements hold every third-party module trainctl imports, and the image installs them.

Every `import` / `from ... import` in trainctl/ (module level or inside a function: the lazily loaded
engine, tokenizers and data formats count) that is neither the standard library nor trainctl is mapped
to the installed distribution that provides it, which must be named in requirements.txt and in
pyproject's dependencies (the same distributions: exact pins for `make` and the image, ranges for pip);
test-only packages stay in requirements-dev.txt, and the Dockerfile installs requirements.txt alone. An
optional feature's packages (pyproject's extras other than `dev`: experiment tracking's MLflow and TensorBoard)
are imported only by that feature, lazily, and named in its extra and in requirements-dev.txt (so the tests
run the feature), never in requirements.txt.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib import metadata

from deploy_support import REPO
from test_dockerfile import instructions, pip_installs

PACKAGE = REPO / "trainctl"
LAZY = {"transformers", "tokenizers", "pyarrow", "optuna", "torch", "ray", "matplotlib"}
"""Modules trainctl imports only inside functions or modules the CLI loads late: the walk must see them."""


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(lines: list[str]) -> set[str]:
    """The distributions named by requirement lines (comments, blanks and pip options skipped)."""
    names = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(normalized(re.match(r"[A-Za-z0-9._-]+", line).group(0)))
    return names


def requirements_file(name: str) -> set[str]:
    return requirement_names((REPO / name).read_text().splitlines())


def pyproject_dependencies() -> set[str]:
    return requirement_names(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


def optional_dependencies() -> set[str]:
    """The distributions of pyproject's feature extras (every extra but `dev`)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return set().union(*(requirement_names(names) for extra, names in extras.items() if extra != "dev"))


@cache
def third_party_imports() -> dict[str, list[str]]:
    """Every module trainctl imports that is not the standard library or trainctl: name -> `file:line`s
    (walked once for the module's tests, which only read it)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "trainctl":
                    found.setdefault(name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


@cache
def _files(distribution: str) -> tuple[str, ...]:
    return tuple(str(f) for f in metadata.distribution(distribution).files or ())


@cache
def _providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distribution_of(module: str) -> str | None:
    """The installed distribution providing `module` (normalized), None when none is installed. A
    top-level name several distributions share (the `google` namespace) goes by the module's own files."""
    candidates = _providers().get(module.split(".")[0], [])
    if len(set(candidates)) > 1:
        path = module.replace(".", "/")
        candidates = [d for d in candidates if any(f.startswith((f"{path}/", f"{path}.")) for f in _files(d))]
    return normalized(candidates[0]) if candidates else None


def test_the_walk_sees_lazy_imports() -> None:
    tops = {name.split(".")[0] for name in third_party_imports()}
    assert tops >= LAZY, f"imports not found by the walk: {sorted(LAZY - tops)}"
    assert distribution_of("google.rpc.status_pb2") == "googleapis-common-protos"
    assert distribution_of("google.protobuf.timestamp_pb2") == "protobuf"


def test_every_imported_module_comes_from_a_runtime_requirement() -> None:
    runtime = requirements_file("requirements.txt") | optional_dependencies()
    missing = []
    for module, where in sorted(third_party_imports().items()):
        distribution = distribution_of(module)
        if distribution is None:
            missing.append(f"{module} (imported at {where[0]}): no installed distribution provides it")
        elif distribution not in runtime:
            missing.append(f"{module} (imported at {where[0]}): {distribution} is not in requirements.txt or an extra")
    assert not missing, "\n".join(missing)


def test_pyproject_depends_on_the_runtime_requirements() -> None:
    runtime, declared = requirements_file("requirements.txt"), pyproject_dependencies()
    assert declared == runtime, f"only in requirements.txt: {sorted(runtime - declared)}; only in pyproject: {sorted(declared - runtime)}"


def test_development_requirements_are_only_for_development() -> None:
    development = requirements_file("requirements-dev.txt")
    assert not development & requirements_file("requirements.txt"), "a runtime requirement listed again for development"
    imported = {distribution_of(module) for module in third_party_imports()}
    development_only = development - optional_dependencies()
    assert not development_only & imported, f"trainctl imports development-only packages: {sorted(development_only & imported)}"


def test_optional_features_are_installed_for_the_tests_and_not_at_runtime() -> None:
    optional = optional_dependencies()
    assert optional, "pyproject declares the tracking extra"
    assert optional <= requirements_file("requirements-dev.txt"), f"extras the tests do not install: {sorted(optional - requirements_file('requirements-dev.txt'))}"
    assert not optional & requirements_file("requirements.txt"), "an optional package is a runtime requirement"


def test_the_image_installs_exactly_the_runtime_requirements() -> None:
    installs = pip_installs([args for op, args in instructions() if op == "RUN"])
    files = [a for args in installs for a in args if a.endswith(".txt")]
    assert files == ["requirements.txt"], f"the image installs {files}"
    named = {a for args in installs for a in args if not a.startswith("-") and not a.endswith(".txt") and a != "."}
    assert not named, f"the image installs packages outside requirements.txt: {sorted(named)}"
    package = next(args for args in installs if "." in args)
    assert "--no-deps" in package, "the package itself goes in without resolving pyproject's ranges again"
    copied = [args.split() for op, args in instructions() if op == "COPY"]
    assert any("requirements.txt" in words for words in copied), "requirements.txt is copied into the image"
