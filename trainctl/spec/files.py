"""The one rule for every file opened on a job's behalf: where it may lie, and how much of it is read.

A job names directories and files (`spec.model.from_pretrained`, `spec.data.paths`, `spec.data.tokenizer`,
`spec.init_from`); the files opened *inside* them (config.json, each safetensors shard an index names,
tokenizer files, chat templates, an Arrow directory's state.json and stream files, a token-shard
index and its shards) are content that arrives with downloaded models and datasets, so they are chosen
by whoever made them. `FileRule` is applied to each such file where it is opened, by the service at
submit and again by the job's ranks:

- `check(path)`: the file, symlinks resolved (`os.path.realpath`), lies under one of `roots` (no
  roots: anywhere), and not inside the run directory (`<runs_dir>/<job id>`) of a job outside
  `readable_runs`, which holds the job's own run directory and those the service let its spec name
  (a file in one of those passes whatever the roots).
- `member(directory, name)`: a file name read from an index (`weight_map`, `_data_files`, a shard
  list) is a relative path that stays in `directory`: absolute names and `..` components are refused
  by name, then the joined path is `check`ed.
- `check_tree(directory)`: every entry of a directory handed whole to a library (a tokenizer directory
  to `transformers`) passes `check`; at most `MAX_TREE_ENTRIES` entries are looked at.
- `read_bytes`, `read_json`, `first_line`: bounded reads. A file over the limit is refused naming the
  file and the limit, without reading past it; JSON deeper than `MAX_JSON_DEPTH` is refused before it
  is decoded (Python's decoder would recurse).

Errors are `FileRuleError`s: their message names the spec field, the path and the rule broken, never
anything read from a file the rule refused. Pure standard library: the service, the CLI and the
engine share it; the rule travels to the ranks as `FileRule.to_json()`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

MAX_JSON_BYTES = 16 << 20
"""Largest JSON file (config, index, state, tokenizer config) read whole; a real one is a few MiB at most."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in a JSON file or record."""
MAX_JSON_TOKENS = 1_000_000
"""Most tokens (strings, arrays, objects, separators) in one JSON file or record: a model index or a shard
list holds tens of thousands, a record a few hundred; what decoding allocates is bounded by it."""
MAX_RECORD_TOKENS = 100_000
"""Most tokens in the one data record the service decodes at submit (a JSONL file's first)."""
MAX_LINE_BYTES = 4 << 20
"""Longest first record read from a JSONL file at submit."""
MAX_TREE_ENTRIES = 10_000
"""Most entries `check_tree` looks at in one directory tree."""


class FileRuleError(ValueError):
    """A file a job's process would open breaks the rule; `field` is the spec field that led to it."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self) -> tuple[type[FileRuleError], tuple[str, str]]:
        # Pickled as (field, message): it crosses process boundaries (a rank's error to its supervisor).
        return type(self), (self.field, self.message)


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


_JSON_STRUCTURE = re.compile(rb'["\[\]{},:]')
_JSON_STRING_REST = re.compile(rb'(?:[^"\\]++|\\.)*+"', re.DOTALL)
"""What follows a string's opening quote up to its closing one (possessive: linear, never backtracks)."""


def json_shape_problem(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH, max_tokens: int = MAX_JSON_TOKENS) -> str | None:
    """Why `raw` is too deep or made of too many tokens to decode (None: neither, or it is not JSON, which
    the decoder then says). Tokens are strings, opening brackets and separators; what is inside a string
    does not count. Linear: each string is skipped by one regular-expression match, and the loop never recurses."""
    text = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    depth = tokens = pos = 0
    while (found := _JSON_STRUCTURE.search(text, pos)) is not None:
        at = found.start()
        byte = text[at]
        pos = at + 1
        if byte == 0x22:  # a string: jump past its closing quote
            rest = _JSON_STRING_REST.match(text, pos)
            if rest is None:
                return None
            pos = rest.end()
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > max_depth:
                return f"nested deeper than {max_depth} levels"
        elif byte in (0x5D, 0x7D):
            depth -= 1
            continue
        tokens += 1
        if tokens > max_tokens:
            return f"made of more than {max_tokens} tokens"
    return None


