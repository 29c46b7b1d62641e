"""A job's resolved spec as MLflow parameters: dotted keys (`spec.training.lr`), values as text, within
MLflow's limits (a value of at most PARAM_VALUE_MAX characters, at most PARAMS_PER_BATCH per call)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

PARAM_VALUE_MAX = 6000
"""MLflow's longest parameter value; a longer one is cut and ends with TRUNCATED."""
PARAM_KEY_MAX = 250
"""MLflow's longest parameter key; a longer one is left out (no spec field path comes near it)."""
PARAMS_PER_BATCH = 100
"""MLflow's most parameters in one log_batch call."""
TRUNCATED = "...(truncated)"


def flatten(value: Any, prefix: str) -> dict[str, str]:
    """Every leaf of a JSON-like `value` under `prefix`, keys joined by dots; an empty mapping or list
    and None are left out, a list of scalars is one JSON value, a list of mappings is indexed."""
    out: dict[str, str] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}"))
    elif isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        for index, item in enumerate(value):
            out.update(flatten(item, f"{prefix}.{index}"))
    elif value is not None and value != []:
        text = value if isinstance(value, str) else json.dumps(value)
        if len(prefix) <= PARAM_KEY_MAX:
            out[prefix] = text if len(text) <= PARAM_VALUE_MAX else text[: PARAM_VALUE_MAX - len(TRUNCATED)] + TRUNCATED
    return out


def batches(params: dict[str, str]) -> Iterator[dict[str, str]]:
    """`params` in MLflow-sized calls, keys in sorted order."""
    keys = sorted(params)
    for start in range(0, len(keys), PARAMS_PER_BATCH):
        yield {key: params[key] for key in keys[start : start + PARAMS_PER_BATCH]}
