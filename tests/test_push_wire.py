"""The PushWeights messages read without protobuf agree with protobuf's own reading, and those
written without it are protobuf's own bytes."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import grpc
import pytest

from diffusion.v1 import common_pb2, worker_pb2
from serving_common import push_wire
from serving_common.errors import ServiceError
from serving_common.push_wire import Chunk, Commit, read_part
from serving_common.tensor_stream import Allowance, ChunkChecker, PushReader, push_messages, tensor_preamble

W = worker_pb2
pytestmark = pytest.mark.unit


def as_protobuf_reads(message: bytes) -> list[Chunk] | Commit:
    parsed = W.PushWeightsRequest.FromString(message)
    if parsed.HasField("commit"):
        return Commit(parsed.commit.sha256)
    chunks = parsed.chunks.chunks if parsed.HasField("chunks") else [parsed.chunk]
    return [Chunk(chunk.name, chunk.dtype, tuple(chunk.shape), chunk.offset, memoryview(chunk.data))
            for chunk in chunks]


def chunk_message(**fields: object) -> bytes:
    return W.PushWeightsRequest(chunk=common_pb2.TensorChunk(**fields)).SerializeToString()  # type: ignore[arg-type]


def chunks_message(*chunks: dict[str, object]) -> bytes:
    return W.PushWeightsRequest(chunks=common_pb2.TensorChunks(
        chunks=[common_pb2.TensorChunk(**fields) for fields in chunks])).SerializeToString()  # type: ignore[arg-type]


def written(*chunks: dict[str, object]) -> bytes:
    """The message ``push_wire`` writes of ``chunks``, each given as protobuf's fields."""
    packed = push_wire.PackedMessage()
    for fields in chunks:
        packed.add(str(fields["name"]), str(fields.get("dtype", "")), fields.get("shape", []),  # type: ignore[arg-type]
                   int(fields.get("offset", 0)), memoryview(fields.get("data", b"")))  # type: ignore[call-overload]
    return packed.message()


def unpacked_shape(number: int, dims: list[int]) -> bytes:
    """``shape`` written one varint field per dimension (protobuf readers must take both forms)."""
    return b"".join(bytes([(number << 3) | 0, d]) for d in dims)


CASES = {
    "a first chunk": chunk_message(name="unet.conv_in.weight", dtype="float32", shape=[4, 3, 3, 3], offset=0,
                                   data=bytes(range(256)) * 9),
    "a later chunk": chunk_message(name="unet.conv_in.weight", offset=1 << 40, data=b"\x01" * 300),
    "a commit": W.PushWeightsRequest(commit=common_pb2.PushWeightsCommit(sha256="ab" * 32)).SerializeToString(),
    "an empty message": b"",
    "an empty tensor": chunk_message(name="unet.x", dtype="float16", shape=[0, 7]),
    # the chunk field twice merges: the second's name wins, the shapes add up
    "a chunk given twice": chunk_message(name="a.b", shape=[2]) + chunk_message(name="a.c", shape=[5], data=b"xy"),
    # a commit after a chunk: the oneof's last part is the commit
    "a chunk, then a commit": chunk_message(name="a.b", data=b"z") + W.PushWeightsRequest(
        commit=common_pb2.PushWeightsCommit(sha256="cd" * 32)).SerializeToString(),
    # unknown fields (varint 9, fixed64 10, fixed32 11, bytes 12) inside and outside the chunk
    "unknown fields": (b"\x48\x05" + b"\x51" + bytes(8) + b"\x5d" + bytes(4) + b"\x62\x02hi"
                       + b"\x0a\x0b" + b"\x48\x07" + b"\x0a\x03a.b" + b"\x2a\x02ok" + b"\x58\x01"),
    "packed chunks": chunks_message({"name": "a.b", "dtype": "uint8", "shape": [2], "data": b"xy"},
                                    {"name": "a.c", "dtype": "float16", "shape": [0]},
                                    {"name": "a.d", "dtype": "int8", "shape": [3], "data": b"abc"}),
    "no packed chunks": chunks_message(),
    # the chunks field twice merges: its chunks add up
    "packed chunks given twice": chunks_message({"name": "a.b", "data": b"x"}) + chunks_message({"name": "a.c"}),
    # the oneof's last part wins, either way round
    "a chunk, then packed chunks": chunk_message(name="a.b") + chunks_message({"name": "a.c"}, {"name": "a.d"}),
    "packed chunks, then a chunk": chunks_message({"name": "a.c"}, {"name": "a.d"}) + chunk_message(name="a.b"),
}