def loads_bounded(raw: bytes | str, what: str, field: str, max_tokens: int = MAX_JSON_TOKENS) -> object:
    """`json.loads(raw)`, refusing nesting past MAX_JSON_DEPTH and more than MAX_JSON_TOKENS tokens
    (FileRuleError naming `what`) instead of recursing or growing."""
    problem = json_shape_problem(raw, max_tokens=max_tokens)
    if problem:
        raise FileRuleError(field, f"{what} is {problem}; not a file trainctl reads")
    try:
        return json.loads(raw)
    except RecursionError:  # a decoder with a lower recursion limit than the bound allows
        raise FileRuleError(field, f"{what} is nested too deeply to read") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise FileRuleError(field, f"{what} is not valid JSON: {exc}") from None


_SCAN_CHUNK = 64 << 10
"""Bytes `first_line` holds at a time while it looks for where its line starts and ends."""


def _first_line_span(handle: BinaryIO, limit: int, skip_blank: bool) -> tuple[int, int, int] | None:
    """(line number, start offset, end offset past its newline) of the first (non-blank) line of the
    binary file `handle`, scanning chunk by chunk and never past offset `limit` + 1 (an end beyond
    `limit` means the line does not end within it); None for a file with no such line."""
    number, start, offset = 1, 0, 0
    while skip_blank:  # skip blank lines: whitespace only
        chunk = handle.read(min(_SCAN_CHUNK, limit + 1 - offset))
        if not chunk:
            return None
        blank = len(chunk) - len(chunk.lstrip())
        newlines = chunk.count(b"\n", 0, blank)
        if newlines:
            number += newlines
            start = offset + chunk.rindex(b"\n", 0, blank) + 1
        offset += blank
        if blank < len(chunk) or offset > limit:
            break
    handle.seek(offset)
    while offset <= limit:  # find the line's end
        chunk = handle.read(min(_SCAN_CHUNK, limit + 1 - offset))
        if not chunk:
            return (number, start, offset) if offset > start else None
        cut = chunk.find(b"\n")
        if cut >= 0:
            return number, start, offset + cut + 1
        offset += len(chunk)
    return number, start, offset


