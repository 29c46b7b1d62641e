"""Weights of a local Hugging Face model directory (`spec.model.from_pretrained`) in the engine's names.

`HFWeights(directory, config)` opens the directory once and reads engine parameters, or regions of
them, on demand: `read(name, shape, region)` returns rows/columns `region` (slices of the engine's
global tensor `name` of `shape`) and touches only those bytes of the dense tensors (safetensors
slices of a memory-mapped file). A sharded rank asks for exactly the region it owns
(`owned_region`), so its host memory is about its shard. Files: `model.safetensors`, or
`model.safetensors.index.json` and the shards its `weight_map` names.

Names map through `hf_names`; the q/k side is permuted from rotate-half to the engine's interleaved
RoPE layout within each head, so a region of q/k rows is read in whole heads and then cut. With
`tie_embeddings`, `output.weight` is the embedding. A Mixtral layer's router and experts are built
from all of that layer's `block_sparse_moe.` (or fused `mlp.experts.`) tensors by
`hf_moe.moe_state_dict` and then cut, one MoE layer at a time (so a rank's peak is its shard plus one
layer's experts). `read_hf_weights` reads whole tensors (export, LoRA bases, one process).

Every problem is a `ConfigurationError` naming `spec.model.from_pretrained`, the file and the tensor:
a shard file named in the index that is missing, a truncated or corrupt safetensors file, a tensor
that is missing or has the wrong shape.

Every file is opened through the job's `FileRule` (trainctl.spec.files), which refuses it, before it
is read, with a `FileRuleError` naming the field: the index (read bounded) and the single file where
they lie; each shard the index's `weight_map` names must be a file of the directory (all are checked
when the directory is opened, before any weight is read, and each again right before it is opened).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from trainctl.parallelism.checkpoint.hf_moe import MixtralWeightsError, moe_state_dict
from trainctl.parallelism.checkpoint.hf_names import halves_to_interleaved, hf_name, rope_heads
from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.files import FileRule
from trainctl.spec.hf_config import FIELD, INDEX_FILE, SINGLE_FILE
from trainctl.spec.presets import ModelConfig

SAFETENSORS_ERRORS = (SafetensorError, OSError, ValueError, KeyError, TypeError)

Region = tuple[slice, ...]


def weight_files(directory: str | Path, files: FileRule = FileRule()) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the index, or the single file's header),
    every file checked against `files` before anything of it is read."""
    root = Path(directory).expanduser()
    index = files.check(root / INDEX_FILE, FIELD)
    if index.is_file():
        content = files.read_json(index, FIELD)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigurationError(f"{FIELD}: {index}: not a safetensors index (no weight_map object)")
        shards: dict[object, Path] = {}  # an index names a few shards for thousands of tensors
        for file in weight_map.values():
            if not isinstance(file, str) or file not in shards:
                shards[file] = files.member(root, file, FIELD, str(index))
        return {str(name): shards[file] for name, file in weight_map.items()}
    single = files.check(root / SINGLE_FILE, FIELD)
    if not single.is_file():
        raise ConfigurationError(f"{FIELD}: {root} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    with _opened(single, files) as handle:
        return dict.fromkeys(handle.keys(), single)


@contextlib.contextmanager
def _opened(path: Path, files: FileRule):
    """`safe_open(path)`, checked against `files` first, whose failures are ConfigurationErrors naming the file."""
    files.check(path, FIELD)  # again: the file may have been replaced since the directory was opened
    if not path.is_file():
        raise ConfigurationError(f"{FIELD}: {path}: the shard file named in {INDEX_FILE} does not exist")
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigurationError(f"{FIELD}: {path}: not a readable safetensors file (truncated or corrupt?): {exc}") from None
    with handle as opened:
        yield opened


def source_name(name: str, config: ModelConfig) -> str:
    """The HF tensor an engine parameter is read from (tied output head: the embedding)."""
    if name == "output.weight" and config.tie_embeddings:
        return "model.embed_tokens.weight"
    target = hf_name(name)
    if target is None:
        raise ConfigurationError(f"{FIELD}: the engine parameter {name!r} has no Hugging Face counterpart")
    return target


def whole(shape: tuple[int, ...]) -> Region:
    """The region covering a whole tensor of `shape`."""
    return tuple(slice(0, size) for size in shape)


class HFWeights:
    """An open Hugging Face model directory whose tensors are read by engine name and region (a
    context manager). One safetensors file is mapped at a time: reading from another file unmaps the
    previous one, so the file pages a rank has touched leave its resident memory (read in file order,
    as parameters come, each file is opened once)."""

    def __init__(self, directory: str | Path, config: ModelConfig, files: FileRule = FileRule()):
        self.directory = directory
        self.config = config
        self.files = files
        self.holder = weight_files(directory, files)
        """HF tensor name -> the safetensors file holding it."""
        self._stack = contextlib.ExitStack()
        self._open: tuple[Path, object] | None = None  # (the mapped file, its handle)
        self._moe: tuple[str, dict[str, torch.Tensor]] | None = None  # (layer, its MoE parameters)

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._moe = None
        self._open = None
        self._stack.close()

    def read(self, name: str, shape: tuple[int, ...], region: Region | None = None) -> torch.Tensor:
        """Region `region` (default: all) of engine parameter `name`, whose global shape must be
        `shape`, in the engine's layout (float32 unless stored otherwise)."""
        region = whole(shape) if region is None else region
        if ".moe." in name:
            return self._moe_parameter(name, shape)[region].contiguous()
        source = source_name(name, self.config)
        if source not in self.holder:
            raise ConfigurationError(f"{FIELD}: {self.directory}: tensor {source!r} (for {name}) is missing from the safetensors files")
        path = self.holder[source]
        try:
            stored = self._handle(path).get_slice(source)
            stored_shape = tuple(stored.get_shape())
        except SAFETENSORS_ERRORS as exc:
            raise ConfigurationError(f"{FIELD}: {path}: cannot read tensor {source!r} (truncated or corrupt?): {exc}") from None
        if stored_shape != tuple(shape):
            raise ConfigurationError(
                f"{FIELD}: {path}: tensor {source!r} has shape {stored_shape}, the model of its config.json needs "
                f"{tuple(shape)} (for {name})"
            )
        try:
            return self._dense(name, stored, shape, region)
        except SAFETENSORS_ERRORS as exc:
            raise ConfigurationError(f"{FIELD}: {path}: cannot read tensor {source!r} (truncated or corrupt?): {exc}") from None

    def _handle(self, path: Path):
        if self._open is None or self._open[0] != path:
            self._open = None
            self._stack.close()
            self._open = (path, self._stack.enter_context(_opened(path, self.files)))
        return self._open[1]

    def _dense(self, name: str, stored, shape: tuple[int, ...], region: Region) -> torch.Tensor:
        """`region` of a dense tensor; q/k-side rows are read in whole heads, permuted, then cut."""
        heads = rope_heads(name, self.config)
        if heads is None:
            return stored[region].contiguous()
        per_head = shape[0] // heads
        start, stop, _ = region[0].indices(shape[0])
        first, last = start // per_head, -(-stop // per_head)
        rows = stored[(slice(first * per_head, last * per_head), *region[1:])]
        offset = first * per_head
        return halves_to_interleaved(rows, last - first)[start - offset : stop - offset].contiguous()

    def _moe_parameter(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """MoE parameter `name` from its layer's Mixtral tensors (the last layer read is kept)."""
        layer = name.split(".")[1]
        if self._moe is None or self._moe[0] != layer:
            self._moe = None
            prefixes = tuple(f"model.layers.{layer}.{block}." for block in ("block_sparse_moe", "mlp"))
            sources = [source for source in self.holder if source.startswith(prefixes)]
            try:
                self._moe = (layer, moe_state_dict(self._whole_tensors(sources), self.config))
            except MixtralWeightsError as exc:
                raise ConfigurationError(f"{FIELD}: {self.directory}: {exc}") from None
        tensor = self._moe[1].get(name)
        if tensor is None:
            raise ConfigurationError(f"{FIELD}: {self.directory}: no tensor for the engine parameter {name!r}")
        if tuple(tensor.shape) != tuple(shape):
            raise ConfigurationError(
                f"{FIELD}: {self.directory}: the Mixtral router / expert tensors for {name!r} have shape "
                f"{tuple(tensor.shape)}, the model of its config.json needs {tuple(shape)}"
            )
        return tensor

    def _whole_tensors(self, sources: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for source in sources:
            path = self.holder[source]
            try:
                out[source] = self._handle(path).get_tensor(source)
            except SAFETENSORS_ERRORS as exc:
                raise ConfigurationError(f"{FIELD}: {path}: cannot read tensor {source!r} (truncated or corrupt?): {exc}") from None
        return out


def read_hf_weights(
    directory: str | Path, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype = torch.float32,
    files: FileRule = FileRule(),
) -> dict[str, torch.Tensor]:
    """The whole tensors named in `shapes` (engine names -> global shapes), read from `directory` under `files`."""
    with HFWeights(directory, config, files) as weights:
        return {name: weights.read(name, tuple(shape)).to(dtype) for name, shape in shapes.items()}


def read_model_weights(
    directory: str | Path, model: torch.nn.Module, config: ModelConfig, files: FileRule = FileRule()
) -> dict[str, torch.Tensor]:
    """Every tensor of `model`'s state dict (a plain model or stage), read from `directory` under `files`."""
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    return read_hf_weights(directory, config, shapes, files=files)
