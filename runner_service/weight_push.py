"""PushWeights on the runner: tensor chunks assembled in host memory while they arrive, checked
chunk by chunk, and handed over only once the commit's sha256 matches what arrived."""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from diffusion.v1 import runner_pb2
from runner_service.loaded_model import TORCH_DTYPES
from serving_common.errors import failed_precondition, invalid_argument
from serving_common.tensor_stream import ChunkChecker, TensorHeader

# The dtypes a pushed tensor may have, beyond the model dtypes.
PUSH_DTYPES: dict[str, torch.dtype] = {
    **TORCH_DTYPES, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


def _tensor(header: TensorHeader, data: bytearray) -> torch.Tensor:
    if not header.nbytes:
        return torch.empty(header.shape, dtype=PUSH_DTYPES[header.dtype])
    return torch.frombuffer(data, dtype=PUSH_DTYPES[header.dtype]).reshape(header.shape)


async def receive_push(requests: AsyncIterator[runner_pb2.RunnerServicePushWeightsRequest],
                       max_bytes: int) -> tuple[dict[str, torch.Tensor], str, int]:
    """The tensors of a PushWeights stream, its digest and its bytes. Raises, with nothing to apply,
    on a malformed chunk, more than ``max_bytes``, a stream that ends without its commit, or a
    commit whose sha256 is not the content's."""
    checker = ChunkChecker(max_bytes, "the runner's --max-weights-bytes")
    buffers: dict[str, bytearray] = {}
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
            buffers[started.name] = bytearray(started.nbytes)
        buffers[chunk.name][chunk.offset:chunk.offset + len(chunk.data)] = chunk.data
    if declared is None:
        raise failed_precondition("the stream ended without its commit; nothing applied")
    digest = checker.finish(declared)
    tensors = {header.name: _tensor(header, buffers.pop(header.name)) for header in checker.headers}
    return tensors, digest, checker.received_bytes