@pytest.mark.parametrize("name", CASES)
def test_each_message_reads_as_protobuf_reads_it(name):
    message = CASES[name]
    assert read_part(message) == as_protobuf_reads(message)


def test_an_unpacked_shape_reads_as_a_packed_one():
    inner = b"\x0a\x03a.b" + unpacked_shape(3, [4, 3, 2])
    message = b"\x0a" + bytes([len(inner)]) + inner
    part = read_part(message)
    assert part == as_protobuf_reads(message) and isinstance(part, list) and part[0].shape == (4, 3, 2)


@pytest.mark.parametrize("message", [chunk_message(name="a.b", dtype="uint8", shape=[4], data=b"\x01\x02\x03\x04"),
                                     chunks_message({"name": "a.a"}, {"name": "a.b", "data": b"\x01\x02\x03\x04"})],
                         ids=["alone", "packed"])
def test_a_chunks_data_is_a_view_of_the_message_not_a_copy(message):
    part = read_part(message)
    assert isinstance(part, list) and part[-1].data.obj is message and bytes(part[-1].data) == b"\x01\x02\x03\x04"


@pytest.mark.parametrize("message", [
    b"\x0a\x10short",  # a chunk longer than the message
    b"\x0a",  # a length missing
    b"\x0f\x00",  # wire type 7
    b"\x00\x01",  # field number 0
    b"\x0a\x03\x0a\x01\xff",  # a name that is not UTF-8
    b"\x20" + b"\xff" * 11,  # a varint past 10 bytes
])
def test_a_malformed_message_is_invalid_argument(message):
    with pytest.raises(ServiceError) as refused:
        read_part(message)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def field(number: int, body: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(body)) + body


EMPTY_CHUNKS = 1 << 19  # a megabyte of 2-byte entries: half a million objects if each were kept
FIELD_FLOODS = {
    "a chunk given again and again": b"\x0a\x00" * EMPTY_CHUNKS,
    "empty chunks packed": field(3, b"\x0a\x00" * EMPTY_CHUNKS),
    "packed chunks over two TensorChunks": field(3, b"\x0a\x00" * 1000) * 2,
    "a shape of a million dimensions": field(1, field(3, b"\x00" * (1 << 20))),
    "a million unpacked dimensions": field(1, b"\x18\x00" * EMPTY_CHUNKS),
    "a commit given again and again": b"\x12\x00" * EMPTY_CHUNKS,
}


@pytest.mark.parametrize("message", FIELD_FLOODS.values(), ids=FIELD_FLOODS.keys())
def test_a_message_of_more_fields_than_a_push_needs_is_refused_as_it_is_read(message):
    """Within the message size limit, fields cost far more kept than sent: the reader refuses past
    ``MAX_FIELDS`` of a message (``MAX_PACKED_CHUNKS`` chunks packed) before keeping more."""
    with pytest.raises(ServiceError) as refused:
        read_part(message)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "more fields than a message of the stream may hold" in refused.value.message


def test_the_most_chunks_a_message_may_pack_read_and_a_push_packs_no_more():
    packed = field(3, b"\x0a\x00" * push_wire.MAX_PACKED_CHUNKS)
    assert read_part(packed) == [Chunk()] * push_wire.MAX_PACKED_CHUNKS == as_protobuf_reads(packed)
    tensors = [(f"unet.t{index}", "uint8", (1,), b"\x07") for index in range(2 * push_wire.MAX_PACKED_CHUNKS + 1)]
    *messages, _ = push_messages(tensors, 1 << 20)
    assert [len(read_part(message)) for message, _ in messages] == [  # type: ignore[arg-type]
        push_wire.MAX_PACKED_CHUNKS, push_wire.MAX_PACKED_CHUNKS, 1]


