"""Tokenizers: a byte-level default, and a local tokenizer.json through the `tokenizers` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

import numpy as np

from trainctl.parallelism.errors import ConfigurationError


class Tokenizer(Protocol):
    """What the data pipeline needs: a vocabulary size and text -> token ids."""

    vocab_size: int

    def encode(self, text: bytes) -> np.ndarray:
        """Token ids of `text` (raw file bytes) as an int64 array."""
        ...


class ByteTokenizer:
    """Each byte is a token: vocabulary 256, lossless, no files needed."""

    vocab_size = 256

    def encode(self, text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


class HFTokenizer:
    """A tokenizer.json read by the `tokenizers` package (decoded from UTF-8, invalid bytes replaced)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers package raises its own untyped errors for a bad file
            raise ConfigurationError(f"spec.data.tokenizer: {str(path)!r} is not a loadable tokenizer.json: {exc}") from exc
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: bytes) -> np.ndarray:
        ids = self._tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)


def load_tokenizer(name: str) -> Tokenizer:
    """`byte`, or the path of a local tokenizer.json (needs the optional `tokenizers` package)."""
    if name == "byte":
        return ByteTokenizer()
    path = Path(name)
    if not path.is_file():
        raise ConfigurationError(f"spec.data.tokenizer: tokenizer file {name!r} does not exist")
    if importlib.util.find_spec("tokenizers") is None:
        raise ConfigurationError(
            f"spec.data.tokenizer: {name!r} needs the 'tokenizers' package, which is not installed; "
            "install it or use tokenizer: byte"
        )
    return HFTokenizer(path)
