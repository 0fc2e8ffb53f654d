"""PushWeights on the runner: each tensor's bytes copied, as its chunks arrive, into one buffer of
its declared size (claimed from the budget first; allocated uninitialised, so a declaration whose
data never comes commits no memory) and hashed in order, both on a thread of the push's own off the
event loop while the next chunks arrive; at the commit the tensors are handed over only if the
commit's sha256 matches what arrived."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

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
# Chunks received but not yet copied and hashed are handed over in batches of at least this many
# bytes (or the stream's last), and the stream waits beyond MAX_PENDING_BATCHES of them: however
# slow hashing is, a push holds at most MAX_PENDING_BATCHES + 3 batches (queued, being hashed,
# being put, being filled), each under BATCH_BYTES plus one message.
BATCH_BYTES = 1024 * 1024
MAX_PENDING_BATCHES = 8
# A chunk's copy and hash: the preamble of the tensor it starts (empty for a later chunk), the
# tensor's buffer, the chunk's offset in it, the chunk's bytes.
_Job = tuple[bytes, np.ndarray, int, memoryview]


class _Assembly:
    """The tensors of one push as their bytes arrive, and the digest over them, in the stream's order.
    One thread of the push's own copies and hashes the chunks in the order queued (the digest sees
    the bytes in order) while the event loop reads the next ones. The event loop hands chunks over
    in batches of about a MiB: a hand-off between threads costs more than copying a small tensor's
    chunk, and a model has hundreds of those."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self._views: dict[str, np.ndarray] = {}
        self._digest = hashlib.sha256()
        self._jobs: queue.Queue[list[_Job] | None] = queue.Queue(MAX_PENDING_BATCHES)
        self._batch: list[_Job] = []
        self._batch_bytes = 0
        self._digested: Future[str] = Future()
        self._closed = False
        threading.Thread(target=self._run, name="push", daemon=True).start()

    async def add(self, chunk: Chunk, started: TensorHeader | None) -> None:
        """Queues ``chunk``; ``started`` is the header of the tensor it starts (None for a later chunk)."""
        preamble = b""
        if started is not None:
            buffer = torch.empty(started.nbytes, dtype=torch.uint8)
            self.buffers[started.name], self._views[started.name] = buffer, buffer.numpy()
            preamble = tensor_preamble(started.name, started.dtype, started.shape)
        self._batch.append((preamble, self._views[chunk.name], chunk.offset, chunk.data))
        self._batch_bytes += len(chunk.data)
        if self._batch_bytes >= BATCH_BYTES:
            await self._put(self._batch)
            self._batch, self._batch_bytes = [], 0

    async def hexdigest(self) -> str:
        """The digest once every chunk queued has been copied and hashed."""
        await self._put(self._batch)
        await self._put(None)
        return await asyncio.wrap_future(self._digested)

    def close(self) -> None:
        """The thread ends after the job it runs; jobs not begun are dropped."""
        self._closed = True
        with contextlib.suppress(queue.Full):  # full: the thread is busy, and sees _closed at its next job
            self._jobs.put_nowait(None)

    async def _put(self, batch: list[_Job] | None) -> None:
        try:
            self._jobs.put_nowait(batch)
        except queue.Full:  # hashing is slower than the stream: the stream waits
            await asyncio.to_thread(self._jobs.put, batch)

    def _run(self) -> None:
        failure: BaseException | None = None
        while (batch := self._jobs.get()) is not None and not self._closed:
            if failure is None:  # after a failure the queue is still drained, so no put waits forever
                try:
                    for job in batch:
                        self._copy(*job)
                except Exception as error:  # noqa: BLE001 - handed to the awaiting push
                    failure = error
        if failure is not None:
            self._digested.set_exception(failure)
        else:
            self._digested.set_result(self._digest.hexdigest())

    def _copy(self, preamble: bytes, view: np.ndarray, offset: int, data: memoryview) -> None:
        if preamble:
            self._digest.update(preamble)
        view[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._digest.update(data)  # hashlib lets go of the GIL for a chunk this size


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
        async for _, chunks in reader.chunks(messages):
            for chunk, started in chunks:
                await assembly.add(chunk, started)
        digest = await assembly.hexdigest()
    finally:
        assembly.close()
    check_commit(reader.declared, digest)
    tensors = {header.name: _tensor(header, assembly.buffers[header.name]) for header in reader.checker.headers}
    return tensors, digest, reader.checker.received_bytes
