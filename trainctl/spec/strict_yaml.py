"""The YAML loading every document a user writes goes through (job and sweep specs, topology maps and
switch trees, the access file): PyYAML's safe loader, refusing a key given twice in one mapping and
reading `3e-4` as a number.

YAML requires a mapping's keys to be unique, but PyYAML keeps the last value silently: `metadata:`
written twice validated as the second one alone. kubectl refuses such a manifest; here the error names
the key and both lines. `<<` merge keys (`<<: *defaults`) are not duplicates: what a mapping says
itself overrides what it merges.

A number in exponent form without a dot (`lr: 3e-4`, `1e5`) is a float, as YAML 1.2 says: PyYAML follows
YAML 1.1, whose floats need a dot, and would read it as the string "3e-4", which the spec's types refuse
(they do not coerce text into numbers). `load` takes the C parser when PyYAML has it (`fast`: large
topology maps); the job spec's loader adds its own bounds on top (trainctl.spec.bounded_yaml).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_KEY_SHOWN = 64
"""Characters of a duplicate key quoted in its error."""
_MERGE_TAG = "tag:yaml.org,2002:merge"
_FLOAT_TAG = "tag:yaml.org,2002:float"
EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""YAML 1.2 floats that YAML 1.1 (PyYAML) reads as text: digits and an exponent, the dot optional."""


class UniqueKeys(yaml.constructor.SafeConstructor):
    """SafeConstructor refusing a mapping that names a key twice (`ConstructorError` at the second one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = key in first
                except TypeError:  # an unhashable key: SafeConstructor refuses it with its own error
                    continue
                if seen:
                    shown = repr(key) if len(repr(key)) <= MAX_KEY_SHOWN else repr(key)[:MAX_KEY_SHOWN] + "..."
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {shown} is given twice in one mapping (first at line {first[key]})",
                        key_node.start_mark,
                    )
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class StrictLoader(UniqueKeys, yaml.SafeLoader):
    """yaml.SafeLoader with unique keys and exponent floats (the pure-Python parser, which subclasses may
    extend)."""


class FastStrictLoader(UniqueKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """yaml.CSafeLoader (libyaml's parser, when PyYAML was built with it) with unique keys and exponent floats."""


for _loader in (StrictLoader, FastStrictLoader):
    _loader.add_implicit_resolver(_FLOAT_TAG, EXPONENT_FLOAT, list("-+0123456789"))


def load(text: str, *, fast: bool = False) -> Any:
    """The document `text` holds (yaml.YAMLError when it is not YAML or names a key twice)."""
    return yaml.load(text, Loader=FastStrictLoader if fast else StrictLoader)  # noqa: S506 - safe loaders
