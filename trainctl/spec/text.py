"""Text every store can hold: the characters a record cannot keep, how one is shown, and how text the
service records is made storable.

PostgreSQL's text refuses NUL (U+0000), which SQLite would keep; a lone surrogate (U+D800 to U+DFFF, what
Python's ``surrogateescape`` makes of bytes that are not UTF-8) is no UTF-8 at all, so neither
PostgreSQL nor SQLite (Python's sqlite3 encodes strictly) can take one. Hence two rules, the same on
either store:

- what a user gives (every string of a job or sweep spec) holding one is refused at submit, naming the
  field and showing the character escaped (`unstorable_problem`; trainctl.spec.strict_input);
- what the service records on its own (state reasons, log lines, stderr tails, error echoes) is made
  storable (`storable`): NUL becomes the four characters ``\\x00``, so a reader still sees where it was,
  and a lone surrogate becomes U+FFFD, the replacement character a decoder puts for bytes it cannot
  decode. trainctl.service.store.db applies it to every string bound to a statement and in a JSON column.

Pure standard library, the lowest layer: the spec, the workers and the service share it.
"""

from __future__ import annotations

import re
from typing import Any

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
NUL_SHOWN = "\\x00"
"""What a NUL character becomes in recorded text."""
REPLACEMENT = "\ufffd"
"""What a lone surrogate becomes in recorded text."""


def escaped(char: str) -> str:
    """How an unstorable character is shown in a message: ``\\x00``, ``\\udc80``."""
    return char.encode("unicode_escape").decode("ascii")


def printable(text: str) -> str:
    """`text` as it may be echoed in a message: each character that is not printable (NUL, a newline, a
    lone surrogate) `escaped` (``a\\x00b``), the others as they are."""
    return text if text.isprintable() else "".join(c if c.isprintable() else escaped(c) for c in text)


def unstorable_problem(text: str) -> str | None:
    """Why `text` cannot be stored as it is (its first NUL or lone surrogate, escaped, and where), or None."""
    match = _UNSTORABLE.search(text)
    if match is None:
        return None
    char = match.group()
    what = f"a NUL character ({escaped(char)})" if char == "\x00" else f"a lone surrogate ({escaped(char)}, not UTF-8)"
    return f"contains {what} at character {match.start() + 1}; trainctl cannot store one"


def storable(text: str) -> str:
    """`text` with each NUL replaced by ``\\x00`` and each lone surrogate by U+FFFD (`text` itself when it
    holds neither)."""
    if _UNSTORABLE.search(text) is None:
        return text
    return _UNSTORABLE.sub(lambda match: NUL_SHOWN if match.group() == "\x00" else REPLACEMENT, text)


def storable_tree(value: Any) -> Any:
    """`value` (what JSON holds: dicts, lists, strings, numbers) with every string in it, keys too, `storable`."""
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, dict):
        return {storable(k) if isinstance(k, str) else k: storable_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_tree(item) for item in value]
    return value
