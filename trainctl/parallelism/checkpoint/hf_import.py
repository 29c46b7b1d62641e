"""Weights of a local Hugging Face model directory (`spec.model.from_pretrained`) in the engine's names.

`read_hf_weights(directory, config, shapes)` reads exactly the tensors named in `shapes` (engine names ->
expected shapes): a caller that owns part of the model (a pipeline stage) names only its part. Files:
`model.safetensors`, or `model.safetensors.index.json` and the shards its `weight_map` names; each
tensor is read on its own through `safetensors.safe_open` (memory-mapped, so only the named tensors'
bytes are touched). Names map through `hf_names` and the q/k side is permuted from rotate-half to the
engine's interleaved RoPE layout. With `tie_embeddings`, `output.weight` is the embedding. A
Mixtral layer's router and experts are read from all of that layer's `block_sparse_moe.` (or fused
`mlp.experts.`) tensors and stacked by `hf_moe.moe_state_dict`.

Every problem is a `ConfigurationError` naming `spec.model.from_pretrained`, the file and the tensor:
a shard file named in the index that is missing, a truncated or corrupt safetensors file, a tensor
that is missing or has the wrong shape.

The engine builds the whole model on CPU before sharding it, so the Trainer reads whole tensors (per
rank, the whole model); reading only a TP/FSDP shard's rows would need the model materialised on the
meta device first, which the engine does not do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from trainctl.parallelism.checkpoint.hf_moe import MixtralWeightsError, moe_state_dict
from trainctl.parallelism.checkpoint.hf_names import halves_to_interleaved, hf_name, rope_heads
from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.presets import ModelConfig

FIELD = "spec.model.from_pretrained"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(directory: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the index, or the single file's header)."""
    root = Path(directory).expanduser()
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            return {str(name): root / str(file) for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigurationError(f"{FIELD}: {index}: not a readable safetensors index: {exc}") from None
    single = root / SINGLE_FILE
    if not single.is_file():
        raise ConfigurationError(f"{FIELD}: {root} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    with _opened(single) as handle:
        return dict.fromkeys(handle.keys(), single)


class _opened:
    """`safe_open(path)` whose failures are ConfigurationErrors naming the file."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        if not self.path.is_file():
            raise ConfigurationError(f"{FIELD}: {self.path}: the shard file named in {INDEX_FILE} does not exist")
        try:
            self._cm = safe_open(str(self.path), framework="pt")
            return self._cm.__enter__()
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigurationError(f"{FIELD}: {self.path}: not a readable safetensors file (truncated or corrupt?): {exc}") from None

    def __exit__(self, *exc_info: object) -> None:
        self._cm.__exit__(*exc_info)


def source_name(name: str, config: ModelConfig) -> str:
    """The HF tensor an engine parameter is read from (tied output head: the embedding)."""
    if name == "output.weight" and config.tie_embeddings:
        return "model.embed_tokens.weight"
    target = hf_name(name)
    if target is None:
        raise ConfigurationError(f"{FIELD}: the engine parameter {name!r} has no Hugging Face counterpart")
    return target


def read_hf_weights(
    directory: str | Path, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The tensors named in `shapes` (engine names), read from `directory` (see the module docstring)."""
    files = weight_files(directory)
    dense = {name: source_name(name, config) for name in shapes if ".moe." not in name}
    out = {name: _dense(name, tensor, config).to(dtype) for name, tensor in _read(files, dense, directory).items()}
    moe_layers = sorted({name.split(".")[1] for name in shapes if ".moe." in name})
    if moe_layers:
        out.update({name: tensor.to(dtype) for name, tensor in _read_moe(files, moe_layers, config, directory).items()})
    for name, shape in shapes.items():
        if name not in out:
            raise ConfigurationError(f"{FIELD}: {directory}: no tensor for the engine parameter {name!r}")
        if tuple(out[name].shape) != tuple(shape):
            raise ConfigurationError(
                f"{FIELD}: {_described(name, config, files, directory)} has shape {tuple(out[name].shape)}, the model of its "
                f"config.json needs {tuple(shape)} (for {name})"
            )
    return {name: out[name] for name in shapes}


def _read(files: Mapping[str, Path], sources: Mapping[str, str], directory: str | Path) -> dict[str, torch.Tensor]:
    """`sources` (key -> HF tensor name) read from their files, by key."""
    wanted: dict[Path, list[tuple[str, str]]] = {}
    for key, source in sources.items():
        if source not in files:
            raise ConfigurationError(f"{FIELD}: {directory}: tensor {source!r} (for {key}) is missing from the safetensors files")
        wanted.setdefault(files[source], []).append((key, source))
    out: dict[str, torch.Tensor] = {}
    for path, names in sorted(wanted.items()):
        with _opened(path) as handle:
            for key, source in names:
                try:
                    out[key] = handle.get_tensor(source)
                except (SafetensorError, OSError, ValueError, KeyError) as exc:
                    raise ConfigurationError(f"{FIELD}: {path}: cannot read tensor {source!r} (truncated or corrupt?): {exc}") from None
    return out


def _dense(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """An HF tensor in the engine's layout: the q/k side permuted to interleaved RoPE pairs."""
    heads = rope_heads(name, config)
    if heads is None or tensor.shape[0] % (2 * heads):
        return tensor  # a wrongly shaped tensor is reported by the shape check
    return halves_to_interleaved(tensor, heads).contiguous()


def _described(name: str, config: ModelConfig, files: Mapping[str, Path], directory: str | Path) -> str:
    """Where engine parameter `name` came from: `FILE: tensor 'HF name'`, or the directory for MoE parameters."""
    if ".moe." in name:
        return f"{directory}: the Mixtral router / expert tensors for {name!r}"
    source = source_name(name, config)
    return f"{files[source]}: tensor {source!r}"


def _read_moe(files: Mapping[str, Path], layers: list[str], config: ModelConfig, directory: str | Path) -> dict[str, torch.Tensor]:
    """The MoE parameters of `layers` from Mixtral tensors (per-expert or fused names, `hf_moe`)."""
    prefixes = tuple(f"model.layers.{layer}.{block}." for layer in layers for block in ("block_sparse_moe", "mlp"))
    sources = {name: name for name in files if name.startswith(prefixes)}
    try:
        return moe_state_dict(_read(files, sources, directory), config)
    except MixtralWeightsError as exc:
        raise ConfigurationError(f"{FIELD}: {directory}: {exc}") from None


def read_model_weights(directory: str | Path, model: torch.nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of `model`'s state dict (a plain model or stage), read from `directory`."""
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    return read_hf_weights(directory, config, shapes)
