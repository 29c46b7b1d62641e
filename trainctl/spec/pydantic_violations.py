"""`violations_from_pydantic`: pydantic's validation errors as FieldViolations, for every document
trainctl reads (job and sweep specs, topology maps and switch trees, access files)."""

from __future__ import annotations

from pydantic import ValidationError

from trainctl.spec.violations import FieldViolation

MAX_PATH_PART = 64
"""Characters of one key shown in a violation's field path (a hostile key can be megabytes long, or
hold control characters, which are escaped)."""


def violations_from_pydantic(exc: ValidationError, root: str = "<document>") -> list[FieldViolation]:
    """pydantic's errors as FieldViolations, the one formatting of them for every document trainctl
    reads (specs, topology maps, access files): the field's path (``spec.data.paths[0]``; ``root`` for
    the whole document), "unknown field" for a key the schema lacks, and a validator's message without
    pydantic's ``Value error, `` prefix."""
    out = []
    for error in exc.errors(include_input=False):
        path = ""
        for part in error["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{_path_part(part)}" if path else _path_part(part))
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
        out.append(FieldViolation(path or root, message))
    return out


def _path_part(part: object) -> str:
    """One key of a field path as printable text on one line, shortened to MAX_PATH_PART characters; a
    key that is empty, starts or ends with blanks or holds ": " is quoted, so it stays visible."""
    text = str(part)
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    if not text or text != text.strip() or ": " in text:
        text = repr(text)
    return text if len(text) <= MAX_PATH_PART else text[:MAX_PATH_PART] + "..."
