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
from serving_common.errors import failed_precondition, invalid_argument
from serving_common.tensor_stream import Allowance, ChunkChecker, TensorHeader, check_commit, content_digest

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
    checker = ChunkChecker(Allowance(max_bytes), "the runner's --max-weights-bytes")
    chunks: dict[str, list[bytes]] = {}
    declared = None
    async for request in requests:
        if declared is not None:
            raise invalid_argument({"commit": "must be the last message"})
        if request.HasField("commit"):
            declared = request.commit.sha256
            continue
        chunk = request.chunk
        started = checker.add(chunk)
        if started is not None:
            chunks[started.name] = []
        chunks[chunk.name].append(chunk.data)
    if declared is None:
        raise failed_precondition("the stream ended without its commit; nothing applied")
    checker.finish()
    tensors, digest = await asyncio.to_thread(_assemble, checker.headers, chunks, declared)
    return tensors, digest, checker.received_bytes
