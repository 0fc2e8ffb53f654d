"""The PushWeights stream: tensor chunks, then one commit. Its rules, checked the same way by the
worker (which relays each message as received) and the runner (which applies it), and its digest,
which only the runner computes, as the chunks arrive (the worker relays the client's commit).

A tensor's first chunk names it and carries its dtype and shape; its next chunks repeat the name
and carry only data, at the offset where the previous one ended, until the tensor's bytes are
complete; then the next tensor starts. The digest is sha256 over, for each tensor in order, its
name, dtype and shape (dimensions joined by "x"), each followed by a 0 byte, then its bytes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc

from serving_common.errors import ServiceError, failed_precondition, invalid_argument
from serving_common.push_wire import MAX_PACKED_CHUNKS, Chunk, Commit, PackedMessage, commit_message, read_part

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


def push_messages(tensors: Iterable[TensorBytes], chunk_bytes: int = DEFAULT_CHUNK_BYTES
                  ) -> Iterator[tuple[bytes, int | None]]:
    """The serialized ``PushWeightsRequest`` messages of ``tensors`` (the runner's request has the
    same wire form): their chunks in order, packed into messages of about ``chunk_bytes`` (a large
    tensor split over several, small ones together in one, at most ``MAX_PACKED_CHUNKS``: at most
    one chunk's header over), then
    the commit with their digest; each with the tensor bytes it carries (None for the commit)."""
    digest = hashlib.sha256()
    packed = PackedMessage()
    for name, dtype, shape, data in tensors:
        view = memoryview(data).cast("B")
        digest.update(tensor_preamble(name, dtype, shape))
        digest.update(view)
        offset = 0
        while True:
            if packed.size >= chunk_bytes or packed.count == MAX_PACKED_CHUNKS:
                yield packed.message(), packed.data_bytes
                packed = PackedMessage()
            part = view[offset:offset + chunk_bytes - packed.size]
            first = offset == 0
            packed.add(name, dtype if first else "", shape if first else (), offset, part)
            offset += len(part)
            if offset == len(view):
                break
    if packed.count:
        yield packed.message(), packed.data_bytes
    yield commit_message(digest.hexdigest()), None


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def check_commit(declared_sha256: str, digest: str) -> None:
    """The commit's sha256 is the content's ``digest``, or nothing is applied."""
    if declared_sha256.lower() != digest:
        raise failed_precondition(f"the commit's sha256 {declared_sha256[:12]!r} is not the content's "
                                  f"({digest[:12]}); nothing applied")


class Budget(Protocol):
    """The bytes a stream's tensors may still declare."""

    def left(self) -> int: ...

    def reserve(self, nbytes: int) -> bool:
        """Claims ``nbytes`` for one tensor; False, claiming nothing, when they do not fit."""
        ...


class Allowance:
    """A budget of its own: ``max_bytes`` for the whole stream."""

    def __init__(self, max_bytes: int) -> None:
        self._left = max_bytes

    def left(self) -> int:
        return self._left

    def reserve(self, nbytes: int) -> bool:
        if nbytes > self._left:
            return False
        self._left -= nbytes
        return True


@dataclass
class ChunkChecker:
    """Checks a stream's chunks in order. Each tensor's declared size is claimed from ``budget`` when
    its first chunk arrives, before any of its bytes are held: one that does not fit is
    RESOURCE_EXHAUSTED, naming the tensor and ``limit_name`` (the setting that bounds it)."""

    budget: Budget
    limit_name: str
    received_bytes: int = 0
    headers: list[TensorHeader] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)
    _done: int = 0  # bytes of the current tensor received

    @property
    def current(self) -> TensorHeader | None:
        return self.headers[-1] if self.headers else None

    def add(self, chunk: Chunk) -> TensorHeader | None:
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
        self._done += len(chunk.data)
        return started

    def _start(self, chunk: Chunk) -> TensorHeader:
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
        left = self.budget.left()
        if not self.budget.reserve(header.nbytes):
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"tensor {name!r} declares {header.nbytes} bytes; the push has {left} left "
                               f"({self.limit_name}); nothing applied")
        self._names.add(name)
        self.headers.append(header)
        self._done = 0
        return header

    def finish(self) -> None:
        """At the commit: the last tensor is complete."""
        current = self.current
        if current is not None and self._done < current.nbytes:
            raise self._bad("chunk", f"tensor {current.name!r} is incomplete: {self._done} of {current.nbytes} bytes")

    @staticmethod
    def _bad(name: str, why: str) -> ServiceError:
        return invalid_argument({name: why}, f"{name}: {why}; nothing applied")


class PushReader:
    """Reads a PushWeights stream of serialized messages (``push_wire``): each chunk checked in order
    (``checker``), then the commit, which must come last; ``declared`` is the commit's sha256 once
    the stream has ended with it."""

    def __init__(self, checker: ChunkChecker) -> None:
        self.checker = checker
        self.declared = ""

    async def chunks(self, messages: AsyncIterator[bytes]
                     ) -> AsyncIterator[tuple[bytes, list[tuple[Chunk, TensorHeader | None]]]]:
        """Each message of chunks as received, with its chunks, each checked (its data a view of the
        message) beside the header of the tensor it starts (None for a later chunk of one); raises,
        after the last, when the stream did not end with its commit or a tensor is incomplete."""
        committed = False
        async for message in messages:
            if committed:
                raise invalid_argument({"commit": "must be the last message"})
            part = read_part(message)
            if isinstance(part, Commit):
                committed, self.declared = True, part.sha256
                continue
            yield message, [(chunk, self.checker.add(chunk)) for chunk in part]
        if not committed:
            raise failed_precondition("the stream ended without its commit; nothing applied")
        self.checker.finish()


class Replacing(Protocol):
    """A weight update, by the tensor names it set."""

    @property
    def names(self) -> Collection[str]: ...


U = TypeVar("U", bound=Replacing)


def still_needed(updates: Sequence[U]) -> list[U]:
    """``updates`` (in the order applied) less those whose every tensor a later one sets again: what a
    model loaded afresh needs to end up the same. The worker and the runner both keep this list, so
    they agree on it; an update whose names are unknown (empty) is kept."""
    later: set[str] = set()
    kept: list[U] = []
    for update in reversed(updates):
        if not update.names or not later.issuperset(update.names):
            kept.append(update)
        later.update(update.names)
    return kept[::-1]
