"""What a Hugging Face export carries beside its weights and config.json: the tokenizer files of the
job's tokenizer, and `generation_config.json`.

The job's tokenizer is `spec.data.tokenizer` resolved (`auto`: the `spec.model.from_pretrained`
directory). A directory gives the files of `TOKENIZER_FILES` it holds and the `.jinja` templates of
its `additional_chat_templates/`; a single tokenizer.json file is copied as `tokenizer.json`; the byte
tokenizer has no Hugging Face form, so nothing is copied. Each file is read as the ranks read it, under
the job's `FileRule` (trainctl.spec.files): a member of its directory (a symlink that resolves outside
it is refused), at most `MAX_TOKENIZER_FILE_BYTES`; `tokenizer_files` reads them all before
`write_files` writes any.

`generation_config(source, config, files)` is the source model's `generation_config.json` when it has
one (a JSON object, read bounded), else one built from `config`'s special-token ids
(`SPECIAL_IDS`, as transformers' `GenerationConfig.from_model_config` builds it), or None when config
names neither a bos nor an eos id. `stop_ids` are its end-of-sequence ids: what `trainctl generate`
and transformers' `generate` stop at.

Every file is written with mode `FILE_MODE` (safetensors writes its files 0600).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

from trainctl.parallelism.checkpoint.source import Pretrained
from trainctl.spec.files import FileRule, FileRuleError
from trainctl.spec.hf_config import FIELD as MODEL_FIELD
from trainctl.spec.job import JobSpecBody, resolve_tokenizer

TOKENIZER_FIELD = "spec.data.tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model",
)
"""The files a Hugging Face tokenizer directory may hold (transformers v4 and v5 names)."""
TEMPLATES_DIR = "additional_chat_templates"
"""transformers' sub-directory of named chat templates (`<name>.jinja`)."""
MAX_TEMPLATES = 64
"""Most entries of TEMPLATES_DIR looked at (a real tokenizer has a handful of templates)."""
MAX_TOKENIZER_FILE_BYTES = 64 << 20
"""Largest tokenizer file copied (the largest real tokenizer.json are about 35 MB)."""
GENERATION_CONFIG = "generation_config.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The special-token ids of a config.json (each an integer or null; eos may be a list)."""
FILE_MODE = 0o644


def write_file(path: Path, content: bytes) -> Path:
    """Write `content` to `path` with mode FILE_MODE; returns `path`."""
    path.write_bytes(content)
    os.chmod(path, FILE_MODE)
    return path


def tokenizer_path(job: JobSpecBody) -> Path | None:
    """The job's tokenizer (a directory or a tokenizer.json file), None for the byte tokenizer."""
    name = resolve_tokenizer(job.data, job.model.from_pretrained)
    return None if name == "byte" else Path(name).expanduser()


def tokenizer_files(job: JobSpecBody, files: FileRule = FileRule()) -> dict[str, bytes]:
    """The job's tokenizer files (module docstring) by their name in the export, all read before any is written."""
    source = tokenizer_path(job)
    if source is None:
        return {}
    if files.check(source, TOKENIZER_FIELD).is_file():
        return {"tokenizer.json": files.read_bytes(source, TOKENIZER_FIELD, MAX_TOKENIZER_FILE_BYTES)}
    if not source.is_dir():
        raise FileRuleError(TOKENIZER_FIELD, f"the tokenizer {str(source)!r} is neither a file nor a directory")
    names = list(TOKENIZER_FILES)
    templates = files.member(source, TEMPLATES_DIR, TOKENIZER_FIELD, str(source))
    if templates.is_dir():
        entries = list(itertools.islice(templates.iterdir(), MAX_TEMPLATES + 1))
        if len(entries) > MAX_TEMPLATES:
            raise FileRuleError(TOKENIZER_FIELD, f"{templates} holds more than {MAX_TEMPLATES} entries")
        names += sorted(f"{TEMPLATES_DIR}/{entry.name}" for entry in entries if entry.name.endswith(".jinja"))
    out = {}
    for name in names:
        path = files.member(source, name, TOKENIZER_FIELD, str(source))
        if path.is_file():
            out[name] = files.read_bytes(path, TOKENIZER_FIELD, MAX_TOKENIZER_FILE_BYTES)
    return out


def write_files(out: Path, contents: dict[str, bytes]) -> list[Path]:
    """Write each `name: content` of `contents` under `out` (sub-directories made); the files written."""
    for name in contents:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
    return [write_file(out / name, content) for name, content in contents.items()]


def tokenizer_special_ids(job: JobSpecBody, files: FileRule = FileRule()) -> dict[str, int | None]:
    """bos / eos / pad ids of the job's tokenizer (all None for one without them: byte, a tokenizer.json)."""
    from trainctl.parallelism.data.tokenizer import TransformersTokenizer, load_tokenizer

    source = tokenizer_path(job)
    if source is None or not files.check(source, TOKENIZER_FIELD).is_dir():
        return dict.fromkeys(SPECIAL_IDS)
    tokenizer = load_tokenizer(str(source), files)
    return special_ids_of(tokenizer.hf if isinstance(tokenizer, TransformersTokenizer) else None)


def special_ids_of(hf_tokenizer: Any) -> dict[str, int | None]:
    """bos / eos / pad ids of a transformers tokenizer (None: all None)."""
    return {key: getattr(hf_tokenizer, key, None) for key in SPECIAL_IDS}


def generation_config(source: Pretrained, config: dict, files: FileRule = FileRule()) -> dict | None:
    """The export's generation_config.json (module docstring); None when there is nothing to say."""
    directory = source.job.model.from_pretrained
    if directory is not None:
        path = files.member(directory, GENERATION_CONFIG, MODEL_FIELD, directory)
        if path.is_file():
            content = files.read_json(path, MODEL_FIELD)
            if not isinstance(content, dict):
                raise FileRuleError(MODEL_FIELD, f"{path}: expected a JSON object")
            return content
    ids = {key: config[key] for key in SPECIAL_IDS if config.get(key) is not None}
    if "bos_token_id" not in ids and "eos_token_id" not in ids:
        return None
    return {"_from_model_config": True, **ids}


def stop_ids(generation: dict | None) -> list[int]:
    """The end-of-sequence ids of a generation config (an integer or a list of them; none: []); ValueError
    for anything else."""
    eos = None if generation is None else generation.get("eos_token_id")
    values = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(value, int) and not isinstance(value, bool) and value >= 0 for value in values):
        raise ValueError(f"{GENERATION_CONFIG}: eos_token_id must be a token id or a list of them, got {eos!r:.100}")
    return values
