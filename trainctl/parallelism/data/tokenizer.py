"""Tokenizers: a byte-level default, a local tokenizer.json through the `tokenizers` package, and a
directory of Hugging Face tokenizer files through `transformers.AutoTokenizer` (the only kind with a
chat template and an end-of-sequence token, so the only kind that renders chat records and separates
documents with EOS).

`load_tokenizer(name, files)` takes a resolved name (`trainctl.spec.job.resolve_tokenizer` turns `auto`
into the model's directory or `byte`) and the job's `FileRule` (trainctl.spec.files): a tokenizer file
must obey it, and so must every entry of a directory before the directory is handed to transformers
(which opens whatever files it holds)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.files import FileRule

FIELD = "spec.data.tokenizer"


class Tokenizer(Protocol):
    """What the data pipeline needs: a vocabulary size and text -> token ids."""

    vocab_size: int
    eos_id: int | None
    """Token appended after every document (None: documents are concatenated as they are)."""

    def encode(self, text: bytes) -> np.ndarray:
        """Token ids of `text` (raw file bytes) as an int64 array."""
        ...


class ByteTokenizer:
    """Each byte is a token: vocabulary 256, lossless, no files needed."""

    vocab_size = 256
    eos_id = None

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


class HFTokenizer:
    """A tokenizer.json read by the `tokenizers` package (decoded from UTF-8, invalid bytes replaced)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers package raises its own untyped errors for a bad file
            raise ConfigurationError(f"{FIELD}: {str(path)!r} is not a loadable tokenizer.json: {exc}") from exc
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = None

    def encode(self, text: bytes) -> np.ndarray:
        ids = self._tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)


class TransformersTokenizer:
    """A directory of Hugging Face tokenizer files loaded with `transformers.AutoTokenizer` (local
    files only). Its vocabulary counts the added tokens; its EOS separates documents."""

    def __init__(self, directory: Path):
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError and its own errors for a bad directory
            raise ConfigurationError(f"{FIELD}: {str(directory)!r} holds no loadable tokenizer: {exc}") from exc
        self.directory = directory
        self.vocab_size = len(self.hf)
        self.eos_id = self.hf.eos_token_id

    def encode(self, text: bytes) -> np.ndarray:
        ids = self.hf.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False)
        return np.asarray(ids, dtype=np.int64)


def load_tokenizer(name: str, files: FileRule = FileRule()) -> Tokenizer:
    """`byte`, the path of a local tokenizer.json (read with `tokenizers`), or a directory of Hugging Face
    tokenizer files (read with `transformers`), its files obeying `files`."""
    if name == "byte":
        return ByteTokenizer()
    path = files.check(name, FIELD)
    if path.is_dir():
        return TransformersTokenizer(files.check_tree(path, FIELD))
    if not path.is_file():
        raise ConfigurationError(f"{FIELD}: tokenizer file {name!r} does not exist")
    return HFTokenizer(path)


def document_tokens(tokenizer: Tokenizer, text: bytes) -> np.ndarray:
    """One document's tokens as it enters the token stream: its encoding, then EOS when the tokenizer
    has one (every format and `trainctl data prepare` build the stream with this function)."""
    ids = tokenizer.encode(text)
    if tokenizer.eos_id is None:
        return ids
    return np.append(ids, np.int64(tokenizer.eos_id))