@dataclass(frozen=True)
class FileRule:
    """Where a job's files may lie (module docstring). The default rule (no roots, no runs directory)
    confines nothing but still refuses escaping index entries and bounds every read."""

    roots: tuple[str, ...] = ()
    """Real paths of the directories every file must lie under; empty: anywhere."""
    runs_dir: str | None = None
    """Real path of the service's run directories (`<data-dir>/runs`); None: no run directory is guarded."""
    readable_runs: frozenset[str] = field(default_factory=frozenset)
    """Job ids whose run directories the job may read (its own, and those its spec names that are its tenant's)."""

    # ---- where a file may lie ---------------------------------------------------------------------------

    def problem(self, path: str | os.PathLike[str]) -> str | None:
        """Why the file at `path` breaks the rule (None: it does not); the text names the path only."""
        real = os.path.realpath(os.path.expanduser(os.fspath(path)))
        run = None  # the job whose run directory `real` lies in
        if self.runs_dir is not None and _within(real, self.runs_dir) and real != self.runs_dir:
            run = Path(os.path.relpath(real, self.runs_dir)).parts[0]
        readable_run = run is not None and run in self.readable_runs  # e.g. `init_from: job:<id>`, whatever the roots
        if self.roots and not readable_run and not any(_within(real, root) for root in self.roots):
            how = "is" if real == os.path.abspath(os.fspath(path)) else "resolves through a symlink"
            return f"{os.fspath(path)!r} {how} outside the data roots ({', '.join(self.roots)})"
        if run is not None and not readable_run:
            return f"{os.fspath(path)!r} lies in the service's run directory of a job that is not this job's tenant's"
        return None

    def check(self, path: str | os.PathLike[str], field: str) -> Path:
        """`path` (user-expanded) if it obeys the rule, else FileRuleError naming `field`."""
        problem = self.problem(path)
        if problem:
            raise FileRuleError(field, problem)
        return Path(os.path.expanduser(os.fspath(path)))

    def member(self, directory: str | os.PathLike[str], name: object, field: str, source: str) -> Path:
        """The file `name` of `directory`, as listed in the index file `source` (a name in it must be a
        relative path that stays in `directory`), checked."""
        if not isinstance(name, str) or not name or "\x00" in name:
            raise FileRuleError(field, f"{source} names a file {name!r} that is not a file name")
        if os.path.isabs(name) or name.startswith("~"):
            raise FileRuleError(field, f"{source} names {name!r}, an absolute path; entries must be files of its directory")
        if ".." in Path(name).parts:
            raise FileRuleError(field, f"{source} names {name!r}, which climbs out of its directory")
        path = Path(os.path.expanduser(os.fspath(directory))) / name
        base = os.path.realpath(os.path.expanduser(os.fspath(directory)))
        if not _within(os.path.realpath(path), base):
            raise FileRuleError(field, f"{source} names {name!r}, which resolves outside its directory through a symlink")
        return self.check(path, field)

    def check_tree(self, directory: str | os.PathLike[str], field: str) -> Path:
        """`directory` with every entry under it (symlinks resolved) obeying the rule, else FileRuleError."""
        root = self.check(directory, field)
        seen = 0
        for base, dirs, files in os.walk(root):
            for name in dirs + files:
                seen += 1
                if seen > MAX_TREE_ENTRIES:
                    raise FileRuleError(field, f"{os.fspath(directory)!r} holds more than {MAX_TREE_ENTRIES} entries")
                self.check(os.path.join(base, name), field)
        return root

    # ---- how much of it is read -------------------------------------------------------------------------

    def read_bytes(self, path: str | os.PathLike[str], field: str, limit: int) -> bytes:
        """The whole file, checked and at most `limit` bytes (a larger one is refused unread)."""
        checked = self.check(path, field)
        try:
            with open(checked, "rb") as handle:
                raw = handle.read(limit + 1)
        except OSError as exc:
            raise FileRuleError(field, f"cannot read {os.fspath(path)}: {exc.strerror or exc}") from None
        if len(raw) > limit:
            raise FileRuleError(field, f"{os.fspath(path)} is larger than {limit} bytes, the most trainctl reads of such a file")
        return raw

    def read_json(self, path: str | os.PathLike[str], field: str, limit: int = MAX_JSON_BYTES) -> object:
        """The decoded JSON file, checked, bounded in size and depth."""
        return loads_bounded(self.read_bytes(path, field, limit), os.fspath(path), field)

    def first_line(self, path: str | os.PathLike[str], field: str, limit: int = MAX_LINE_BYTES,
                   skip_blank: bool = True) -> tuple[int, bytes] | None:
        """(line number, bytes) of the file's first (non-blank) line, reading at most `limit` bytes of it;
        None for a file with no such line. A longer line is refused naming the file and the limit."""
        checked = self.check(path, field)
        try:
            with open(checked, "rb") as handle:
                found = _first_line_span(handle, limit, skip_blank)
                if found is None:
                    return None
                number, start, end = found
                if end > limit:
                    raise FileRuleError(field, f"{os.fspath(path)}: no complete record in its first {limit} bytes "
                                               f"(line {number} or the blank lines before it are longer)")
                handle.seek(start)
                return number, handle.read(end - start)
        except OSError as exc:
            raise FileRuleError(field, f"cannot read {os.fspath(path)}: {exc.strerror or exc}") from None

    # ---- travel to the ranks ---------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps({"roots": list(self.roots), "runs_dir": self.runs_dir, "readable_runs": sorted(self.readable_runs)})

    @classmethod
    def from_json(cls, text: str) -> FileRule:
        data = json.loads(text)
        return cls(tuple(data["roots"]), data["runs_dir"], frozenset(data["readable_runs"]))
