"""The PushWeights attack of issue 20 item 3, for ``bench_limits``: a first chunk declaring a huge
tensor, followed by almost no data."""

from __future__ import annotations

import grpc

from diffusion.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def oversized_declaration(worker_target: str, declared_shape: list[int]) -> grpc.StatusCode:
    """Sends one float32 chunk of ``declared_shape`` carrying 16 bytes, then a commit; returns the
    status the worker answered (RESOURCE_EXHAUSTED when it refuses the declaration up front)."""
    chunk = common_pb2.TensorChunk(name="unet.conv_in.weight", dtype="float32", shape=declared_shape,
                                   data=bytes(16))
    stream = iter([worker_pb2.PushWeightsRequest(chunk=chunk),
                   worker_pb2.PushWeightsRequest(commit=common_pb2.PushWeightsCommit(sha256="0" * 64))])
    with grpc.insecure_channel(worker_target) as channel:
        try:
            worker_pb2_grpc.WorkerServiceStub(channel).PushWeights(stream, timeout=60)
        except grpc.RpcError as error:
            code: grpc.StatusCode = error.code()
            return code
    return grpc.StatusCode.OK
