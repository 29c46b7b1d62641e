"""Bounded parsing of untrusted spec text (issue 20: no input may crash or stall the parser): a spec
file's text and the mapping its YAML holds, or a SpecError naming `<file>` or `<document>`."""

from __future__ import annotations

import os

import yaml

from trainctl.spec.strict_yaml import StrictLoader
from trainctl.spec.violations import FieldViolation, SpecError

MAX_SPEC_BYTES = 1 << 20
"""Largest spec file or text accepted (1 MiB; a real spec is a few KiB)."""
MAX_YAML_DEPTH = 32
"""Deepest nesting of YAML collections accepted (a spec is 4 levels deep)."""


class _SpecLoader(StrictLoader):
    """trainctl.spec.strict_yaml's loader (a key given twice is an error naming it and its lines), also
    refusing aliases (an alias bomb expands exponentially when validated), nesting deeper than
    MAX_YAML_DEPTH (which would exhaust the recursion limit) and mapping keys that are not text (`? `
    alone is a null key; a spec's keys are field names, labels and variables)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a job spec", mark)
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        mapping = super().construct_mapping(node, deep=deep)
        for key in mapping:
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(None, None, f"mapping keys must be text, got {key!r}", node.start_mark)
        return mapping


def bounded_yaml_document(text: str) -> dict:
    """The mapping a spec's YAML text holds, or SpecError('<document>') saying why there is none."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError([FieldViolation("<document>", f"{len(text)} characters; a spec may hold at most {MAX_SPEC_BYTES}")])
    try:
        document = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line, whatever the error's layout
        raise SpecError([FieldViolation("<document>", f"malformed YAML{where}: {problem}")]) from None
    except (ValueError, OverflowError) as exc:  # a scalar no Python value can hold: an impossible date, a 5000-digit int
        raise SpecError([FieldViolation("<document>", f"malformed YAML value: {str(exc)[:200]}")]) from None
    if not isinstance(document, dict):
        raise SpecError([FieldViolation("<document>", "expected a mapping with apiVersion, kind, metadata and spec")])
    return document


def bounded_spec_text(path: str | os.PathLike[str]) -> str:
    """A spec file's text: at most MAX_SPEC_BYTES of UTF-8, else SpecError('<file>')."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError([FieldViolation("<file>", f"cannot read {path}: {exc.strerror}")]) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError([FieldViolation("<file>", f"{path} is larger than {MAX_SPEC_BYTES} bytes; a job spec is a few KiB")])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError([FieldViolation("<file>", f"{path} is not UTF-8 text (byte {exc.start})")]) from None
