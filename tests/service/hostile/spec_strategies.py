"""Hypothesis strategies for job-spec documents: a valid base spec, arbitrary YAML values, and the base
with a few fields replaced, deleted or added (near-valid, so deep rules are reached). Shared by the
hostile-spec tests."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

BASE: dict[str, Any] = {
    "apiVersion": "trainctl/v1",
    "kind": "TrainingJob",
    "metadata": {"name": "hostile", "labels": {"team": "red"}},
    "spec": {
        "model": {"preset": "debug", "n_heads": 4, "n_kv_heads": 2},
        "data": {"paths": ["@stdlib"], "seq_len": 64, "seed": 1, "max_files": 5},
        "parallelism": {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero_stage": 3},
        "training": {"steps": 3, "global_batch_size": 4, "micro_batch_size": 1, "lr": 0.001, "dtype": "float32"},
        "checkpoint": {"interval_steps": 0, "keep_last": 1},
        "resources": {"gpus": 2, "device": "cpu"},
        "scheduling": {"priority": 0, "max_restarts": 1},
    },
}
ROOTS = ("<document>", "apiVersion", "kind", "metadata", "spec")


def _leaf_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        out = [prefix] if prefix else []
        for key, value in node.items():
            out.extend(_leaf_paths(value, (*prefix, key)))
        return out
    return [prefix]


PATHS = _leaf_paths(BASE)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "..", "../../etc/passwd", "\x00", "debug", "1f1b", "bfloat16", "auto", "@stdlib"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=6)


@st.composite
def mutated_documents(draw: st.DrawFn) -> Any:
    """The base spec with a few fields replaced, deleted or added: near-valid, so deep rules are reached."""
    document = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        path = draw(st.sampled_from(PATHS))
        parent = document
        for key in path[:-1]:
            if not isinstance(parent, dict) or not isinstance(parent.get(key), dict):
                parent = None
                break
            parent = parent[key]
        if parent is None:
            continue
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(values)
        elif action == "delete":
            parent.pop(path[-1], None)
        else:
            parent[draw(st.text(min_size=1, max_size=10))] = draw(values)
    return document
