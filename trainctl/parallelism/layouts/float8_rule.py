"""Which linear layers train in float8 under `training.fp8`: pure arithmetic on names and shapes (no
torch), shared by the float8 layout (layouts/float8.py, whose docstring gives the reasons) and the
memory and step-time models (sizing/)."""

from __future__ import annotations

from typing import Literal

Float8Recipe = Literal["tensorwise", "rowwise"]
KEPT_IN_HIGH_PRECISION = ("output", "router")
"""Linears never converted, by module name: the output head and MoE routers."""


def converts_shape(name: str, in_features: int, out_features: int, recipe: Float8Recipe) -> bool:
    """Whether a plain linear of this name and shape trains in float8: not kept in high precision, both
    dimensions multiples of 16, and large enough to gain (torchao's per-recipe thresholds)."""
    if name.rsplit(".", 1)[-1] in KEPT_IN_HIGH_PRECISION:
        return False
    if in_features % 16 or out_features % 16:
        return False
    if recipe == "tensorwise":
        return not (in_features <= 4096 and out_features <= 1024)
    small = out_features <= 2048 or in_features <= 1024 or (out_features <= 4096 and in_features <= 2048)
    return not small
