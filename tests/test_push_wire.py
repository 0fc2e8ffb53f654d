"""The PushWeights messages read without protobuf agree with protobuf's own reading, and those
written without it are protobuf's own bytes."""

from __future__ import annotations

import grpc
import pytest

from diffusion.v1 import common_pb2, worker_pb2
from serving_common import push_wire
from serving_common.errors import ServiceError
from serving_common.push_wire import Chunk, Commit, read_part

W = worker_pb2
pytestmark = pytest.mark.unit


def as_protobuf_reads(message: bytes) -> Chunk | Commit:
    parsed = W.PushWeightsRequest.FromString(message)
    if parsed.HasField("commit"):
        return Commit(parsed.commit.sha256)
    chunk = parsed.chunk
    return Chunk(chunk.name, chunk.dtype, tuple(chunk.shape), chunk.offset, memoryview(chunk.data))


def chunk_message(**fields: object) -> bytes:
    return W.PushWeightsRequest(chunk=common_pb2.TensorChunk(**fields)).SerializeToString()  # type: ignore[arg-type]


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
}


@pytest.mark.parametrize("name", CASES)
def test_each_message_reads_as_protobuf_reads_it(name):
    message = CASES[name]
    assert read_part(message) == as_protobuf_reads(message)


def test_an_unpacked_shape_reads_as_a_packed_one():
    inner = b"\x0a\x03a.b" + unpacked_shape(3, [4, 3, 2])
    message = b"\x0a" + bytes([len(inner)]) + inner
    part = read_part(message)
    assert part == as_protobuf_reads(message) and isinstance(part, Chunk) and part.shape == (4, 3, 2)


def test_a_chunks_data_is_a_view_of_the_message_not_a_copy():
    message = chunk_message(name="a.b", dtype="uint8", shape=[4], data=b"\x01\x02\x03\x04")
    part = read_part(message)
    assert isinstance(part, Chunk) and part.data.obj is message and bytes(part.data) == b"\x01\x02\x03\x04"


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


@pytest.mark.parametrize("fields", [
    {"name": "unet.conv_in.weight", "dtype": "float32", "shape": [4, 3, 3, 3], "offset": 0,
     "data": bytes(range(256)) * 9},
    {"name": "unet.conv_in.weight", "dtype": "", "shape": [], "offset": 1 << 40, "data": b"\x01" * 300},
    {"name": "unet.x", "dtype": "float16", "shape": [0, 7], "offset": 0, "data": b""},
    {"name": "unet.é", "dtype": "bfloat16", "shape": [300, 1, 2**33], "offset": 5, "data": b"\x00" * 200},
], ids=["a first chunk", "a later chunk", "an empty tensor", "long varints"])
def test_a_chunk_written_without_protobuf_is_protobufs_own_message(fields):
    written = push_wire.chunk_message(fields["name"], fields["dtype"], fields["shape"], fields["offset"],
                                      memoryview(fields["data"]))
    assert written == chunk_message(**fields)
    assert read_part(written) == as_protobuf_reads(written)


def test_a_commit_written_without_protobuf_is_protobufs_own_message():
    for sha256 in ("ab" * 32, ""):
        written = push_wire.commit_message(sha256)
        assert written == W.PushWeightsRequest(commit=common_pb2.PushWeightsCommit(sha256=sha256)).SerializeToString()
        assert read_part(written) == Commit(sha256)
