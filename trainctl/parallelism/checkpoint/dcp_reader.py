"""The one way trainctl reads a DCP checkpoint: torch's `FileSystemReader` and `DefaultLoadPlanner`
with every pickle they would load from the checkpoint restricted, and the files it names confined.

A checkpoint is a directory of files that whoever wrote it chose: `spec.init_from` names another run's
checkpoint, which may be a directory a tenant wrote inside a data root. torch unpickles two things out
of it, and plain `pickle` runs any callable a pickle names:

- `.metadata` (`FileSystemReader.read_metadata`: `pickle.load`). `CheckpointReader` reads it bounded
  (`MAX_METADATA_BYTES`, under the job's `FileRule`) and unpickles it with `MetadataUnpickler`, which
  resolves only the globals in `METADATA_GLOBALS` (what torch's save writes: DCP's metadata
  dataclasses, torch.Size, dtypes, layouts, paths) and refuses any other before it is imported, let
  alone called. Each storage entry's file must be a member of the checkpoint directory (`FileRule.member`):
  DCP opens `directory / relative_path` for it.
- every non-tensor item (`DefaultLoadPlanner.load_bytes`: `torch.load(weights_only=False)`).
  `CheckpointLoadPlanner` loads them with `weights_only=True` (torch's own restricted unpickler;
  trainctl's non-tensor items are numbers, strings and containers of them). Tensors torch already
  loads with `weights_only=True`.

A refusal is a `ConfigurationError` naming the spec field that led to the checkpoint, the file and
the refused global: the job cannot run with that checkpoint, however often it is restarted.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.files import FileRule, FileRuleError

MAX_METADATA_BYTES = 1 << 30
"""Largest `.metadata` read (1 GiB). It grows with the storage entries (about 250 bytes each, one per
tensor shard and non-tensor item): a 70B model sharded 512 ways writes about 300 MB."""

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format, an Enum
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout: a lookup by name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    }
    | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
)
"""Every global a `.metadata` written by `dcp.save` (torch 2.13) references, and nothing else: listed
from real checkpoints of the engine in every layout its tests save (single process with each optimizer
and dtype, FSDP, ZeRO-1/2, DDP, TP, PP, CP, MoE with EP), plus every dtype a tensor may have. None of
them, called with any arguments, does more than build a value."""


def _refusal(field: str, file: Path, what: str) -> ConfigurationError:
    return ConfigurationError(f"{field}: {file}: {what}; refused without loading the checkpoint")


class MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `METADATA_GLOBALS` and refuses persistent ids."""

    def __init__(self, file: io.BytesIO, source: Path, field: str):
        super().__init__(file)
        self.source = source
        self.field = field

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in METADATA_GLOBALS:
            what = f"the DCP metadata references the global {module}.{name}, which no checkpoint's metadata holds"
            raise _refusal(self.field, self.source, what)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise _refusal(self.field, self.source, "the DCP metadata holds a persistent id, which DCP never writes")


def read_metadata_file(directory: Path, name: str, files: FileRule, field: str) -> Metadata:
    """The DCP metadata `directory/name`, read bounded under `files` and unpickled restricted; every
    storage entry's file checked to be a member of `directory` (ConfigurationError, FileRuleError)."""
    path = files.member(directory, name, field, str(directory))
    raw = files.read_bytes(path, field, MAX_METADATA_BYTES)
    try:
        metadata = MetadataUnpickler(io.BytesIO(raw), path, field).load()
    except ConfigurationError:
        raise
    except Exception as exc:  # truncated or malformed: any error an allowed constructor or pickle raises
        raise _refusal(field, path, f"not a DCP metadata file ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise _refusal(field, path, f"not a DCP metadata file (it holds a {type(metadata).__name__})")
    items, storage = metadata.state_dict_metadata, metadata.storage_data
    kinds = TensorStorageMetadata | BytesStorageMetadata
    if not isinstance(items, dict) or not all(isinstance(md, kinds) for md in items.values()):
        raise _refusal(field, path, "the DCP metadata's items are malformed")
    if not isinstance(storage, dict) or not all(isinstance(info, _StorageInfo) for info in storage.values()):
        raise _refusal(field, path, "the DCP metadata's storage entries are malformed")
    checked: set[str] = set()
    for info in storage.values():  # DCP opens `directory / relative_path` for each
        name = info.relative_path
        if not (isinstance(name, str) and name in checked):
            files.member(directory, name, field, str(path))
            checked.add(name)
    return metadata


class CheckpointReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read by `read_metadata_file` (under `files`, errors naming
    `field`), once per file: `load_dcp` reads it before DCP does, so a refusal is raised as itself."""

    def __init__(self, path: str | Path, files: FileRule, field: str):
        super().__init__(path)
        self.files = files
        self.field = field
        self._read: dict[str, Metadata] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._read.clear()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        name = Path(self._get_metadata_path(kwargs.get("rank"))).name
        if name not in self._read:
            self._read[name] = read_metadata_file(Path(self.path), name, self.files, self.field)
        metadata = self._read[name]
        if not isinstance(metadata.storage_meta, StorageMeta):  # as torch's read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_WEIGHTS_ONLY_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
"""How torch's weights-only unpickler names the global it refused."""


class CheckpointLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that loads non-tensor items with torch's weights-only unpickler."""

    def __init__(self, source: Path, field: str):
        super().__init__()
        self.source = source
        self.field = field

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            item = torch.load(value, weights_only=True)
        except Exception as exc:  # a refused global, or not a torch.save stream
            named = _WEIGHTS_ONLY_GLOBAL.search(str(exc))
            what = f"references the global {named.group(1)}" if named else f"is not a value ({type(exc).__name__})"
            raise _refusal(self.field, self.source, f"its item {fqn} {what}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item


def load_dcp(state: dict[str, Any], reader: CheckpointReader, no_dist: bool) -> None:
    """`dcp.load(state)` from `reader`'s checkpoint with `CheckpointLoadPlanner`; a refusal (a
    ConfigurationError or FileRuleError, on any rank) is raised as itself, not wrapped by DCP."""
    reader.read_metadata()  # on every rank, before any collective: a refused checkpoint stops each rank here
    try:
        planner = CheckpointLoadPlanner(Path(reader.path), reader.field)
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as exc:
        refusals = ConfigurationError | FileRuleError
        refused = [error for error, _trace in exc.failures.values() if isinstance(error, refusals)]
        if refused:
            raise refused[0] from None
        raise
