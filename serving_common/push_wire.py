"""One serialized message of a PushWeights stream read as it came off the wire, and written, without
protobuf.

The clients write each message around its chunks' data with one copy (``PackedMessage``): protobuf
would copy the data into the chunk, the chunk into the request and both into the serialized bytes,
which for a model of gigabytes is seconds of the sender's CPU. A message carries one chunk
(``chunk``) or several (``chunks``: a model's small tensors packed together, since every hop pays
per message far more than a small tensor's bytes cost). The bytes are protobuf's own
canonical encoding of the same message (fields in number order, empty ones left out, ``shape``
packed). The worker relays the client's messages to the runners byte for byte, and both check them, so
neither needs protobuf's copy of a chunk's data (a parse copies it, and each read of ``chunk.data``
copies it again): a chunk's data here is a view of the message received. The reading follows
protobuf's rules for the two messages (``PushWeightsRequest`` and ``RunnerServicePushWeightsRequest``
have the same wire form): fields in any order, unknown fields skipped, a field given twice takes its
last value (a repeated one adds up, as ``shape`` does packed or not), a message field given twice
merges, and of the ``oneof`` the last one given is the part.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from serving_common.errors import ServiceError, invalid_argument

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_EMPTY = memoryview(b"")
# What one message may hold, counted as it is read: a message's bytes (64 MiB) could otherwise hold
# millions of empty fields, dimensions or chunks, each an object here (100 times its bytes).
MAX_FIELDS = 64  # of a request, a TensorChunk (its shape's dimensions included) or a commit
MAX_PACKED_CHUNKS = 1024  # in one message's TensorChunks: the writers pack at most this many


@dataclass(frozen=True)
class Chunk:
    """A ``TensorChunk``; ``data`` is a view into the message it came in."""

    name: str = ""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0
    data: memoryview = _EMPTY


@dataclass(frozen=True)
class Commit:
    """A ``PushWeightsCommit``."""

    sha256: str = ""


class PackedMessage:
    """The serialized ``PushWeightsRequest`` of the chunks added, in order, sized as it grows: one
    chunk alone is its ``chunk`` (what every reader takes), several its ``chunks``. Each chunk's data
    is copied once, into the message."""

    def __init__(self) -> None:
        self._parts: list[bytes | memoryview] = []
        self.size = 0  # the ``TensorChunk`` entries' bytes, data included
        self.data_bytes = 0
        self.count = 0

    def add(self, name: str, dtype: str, shape: Sequence[int], offset: int, data: bytes | memoryview) -> None:
        head = b"".join((_text_field(1, name), _text_field(2, dtype),
                         _len_field(3, b"".join(map(_encode_varint, shape))) if shape else b"",
                         _key(4, _VARINT) + _encode_varint(offset) if offset else b"",
                         _key(5, _LEN) + _encode_varint(len(data)) if len(data) else b""))
        # A TensorChunk is field 1 of PushWeightsRequest and of TensorChunks alike: one entry serves both.
        entry = (_key(1, _LEN) + _encode_varint(len(head) + len(data)), head, data)
        self._parts.extend(entry)
        self.size += sum(map(len, entry))
        self.data_bytes += len(data)
        self.count += 1

    def message(self) -> bytes:
        if self.count == 1:
            return b"".join(self._parts)
        return b"".join((_key(3, _LEN), _encode_varint(self.size), *self._parts))


def commit_message(sha256: str) -> bytes:
    """The serialized ``PushWeightsRequest`` carrying the ``PushWeightsCommit`` of ``sha256``."""
    return _len_field(2, _text_field(1, sha256))


def _key(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _len_field(number: int, value: bytes) -> bytes:
    return _key(number, _LEN) + _encode_varint(len(value)) + value


def _text_field(number: int, text: str) -> bytes:
    return _len_field(number, text.encode()) if text else b""


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_part(message: bytes) -> list[Chunk] | Commit:
    """The chunks (one, or the ``chunks`` packed) or the commit one serialized message carries (a
    message with none reads as one empty chunk, as protobuf would); INVALID_ARGUMENT when it is not
    such a message."""
    view = memoryview(message)
    kind, spans = 0, list[memoryview]()  # the oneof's field number given last, and its message's spans
    for number, wire, span, _ in _fields(view, MAX_FIELDS):
        if number in (1, 2, 3) and wire == _LEN:
            if number != kind:
                kind, spans = number, []
            spans.append(span)
    if kind == 2:
        return _commit(spans)
    if kind == 3:  # TensorChunks given twice merge: their chunks add up, each one a chunk of its own
        chunks: list[Chunk] = []
        for span in spans:
            chunks.extend(_chunk([value]) for number, wire, value, _ in _fields(span, MAX_PACKED_CHUNKS - len(chunks))
                          if number == 1 and wire == _LEN)
        return chunks
    return [_chunk(spans)]


def _chunk(spans: list[memoryview]) -> Chunk:
    name, dtype, offset, data = "", "", 0, _EMPTY
    shape: list[int] = []
    for span in spans:  # a message field given twice: its parts merge
        for number, wire, value, integer in _fields(span, MAX_FIELDS - len(shape)):
            if number == 1 and wire == _LEN:
                name = _text(value, "chunk.name")
            elif number == 2 and wire == _LEN:
                dtype = _text(value, "chunk.dtype")
            elif number == 3 and wire == _VARINT:
                shape.append(integer)
            elif number == 3 and wire == _LEN:
                shape.extend(_packed(value, MAX_FIELDS - len(shape)))
            elif number == 4 and wire == _VARINT:
                offset = integer
            elif number == 5 and wire == _LEN:
                data = value
    return Chunk(name, dtype, tuple(shape), offset, data)


def _commit(spans: list[memoryview]) -> Commit:
    sha256 = ""
    for span in spans:
        for number, wire, value, _ in _fields(span, MAX_FIELDS):
            if number == 1 and wire == _LEN:
                sha256 = _text(value, "commit.sha256")
    return Commit(sha256)


def _fields(view: memoryview, most: int) -> Iterator[tuple[int, int, memoryview, int]]:
    """Each field of a message as (number, wire type, bytes, integer): the bytes' view of a
    length-delimited or fixed-width field (empty for a varint), the integer of a varint (0 otherwise);
    INVALID_ARGUMENT past ``most`` fields, before reading the next."""
    position, end = 0, len(view)
    while position < end:
        if most <= 0:
            raise _malformed("more fields than a message of the stream may hold")
        most -= 1
        key, position = _varint(view, position)
        number, wire = key >> 3, key & 7
        value, integer = _EMPTY, 0
        if number == 0:
            raise _malformed("a field numbered 0")
        if wire == _VARINT:
            integer, position = _varint(view, position)
        elif wire == _LEN:
            length, position = _varint(view, position)
            if length > end - position:
                raise _malformed("a field longer than the message")
            value, position = view[position:position + length], position + length
        elif wire in (_I64, _I32):
            width = 8 if wire == _I64 else 4
            if width > end - position:
                raise _malformed("a field longer than the message")
            value, position = view[position:position + width], position + width
        else:
            raise _malformed(f"wire type {wire}")
        yield number, wire, value, integer


def _varint(view: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    for index in range(position, min(position + 10, len(view))):
        byte = view[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, index + 1
        shift += 7
    raise _malformed("a truncated or overlong varint")


def _packed(view: memoryview, most: int) -> list[int]:
    values: list[int] = []
    position = 0
    while position < len(view):
        if len(values) >= most:
            raise _malformed("more fields than a message of the stream may hold")
        value, position = _varint(view, position)
        values.append(value)
    return values


def _text(view: memoryview, name: str) -> str:
    try:
        return str(view, "utf-8")
    except UnicodeDecodeError:
        raise invalid_argument({name: "is not UTF-8"}, f"{name} is not UTF-8; nothing applied") from None


def _malformed(why: str) -> ServiceError:
    return invalid_argument({"request": f"not a PushWeights message ({why})"},
                            f"request: not a PushWeights message ({why}); nothing applied")
