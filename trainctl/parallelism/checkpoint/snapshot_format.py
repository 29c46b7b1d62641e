"""The byte layout of an in-memory snapshot: a JSON header and every tensor's bytes after it, each at an
aligned offset, so that packing is one copy of each tensor into one buffer and unpacking reads views of it.

    MAGIC | header length (8 bytes, little-endian) | header (JSON, UTF-8, padded with spaces) | tensor bytes, 16-byte aligned

The header's length leaves room (`HEADER_SLACK`), so the next snapshot of the same tensors, whose numbers in
the header differ, fits the same layout: `pack` then writes into the previous payload's buffer instead of a
new one (allocating and first touching a buffer costs ten times the copy). The header is the state's tree with each tensor replaced by ``{"__tensor__": i}`` (mappings with text keys,
lists, numbers, text, booleans, null) and, per tensor, its dtype, shape and byte range. Nothing in a payload
is executed or unpickled: a malformed one raises `SnapshotFormatError`.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch

MAGIC = b"trainctl-snapshot-1\n"
ALIGNMENT = 16
HEADER_SLACK = 4096
"""Bytes a new payload's header region has beyond its header, for the headers of later snapshots."""
TENSOR_KEY = "__tensor__"


class SnapshotFormatError(ValueError):
    """A payload that is not a snapshot this format can read; the message says what is wrong."""


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _tree(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` as JSON, its tensors appended to ``tensors`` and referred to by index."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {TENSOR_KEY: len(tensors) - 1}
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError("a snapshot's mappings need text keys")
        return {key: _tree(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_tree(item, tensors) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a snapshot cannot hold a {type(value).__name__}")


def pack(state: Any, reuse: bytearray | None = None) -> bytearray:
    """``state`` (tensors on any device, in mappings and lists of plain values) as one payload: written into
    ``reuse`` (a previous payload, no longer needed) when this one has its layout, else into a new buffer."""
    tensors: list[torch.Tensor] = []
    tree = _tree(state, tensors)
    specs, size = [], 0
    for tensor in tensors:
        size = _aligned(size)
        nbytes = tensor.numel() * tensor.element_size()
        specs.append({"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                      "offset": size, "nbytes": nbytes})
        size += nbytes
    header = json.dumps({"tree": tree, "tensors": specs}).encode()
    fixed = len(MAGIC) + 8
    reserved = int.from_bytes(reuse[len(MAGIC): fixed], "little") if reuse is not None and len(reuse) > fixed else -1
    if not (len(header) <= reserved and reuse is not None and len(reuse) == _aligned(fixed + reserved) + size):
        reserved = len(header) + HEADER_SLACK
        reuse = bytearray(_aligned(fixed + reserved) + size)
    payload, start = reuse, _aligned(fixed + reserved)
    payload[: len(MAGIC)] = MAGIC
    payload[len(MAGIC): fixed] = reserved.to_bytes(8, "little")
    payload[fixed: fixed + reserved] = header.ljust(reserved)
    if size:
        data = torch.frombuffer(payload, dtype=torch.uint8)
        with torch.no_grad():
            for tensor, spec in zip(tensors, specs, strict=True):
                if spec["nbytes"]:  # one copy, device to host for a GPU tensor
                    begin = start + spec["offset"]
                    data[begin: begin + spec["nbytes"]].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return payload


def _dtype(name: object) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise SnapshotFormatError(f"unknown tensor dtype {name!r}")
    return dtype


def _tensor(payload: memoryview, start: int, spec: object) -> torch.Tensor:
    """The tensor ``spec`` describes, a view of ``payload`` (read-only: copy out of it, never into it)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("shape"), list):
        raise SnapshotFormatError("a tensor entry is malformed")
    dtype, shape, offset, nbytes = _dtype(spec.get("dtype")), spec["shape"], spec.get("offset"), spec.get("nbytes")
    if not all(isinstance(n, int) and n >= 0 for n in (*shape, offset, nbytes)):
        raise SnapshotFormatError("a tensor entry is malformed")
    numel = 1
    for size in shape:
        numel *= size
    if numel * dtype.itemsize != nbytes or start + offset + nbytes > len(payload):
        raise SnapshotFormatError("a tensor's bytes do not match its shape or lie past the end")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=start + offset)
    return raw.view(dtype).view(shape)


def unpack(payload: bytes | bytearray | memoryview) -> Any:
    """The state a payload holds; its tensors are views of ``payload`` (copy them out before it goes)."""
    view = memoryview(payload)
    if bytes(view[: len(MAGIC)]) != MAGIC or len(view) < len(MAGIC) + 8:
        raise SnapshotFormatError("not a trainctl snapshot")
    length = int.from_bytes(view[len(MAGIC): len(MAGIC) + 8], "little")
    if len(MAGIC) + 8 + length > len(view):
        raise SnapshotFormatError("the header runs past the end")
    try:
        header = json.loads(bytes(view[len(MAGIC) + 8: len(MAGIC) + 8 + length]))
    except ValueError as exc:
        raise SnapshotFormatError(f"the header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise SnapshotFormatError("the header is malformed")
    start = _aligned(len(MAGIC) + 8 + length)
    tensors = [_tensor(view, start, spec) for spec in header["tensors"]]

    def rebuilt(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {TENSOR_KEY}:
                index = node[TENSOR_KEY]
                if not isinstance(index, int) or not 0 <= index < len(tensors):
                    raise SnapshotFormatError("a tensor reference is out of range")
                return tensors[index]
            return {key: rebuilt(item) for key, item in node.items()}
        if isinstance(node, list):
            return [rebuilt(item) for item in node]
        return node

    return rebuilt(header.get("tree"))
