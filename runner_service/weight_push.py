"""PushWeights on the runner: tensor chunks kept as they arrive (each tensor's declared size claimed
from the budget first, nothing allocated for it ahead of its data), then, once the commit arrives,
hashed and assembled into tensors off the event loop, and handed over only if the commit's sha256
matches what arrived."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from diffusion.v1 import runner_pb2
from runner_service.loaded_model import TORCH_DTYPES
from serving_common.tensor_stream import (
    Allowance,
    ChunkChecker,
    PushReader,
    TensorHeader,
    check_commit,
    content_digest,
)

# The dtypes a pushed tensor may have, beyond the model dtypes.
PUSH_DTYPES: dict[str, torch.dtype] = {
    **TORCH_DTYPES, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


def _tensor(header: TensorHeader, chunks: list[bytes]) -> torch.Tensor:
    if not header.nbytes:
        return torch.empty(header.shape, dtype=PUSH_DTYPES[header.dtype])
    return torch.frombuffer(bytearray().join(chunks), dtype=PUSH_DTYPES[header.dtype]).reshape(header.shape)


def _assemble(headers: list[TensorHeader], chunks: dict[str, list[bytes]],
              declared: str) -> tuple[dict[str, torch.Tensor], str]:
    """Checks the commit, then joins each tensor's chunks (dropping them as it goes: at most one
    tensor is held twice)."""
    digest = content_digest((header, chunks[header.name]) for header in headers)
    check_commit(declared, digest)
    return {header.name: _tensor(header, chunks.pop(header.name)) for header in headers}, digest


async def receive_push(requests: AsyncIterator[runner_pb2.RunnerServicePushWeightsRequest],
                       max_bytes: int) -> tuple[dict[str, torch.Tensor], str, int]:
    """The tensors of a PushWeights stream, its digest and its bytes. Raises, with nothing to apply,
    on a malformed chunk, tensors declaring more than ``max_bytes`` in all, a stream that ends
    without its commit, or a commit whose sha256 is not the content's."""
    reader = PushReader(ChunkChecker(Allowance(max_bytes), "the runner's --max-weights-bytes"))
    chunks: dict[str, list[bytes]] = {}
    async for request, started in reader.chunks(requests):
        if started is not None:
            chunks[started.name] = []
        chunks[request.chunk.name].append(request.chunk.data)
    tensors, digest = await asyncio.to_thread(_assemble, reader.checker.headers, chunks, reader.declared)
    return tensors, digest, reader.checker.received_bytes
