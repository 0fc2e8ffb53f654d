"""What the sync and asyncio clients send for PushWeights: a state dict or a .safetensors file as the
stream's requests. The chunking and the digest are ``serving_common.tensor_stream``'s, the ones the
worker checks.

torch and safetensors are imported only when weights are pushed: the clients need neither otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.tensor_stream import DEFAULT_CHUNK_BYTES, TensorBytes, stream_parts

if TYPE_CHECKING:
    import torch

# A state dict named "<component>.<parameter>", or the path of a .safetensors file named so.
Weights = Mapping[str, "torch.Tensor"] | str | Path
# on_progress(bytes_sent, total_bytes), after each chunk.
ProgressCallback = Callable[[int, int], None]


def raw_tensor(name: str, tensor: torch.Tensor) -> TensorBytes:
    """A tensor as the stream carries it: torch's dtype name, its shape and its row-major bytes.

    The bytes are viewed as uint8 in torch before numpy sees them: numpy has no bfloat16.
    """
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), flat.view(torch.uint8).numpy().data


def _state_dict(weights: Mapping[str, torch.Tensor]) -> tuple[Iterator[TensorBytes], int]:
    import torch

    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights[{name!r}] is a {type(tensor).__name__}, not a torch.Tensor")
    total = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    return (raw_tensor(name, tensor) for name, tensor in weights.items()), total


def _safetensors_file(path: Path) -> tuple[Iterator[TensorBytes], int]:
    """The file's tensors, read one at a time as they are sent, and their bytes in all.

    The header is checked now, before anything is sent. The format leaves no gap between tensors,
    so their bytes are the file less its header (8 bytes of length, then the JSON).
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            names = list(file.keys())
    except SafetensorError as err:
        raise ValueError(f"{path}: {err}") from None
    with path.open("rb") as file:
        header_bytes = int.from_bytes(file.read(8), "little")
    return _read_tensors(path, names), path.stat().st_size - 8 - header_bytes


def _read_tensors(path: Path, names: list[str]) -> Iterator[TensorBytes]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        for name in names:
            yield raw_tensor(name, file.get_tensor(name))


def push_requests(weights: Weights, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  on_progress: ProgressCallback | None = None) -> Iterator[worker_pb2.PushWeightsRequest]:
    """The PushWeights stream of ``weights``: each tensor's chunks of at most ``chunk_bytes``, in order,
    then the commit with their sha256.

    Bad arguments raise here, before anything is sent; the tensors are read as the stream is
    consumed. ``on_progress(bytes_sent, total_bytes)`` is called once a chunk has been handed on.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, not {chunk_bytes}")
    if isinstance(weights, str | Path):
        tensors, total = _safetensors_file(Path(weights))
    else:
        tensors, total = _state_dict(weights)
    return _requests(stream_parts(tensors, chunk_bytes), total, on_progress)


def _requests(parts: Iterable[common_pb2.TensorChunk | common_pb2.PushWeightsCommit], total: int,
              on_progress: ProgressCallback | None) -> Iterator[worker_pb2.PushWeightsRequest]:
    sent = 0
    for part in parts:
        if isinstance(part, common_pb2.PushWeightsCommit):
            yield worker_pb2.PushWeightsRequest(commit=part)
        else:
            yield worker_pb2.PushWeightsRequest(chunk=part)
            sent += len(part.data)
            if on_progress is not None:
                on_progress(sent, total)
