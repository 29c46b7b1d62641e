"""Load a script of bench/ as a module, for the tests that run a bench at its smallest size so it cannot rot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(relative: str) -> ModuleType:
    """bench/<relative> (e.g. ``scale/fleet.py``) imported as a module named after it."""
    path = BENCH / relative
    name = "bench_" + relative.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up
    spec.loader.exec_module(module)
    return module