@pytest.mark.parametrize("fields", [
    {"name": "unet.conv_in.weight", "dtype": "float32", "shape": [4, 3, 3, 3], "offset": 0,
     "data": bytes(range(256)) * 9},
    {"name": "unet.conv_in.weight", "dtype": "", "shape": [], "offset": 1 << 40, "data": b"\x01" * 300},
    {"name": "unet.x", "dtype": "float16", "shape": [0, 7], "offset": 0, "data": b""},
    {"name": "unet.é", "dtype": "bfloat16", "shape": [300, 1, 2**33], "offset": 5, "data": b"\x00" * 200},
], ids=["a first chunk", "a later chunk", "an empty tensor", "long varints"])
def test_a_chunk_written_without_protobuf_is_protobufs_own_message(fields):
    message = written(fields)
    assert message == chunk_message(**fields)
    assert read_part(message) == as_protobuf_reads(message)


def test_chunks_packed_without_protobuf_are_protobufs_own_message():
    chunks = [{"name": "unet.a", "dtype": "float32", "shape": [2, 2], "data": bytes(range(16))},
              {"name": "unet.b", "dtype": "float16", "shape": [0, 7]},
              {"name": "unet.c", "dtype": "bfloat16", "shape": [300, 2**33], "offset": 0, "data": b"\x00" * 200},
              {"name": "unet.c", "offset": 200, "data": b"\x01" * 5}]
    message = written(*chunks)
    assert message == chunks_message(*chunks)
    assert read_part(message) == as_protobuf_reads(message)
    assert len(read_part(message)) == 4  # type: ignore[arg-type]


def test_a_commit_written_without_protobuf_is_protobufs_own_message():
    for sha256 in ("ab" * 32, ""):
        written = push_wire.commit_message(sha256)
        assert written == W.PushWeightsRequest(commit=common_pb2.PushWeightsCommit(sha256=sha256)).SerializeToString()
        assert read_part(written) == Commit(sha256)


def test_a_pushs_small_tensors_share_messages_and_read_back_as_sent():
    """``push_messages`` packs: 40 tensors of 100 bytes, an empty one and one of 2,500 bytes go in
    messages of at most ``chunk_bytes`` of data and one chunk's header over it, far fewer messages
    than tensors, and read back (checked as the worker and runner check them) as the bytes sent, in
    order, under the digest the commit declares."""
    tensors = [(f"unet.small_{index:02d}", "uint8", (100,), bytes([index]) * 100) for index in range(40)]
    tensors[20:20] = [("unet.empty", "float16", (0, 3), b""), ("unet.large", "uint8", (2500,), bytes(range(250)) * 10)]
    chunk_bytes = 1000
    *messages, (commit, commit_data) = push_messages(tensors, chunk_bytes)
    assert commit_data is None and len(messages) < 10  # a message a tensor: 44
    header_bound = 32 + max(len(name) for name, *_ in tensors)
    for message, data_bytes in messages:
        assert data_bytes is not None and data_bytes <= chunk_bytes and len(message) <= chunk_bytes + header_bound
    reader = PushReader(ChunkChecker(Allowance(1 << 20), "a test's budget"))
    received: dict[str, bytearray] = {}

    async def read() -> None:
        async def stream() -> AsyncIterator[bytes]:
            for message, _ in messages:
                yield message
            yield commit

        async for _, chunks in reader.chunks(stream()):
            for chunk, started in chunks:
                if started is not None:
                    received[started.name] = bytearray()
                received[chunk.name] += chunk.data

    asyncio.run(read())
    assert [(h.name, h.dtype, h.shape) for h in reader.checker.headers] == [(n, d, s) for n, d, s, _ in tensors]
    assert {name: bytes(data) for name, data in received.items()} == {name: data for name, _, _, data in tensors}
    digest = hashlib.sha256(b"".join(tensor_preamble(n, d, s) + data for n, d, s, data in tensors)).hexdigest()
    assert reader.declared == digest
