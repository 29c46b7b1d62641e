"""The files a job's data spec names, and what they can give (submit-time, cheap): paths that match
readable files, token-shard indexes, the tokenizer, record fields (trainctl.spec.data_sources) and a
corpus large enough for one sample. Every file opened is opened under the job's `FileRule`."""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

from trainctl.spec import data_sources
from trainctl.spec.data_format import TOKEN_SHARD_INDEX
from trainctl.spec.files import FileRule, FileRuleError
from trainctl.spec.job import STDLIB_CORPUS, TOKENIZER_AUTO, DataSpec, JobSpecBody, resolve_tokenizer
from trainctl.spec.violations import FieldViolation

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Files of a Hugging Face tokenizer directory; a directory with none of them holds no tokenizer."""

MAX_TOKENS_PER_BYTE = 3
"""Most tokens a tokenizer.json emits per byte of text: a byte-level BPE emits at most one per byte of
the decoded text, and an invalid byte decodes to U+FFFD, three bytes. Used only to bound a corpus's
tokens from its size without tokenizing it."""


def resolve_data_paths(patterns: list[str]) -> list[Path]:
    """Files matched by the spec's data globs, sorted, with `@stdlib` expanded."""
    files: set[Path] = set()
    for pattern in patterns:
        if pattern == STDLIB_CORPUS:
            root = Path(sysconfig.get_paths()["stdlib"])
            files.update(p for p in root.glob("*.py") if p.is_file())
        else:
            files.update(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())
    return sorted(files)


def data_violations(data: DataSpec, *, model_dir: str | None = None, files: FileRule = FileRule()) -> list[FieldViolation]:
    """The files `data` names exist and are readable (text, JSONL or Parquet files, token-shard
    directories with an index, save_to_disk directories; the tokenizer file or directory), record data
    has its field (`data_sources`), chat data has a tokenizer with a chat template, and the corpus holds
    at least one sample (`corpus_capacity_violations`). `model_dir` is the job's from_pretrained
    directory (what `tokenizer: auto` means). Every file opened or handed on is under `files`, the job's
    rule (trainctl.spec.files): a tokenizer directory's every entry, since the ranks hand it whole to
    transformers. A service with confinement calls it only for paths its path policy let through
    (trainctl.service.security.paths)."""
    if data.format == "tokens":
        out = _shard_violations(data.paths, files)
    elif data.format == "arrow":
        out = [FieldViolation(f, p) for f, p in data_sources.arrow_problems(data, files)]
    else:
        out = _glob_violations(data.paths)
    tokenizer = resolve_tokenizer(data, model_dir)
    tokenizer_path = Path(tokenizer).expanduser()
    tokenizer_problem = None if tokenizer == "byte" else _tokenizer_rule_problem(tokenizer_path, files)
    if tokenizer_problem:
        out.append(FieldViolation("spec.data.tokenizer", tokenizer_problem))
    elif tokenizer != "byte" and not (tokenizer_path.is_file() or tokenizer_path.is_dir()):
        out.append(FieldViolation("spec.data.tokenizer", f"tokenizer file or directory {tokenizer!r} does not exist"))
    elif tokenizer_path.is_dir() and not any((tokenizer_path / name).is_file() for name in TOKENIZER_FILES):
        meaning = "tokenizer: auto names the from_pretrained model directory " if data.tokenizer == TOKENIZER_AUTO else "directory "
        out.append(FieldViolation(
            "spec.data.tokenizer",
            f"{meaning}{tokenizer!r}, which holds none of {', '.join(TOKENIZER_FILES)}; name a tokenizer (or byte)",
        ))
    if data.messages_field is not None:
        if data.format in ("text", "tokens"):
            out.append(FieldViolation("spec.data.messages_field", f"chat records need format jsonl, parquet or arrow, not {data.format}"))
        elif not tokenizer_path.is_dir():
            out.append(FieldViolation(
                "spec.data.messages_field",
                f"chat records are rendered with the model's chat template: spec.data.tokenizer must be a Hugging Face "
                f"tokenizer directory (or the from_pretrained model's), not {tokenizer!r}",
            ))
    if out:
        return out
    if data.format in ("jsonl", "parquet"):
        paths = resolve_data_paths(data.paths)[: data.max_files]
        check = data_sources.jsonl_problem if data.format == "jsonl" else data_sources.parquet_problem
        problem = check(paths, data, files)
        return [FieldViolation(*problem)] if problem else []
    if data.format == "arrow":
        return []
    return corpus_capacity_violations(data, tokenizer, files)


def evaluation_data_violations(spec: JobSpecBody, files: FileRule = FileRule()) -> list[FieldViolation]:
    """`data_violations` of `spec.evaluation.data` (none without it), its files under `files`, each
    naming its field under `spec.evaluation.data`."""
    if spec.evaluation is None or spec.evaluation.data is None:
        return []
    return [
        FieldViolation(v.field.replace("spec.data.", "spec.evaluation.data.", 1), v.description)
        for v in data_violations(spec.evaluation.data, model_dir=spec.model.from_pretrained, files=files)
    ]


