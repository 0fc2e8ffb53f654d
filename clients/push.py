"""What the sync and asyncio clients send for PushWeights: a state dict or a .safetensors file as the
stream's requests, serialized (``serving_common.push_wire``: each chunk's data copied once). The
chunking and the digest are ``serving_common.tensor_stream``'s, the ones the worker checks.

The clients import neither torch nor safetensors: a file's header is read as JSON, and a state
dict's tensors are read through their own torch.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from serving_common.tensor_stream import DEFAULT_CHUNK_BYTES, TensorBytes, push_messages

# A state dict named "<component>.<parameter>", or the path of a .safetensors file named so.
Weights = Mapping[str, Any] | str | Path
# on_progress(bytes_sent, total_bytes), after each message.
ProgressCallback = Callable[[int, int], None]


def raw_tensor(name: str, tensor: Any) -> TensorBytes:
    """A torch tensor as the stream carries it: torch's dtype name, its shape and its row-major
    bytes, viewed as uint8 before numpy sees them (numpy has no bfloat16). The tensor's own torch
    module does that: the clients never import torch themselves."""
    torch = sys.modules[type(tensor).__module__.split(".")[0]]
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), flat.view(torch.uint8).numpy().data


def _state_dict(weights: Mapping[str, Any]) -> tuple[Iterator[TensorBytes], int]:
    for name, tensor in weights.items():
        if type(tensor).__module__.split(".")[0] != "torch" or not hasattr(tensor, "element_size"):
            raise TypeError(f"weights[{name!r}] is a {type(tensor).__name__}, not a torch.Tensor")
    total = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    return (raw_tensor(name, tensor) for name, tensor in weights.items()), total


# safetensors' dtype codes, as torch names them (what the worker and the runner read).
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _safetensors_file(path: Path) -> tuple[Iterator[TensorBytes], int]:
    """The file's tensors, read one at a time as they are sent, and their bytes in all.

    The header (8 bytes of length, then JSON naming each tensor's dtype, shape and byte range) is
    read and checked now, before anything is sent; no torch or safetensors needed.
    """
    size = path.stat().st_size  # FileNotFoundError for a missing file
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if not 2 <= length <= min(size - 8, 100 * 1024 * 1024):  # safetensors' own header bound
            raise ValueError(f"{path}: not a safetensors file (a header of {length} bytes)")
        try:
            header = json.loads(file.read(length))
        except ValueError as err:
            raise ValueError(f"{path}: not a safetensors file ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has no dtype this service takes")
        begin, end = entry["data_offsets"]
        entries.append((name, _SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + begin,
                        end - begin))
    entries.sort()  # by name, the order safetensors lists them in
    return _read_tensors(path, entries), sum(e[4] for e in entries)


def _read_tensors(path: Path, entries: list[tuple[str, str, tuple[int, ...], int, int]]) -> Iterator[TensorBytes]:
    with path.open("rb") as file:
        for name, dtype, shape, offset, size in entries:
            file.seek(offset)
            yield name, dtype, shape, file.read(size)


def push_requests(weights: Weights, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  on_progress: ProgressCallback | None = None) -> Iterator[bytes]:
    """The PushWeights stream of ``weights``, each ``PushWeightsRequest`` serialized: the tensors'
    chunks in order, packed into messages of at most ``chunk_bytes`` of data (a large tensor over
    several, small ones together), then the commit with their sha256.

    Bad arguments raise here, before anything is sent; the tensors are read as the stream is
    consumed. ``on_progress(bytes_sent, total_bytes)`` is called once a message has been handed on.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, not {chunk_bytes}")
    if isinstance(weights, str | Path):
        tensors, total = _safetensors_file(Path(weights))
    else:
        tensors, total = _state_dict(weights)
    return _requests(push_messages(tensors, chunk_bytes), total, on_progress)


def _requests(messages: Iterable[tuple[bytes, int | None]], total: int,
              on_progress: ProgressCallback | None) -> Iterator[bytes]:
    sent = 0
    for message, data_bytes in messages:
        yield message
        if data_bytes is not None:  # a chunk, not the commit
            sent += data_bytes
            if on_progress is not None:
                on_progress(sent, total)
