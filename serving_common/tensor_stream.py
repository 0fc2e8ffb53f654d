"""The PushWeights stream: tensor chunks, then one commit. Its rules and its digest, checked the same
way by the worker (which relays it) and the runner (which applies it).

A tensor's first chunk names it and carries its dtype and shape; its next chunks repeat the name
and carry only data, at the offset where the previous one ended, until the tensor's bytes are
complete; then the next tensor starts. The digest is sha256 over, for each tensor in order, its
name, dtype and shape (dimensions joined by "x"), each followed by a 0 byte, then its bytes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from diffusion.v1 import common_pb2
from serving_common.errors import ServiceError, failed_precondition, invalid_argument

# Bytes per element of the dtypes a pushed tensor may have (torch's names).
ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
              "int8": 1, "uint8": 1, "bool": 1}
MAX_NAME_CHARS = 512
MAX_DIMENSIONS = 8


def tensor_preamble(name: str, dtype: str, shape: list[int] | tuple[int, ...]) -> bytes:
    """What the digest hashes before a tensor's bytes."""
    return b"".join((name.encode(), b"\0", dtype.encode(), b"\0", "x".join(map(str, shape)).encode(), b"\0"))


# Data per chunk by default: well under gRPC's 4 MiB message limit.
DEFAULT_CHUNK_BYTES = 1024 * 1024
TensorBytes = tuple[str, str, tuple[int, ...], bytes | memoryview]  # name, dtype, shape, raw bytes


def stream_parts(tensors: Iterable[TensorBytes], chunk_bytes: int = DEFAULT_CHUNK_BYTES
                 ) -> Iterator[common_pb2.TensorChunk | common_pb2.PushWeightsCommit]:
    """The chunks of ``tensors`` in order, then the commit with their digest."""
    digest = hashlib.sha256()
    for name, dtype, shape, data in tensors:
        view = memoryview(data).cast("B")
        digest.update(tensor_preamble(name, dtype, shape))
        digest.update(view)
        for offset in range(0, max(len(view), 1), chunk_bytes):
            first = offset == 0
            yield common_pb2.TensorChunk(name=name, dtype=dtype if first else "", shape=shape if first else (),
                                         offset=offset, data=bytes(view[offset:offset + chunk_bytes]))
    yield common_pb2.PushWeightsCommit(sha256=digest.hexdigest())


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class ChunkChecker:
    """Checks a stream's chunks in order, keeps its digest, and bounds its bytes by ``max_bytes``
    (``limit_name`` says which setting, in the RESOURCE_EXHAUSTED it raises)."""

    max_bytes: int
    limit_name: str
    received_bytes: int = 0
    headers: list[TensorHeader] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)
    _done: int = 0  # bytes of the current tensor received
    _digest: hashlib._Hash = field(default_factory=hashlib.sha256)

    @property
    def current(self) -> TensorHeader | None:
        return self.headers[-1] if self.headers else None

    def add(self, chunk: common_pb2.TensorChunk) -> TensorHeader | None:
        """Checks one chunk; returns the header when it starts a new tensor."""
        started = None
        current = self.current
        if current is None or (self._done == current.nbytes and chunk.name != current.name):
            if current is not None and self._done < current.nbytes:
                raise self._bad("chunk.name", f"tensor {current.name!r} is incomplete")
            started = self._start(chunk)
            current = started
        elif chunk.name != current.name:
            raise self._bad("chunk.name", f"tensor {current.name!r} is incomplete: {self._done} of "
                                          f"{current.nbytes} bytes, then a chunk of {chunk.name[:64]!r}")
        elif chunk.dtype or chunk.shape:
            raise self._bad("chunk", f"only the first chunk of {current.name!r} may carry dtype and shape")
        if chunk.offset != self._done:
            raise self._bad("chunk.offset", f"{chunk.offset} for {current.name!r}; expected {self._done}")
        if self._done + len(chunk.data) > current.nbytes:
            raise self._bad("chunk.data", f"more than the {current.nbytes} bytes of {current.name!r}")
        self.received_bytes += len(chunk.data)
        if self.received_bytes > self.max_bytes:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the push holds more than {self.max_bytes} bytes ({self.limit_name}); nothing applied")
        self._done += len(chunk.data)
        self._digest.update(chunk.data)
        return started

    def _start(self, chunk: common_pb2.TensorChunk) -> TensorHeader:
        name = chunk.name
        if not name or len(name) > MAX_NAME_CHARS or "." not in name:
            raise self._bad("chunk.name", f"must be '<component>.<parameter>', at most {MAX_NAME_CHARS} characters")
        if name in self._names:
            raise self._bad("chunk.name", f"tensor {name!r} is sent twice")
        if chunk.dtype not in ITEM_BYTES:
            raise self._bad("chunk.dtype", f"{chunk.dtype[:32]!r} for {name!r}; use one of {sorted(ITEM_BYTES)}")
        if len(chunk.shape) > MAX_DIMENSIONS:
            raise self._bad("chunk.shape", f"more than {MAX_DIMENSIONS} dimensions for {name!r}")
        shape = tuple(int(d) for d in chunk.shape)
        header = TensorHeader(name, chunk.dtype, shape, math.prod(shape) * ITEM_BYTES[chunk.dtype])
        self._names.add(name)
        self.headers.append(header)
        self._done = 0
        self._digest.update(tensor_preamble(name, chunk.dtype, shape))
        return header

    def finish(self, declared_sha256: str) -> str:
        """At the commit: the last tensor is complete and the declared digest is the content's."""
        current = self.current
        if current is not None and self._done < current.nbytes:
            raise self._bad("chunk", f"tensor {current.name!r} is incomplete: {self._done} of {current.nbytes} bytes")
        digest = self._digest.hexdigest()
        if declared_sha256.lower() != digest:
            raise failed_precondition(f"the commit's sha256 {declared_sha256[:12]!r} is not the content's "
                                      f"({digest[:12]}); nothing applied")
        return digest

    @staticmethod
    def _bad(name: str, why: str) -> ServiceError:
        return invalid_argument({name: why}, f"{name}: {why}; nothing applied")
