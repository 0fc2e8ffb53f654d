"""PushWeights on the runner: each tensor's bytes copied, as its chunks arrive, into one buffer of
its declared size (claimed from the budget first; allocated uninitialised, so a declaration whose
data never comes commits no memory) and hashed in order, both on a thread of the push's own off the
event loop while the next chunks arrive; at the commit the tensors are handed over only if the
commit's sha256 matches what arrived."""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from runner_service.loaded_model import TORCH_DTYPES
from serving_common.push_wire import Chunk
from serving_common.tensor_stream import (
    Allowance,
    ChunkChecker,
    PushReader,
    TensorHeader,
    check_commit,
    tensor_preamble,
)

# The dtypes a pushed tensor may have, beyond the model dtypes.
PUSH_DTYPES: dict[str, torch.dtype] = {
    **TORCH_DTYPES, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
# Chunks received but not yet copied and hashed: the stream waits beyond these, so the chunks held
# stay bounded when hashing is slower than the network.
MAX_PENDING_CHUNKS = 8


class _Assembly:
    """The tensors of one push as their bytes arrive, and the digest over them, in the stream's order.
    Every copy and hash runs on one thread, in the order asked: the digest sees the bytes in order."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self._views: dict[str, np.ndarray] = {}
        self._digest = hashlib.sha256()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="push")
        self._pending: deque[asyncio.Future[object]] = deque()

    async def start(self, header: TensorHeader) -> None:
        buffer = torch.empty(header.nbytes, dtype=torch.uint8)
        self.buffers[header.name], self._views[header.name] = buffer, buffer.numpy()
        await self._queue(self._digest.update, tensor_preamble(header.name, header.dtype, header.shape))

    async def add(self, chunk: Chunk) -> None:
        await self._queue(self._copy, self._views[chunk.name], chunk.offset, chunk.data)

    def _copy(self, view: np.ndarray, offset: int, data: memoryview) -> None:
        view[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._digest.update(data)  # hashlib lets go of the GIL for a chunk this size

    async def _queue(self, job: Callable[..., object], *args: object) -> None:
        self._pending.append(asyncio.get_running_loop().run_in_executor(self._thread, job, *args))
        if len(self._pending) > MAX_PENDING_CHUNKS:
            await self._pending.popleft()

    async def hexdigest(self) -> str:
        """The digest once every chunk queued has been copied and hashed."""
        while self._pending:
            await self._pending.popleft()
        return self._digest.hexdigest()

    def close(self) -> None:
        """The thread ends once the job it runs is done; jobs not begun are dropped."""
        self._thread.shutdown(wait=False, cancel_futures=True)


def _tensor(header: TensorHeader, buffer: torch.Tensor) -> torch.Tensor:
    return buffer.view(PUSH_DTYPES[header.dtype]).reshape(header.shape)


async def receive_push(messages: AsyncIterator[bytes], max_bytes: int) -> tuple[dict[str, torch.Tensor], str, int]:
    """The tensors of a PushWeights stream (serialized ``RunnerServicePushWeightsRequest`` messages, as
    received), its digest and its bytes. Raises, with nothing to apply,
    on a malformed chunk, tensors declaring more than ``max_bytes`` in all, a stream that ends
    without its commit, or a commit whose sha256 is not the content's."""
    reader = PushReader(ChunkChecker(Allowance(max_bytes), "the runner's --max-weights-bytes"))
    assembly = _Assembly()
    try:
        async for _, chunk, started in reader.chunks(messages):
            if started is not None:
                await assembly.start(started)
            await assembly.add(chunk)
        digest = await assembly.hexdigest()
    finally:
        assembly.close()
    check_commit(reader.declared, digest)
    tensors = {header.name: _tensor(header, assembly.buffers[header.name]) for header in reader.checker.headers}
    return tensors, digest, reader.checker.received_bytes