def _glob_violations(patterns: list[str]) -> list[FieldViolation]:
    """data.format text, jsonl or parquet: every pattern matches files, all of them readable."""
    out = []
    if not patterns:
        return [FieldViolation("spec.data.paths", "at least one path or glob is required")]
    for i, pattern in enumerate(patterns):
        if pattern == STDLIB_CORPUS:
            continue
        matches = resolve_data_paths([pattern])
        if not matches:
            out.append(FieldViolation(f"spec.data.paths[{i}]", f"{pattern!r} matches no files"))
            continue
        unreadable = [p for p in matches if not os.access(p, os.R_OK)]
        if unreadable:
            out.append(FieldViolation(f"spec.data.paths[{i}]", f"{len(unreadable)} matched files are unreadable, e.g. {unreadable[0]}"))
    return out



def _shard_violations(patterns: list[str], files: FileRule) -> list[FieldViolation]:
    """data.format tokens: every path must be a directory written by `trainctl data prepare`, whose
    index (read under `files`) names shard files of the directory."""
    if not patterns:
        return [FieldViolation("spec.data.paths", "at least one prepared token-shard directory is required")]
    out = []
    for i, path in enumerate(patterns):
        try:
            _indexed_tokens(Path(os.path.expanduser(path)), f"spec.data.paths[{i}]", files)
        except FileRuleError as exc:
            out.append(FieldViolation(exc.field, exc.message))
    return out


def _tokenizer_rule_problem(path: Path, files: FileRule) -> str | None:
    """Why the tokenizer file, or an entry of the tokenizer directory, breaks the rule (None: none does)."""
    try:
        if path.is_dir():
            files.check_tree(path, "spec.data.tokenizer")
        else:
            files.check(path, "spec.data.tokenizer")
    except FileRuleError as exc:
        return exc.message
    return None


def corpus_capacity_violations(data: DataSpec, tokenizer: str | None = None, files: FileRule = FileRule()) -> list[FieldViolation]:
    """`spec.data.seq_len` against what the data can give: the corpus must hold one sample of seq_len + 1
    tokens. Counted exactly from file sizes (byte tokenizer) or the shards' index (format tokens); for a
    tokenizer file, bounded from file sizes (MAX_TOKENS_PER_BYTE), so only a corpus too small under any
    tokenization is refused here and the ranks catch the rest. `tokenizer` is the resolved
    `data.tokenizer` (default: `data.tokenizer` resolved without a model directory); shard indexes are
    read under `files`. Call it once the paths are known valid (formats text and tokens)."""
    need = data.seq_len + 1
    try:
        tokens, what = _corpus_tokens(data, tokenizer or resolve_tokenizer(data, None), files)
    except FileRuleError as exc:
        return [FieldViolation(exc.field, exc.message)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [FieldViolation("spec.data.paths", f"cannot size the corpus: {exc!r}")]
    if tokens >= need:
        return []
    return [FieldViolation("spec.data.seq_len", f"a sample needs seq_len + 1 = {need} tokens but {what}")]


def _corpus_tokens(data: DataSpec, tokenizer: str, files: FileRule) -> tuple[int, str]:
    """Tokens the corpus holds (exact, or an upper bound for a tokenizer file) and how that was counted."""
    if data.format == "tokens":
        tokens = sum(
            _indexed_tokens(Path(os.path.expanduser(path)), f"spec.data.paths[{i}]", files) for i, path in enumerate(data.paths)
        )
        return tokens, f"the shards hold {tokens} tokens"
    files = resolve_data_paths(data.paths)[: data.max_files]
    size = sum(path.stat().st_size for path in files)
    if tokenizer == "byte":
        return size, f"the {len(files)} files hold {size} bytes, one token each"
    bound = size * MAX_TOKENS_PER_BYTE
    return bound, f"the {len(files)} files hold {size} bytes, at most {bound} tokens under any tokenizer"


def _indexed_tokens(directory: Path, field: str, files: FileRule) -> int:
    """Tokens a prepared token-shard directory holds, from its index.json read under `files`; each shard
    (and mask) file it names must be a file of the directory under the rule (checked, not opened).
    FileRuleError naming `field` when the directory has no such index."""
    index_path = files.check(directory / TOKEN_SHARD_INDEX, field)
    if not index_path.is_file():
        raise FileRuleError(field, f"{str(directory)!r} is not a token-shard directory (no {TOKEN_SHARD_INDEX}); build it with "
                                   "`trainctl data prepare`")
    index = files.read_json(index_path, field)
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list) or not all(isinstance(shard, dict) for shard in shards):
        raise FileRuleError(field, f"{index_path} is not a token-shard index (no shards list)")
    tokens = 0
    for shard in shards:
        for name in [shard.get("file")] + ([shard["mask"]] if "mask" in shard else []):
            files.member(directory, name, field, str(index_path))
        count = shard.get("tokens")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise FileRuleError(field, f"{index_path} gives a shard a token count that is not a whole number")
        tokens += count
    return tokens
