"""Property-based fuzzing of GenerateRequest against a running worker: never INTERNAL, never a hang."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusion.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from harness.processes import start_worker
from serving_common.errors import field_violations
from support import running_pair

pytestmark = pytest.mark.process
MAX_SIZE, MAX_STEPS, MAX_IMAGES, MAX_PROMPT = 128, 3, 2, 64
MAX_GUIDANCE = 100.0  # the worker's default --max-guidance

requests = st.builds(
    worker_pb2.GenerateRequest,
    request_id=st.one_of(st.just(""), st.text(max_size=140)),
    prompt=st.text(max_size=80),
    negative_prompt=st.text(max_size=80),
    width=st.one_of(st.sampled_from([0, 8, 16, 64, 65, 136, 4096]), st.integers(0, 2**32 - 1)),
    height=st.one_of(st.sampled_from([0, 8, 16, 64, 65, 136, 4096]), st.integers(0, 2**32 - 1)),
    num_inference_steps=st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1)),
    guidance_scale=st.one_of(st.none(), st.floats(width=32, allow_nan=True, allow_infinity=True)),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    num_images=st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)),
    output_format=st.integers(-3, 8),
    # No adapter is registered on the fuzzed worker: any adapter, whatever its name or scale, is refused.
    adapters=st.lists(st.builds(common_pb2.AdapterRef, name=st.text(max_size=70),
                                scale=st.one_of(st.none(), st.floats(width=32))), max_size=2),
)


def valid(request: worker_pb2.GenerateRequest, model: common_pb2.ModelInfo) -> bool:
    """The oracle: the worker's documented bounds, and the size grid the model reports."""
    multiple, smallest = max(8, model.size_multiple), max(8, model.min_size)

    def size_ok(value: int) -> bool:
        return value == 0 or (value % multiple == 0 and smallest <= value <= MAX_SIZE)

    guidance = request.guidance_scale if request.HasField("guidance_scale") else 7.5
    return (size_ok(request.width) and size_ok(request.height)
            and (request.num_inference_steps or 20) <= MAX_STEPS  # 0: the default, 20
            and math.isfinite(guidance) and 0 <= guidance <= MAX_GUIDANCE
            and request.num_images <= MAX_IMAGES
            and len(request.prompt) <= MAX_PROMPT and len(request.negative_prompt) <= MAX_PROMPT
            and 0 <= request.output_format <= 4 and len(request.request_id) <= 128
            and all("!" <= c <= "~" for c in request.request_id)  # printable ASCII, no spaces
            and not request.adapters)


LIMITS = ("--max-size", str(MAX_SIZE), "--max-steps", str(MAX_STEPS), "--max-images", str(MAX_IMAGES),
          "--max-prompt-chars", str(MAX_PROMPT))


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """A worker with small limits on the fake runner: the many examples test the worker's checks."""
    with running_pair(tmp_path_factory.mktemp("fuzz"), *LIMITS, fake_step_s=0.0) as pair, \
            grpc.insecure_channel(pair.worker.target) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        yield stub, stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).model
        assert pair.worker.stop() == 0


@pytest.fixture(scope="module")
def real(tiny_pair, tmp_path_factory):
    """A worker with the same limits on the session's real runner (it serves tiny already), for
    fewer examples: what the worker admits, a real model runs."""
    worker = start_worker(tmp_path_factory.mktemp("fuzz-real"), tiny_pair.runner.target, "--model", "tiny", *LIMITS)
    with grpc.insecure_channel(worker.target) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        yield stub, stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).model
    assert worker.stop() == 0


def images_or_invalid_argument(stub, model: common_pb2.ModelInfo, request: worker_pb2.GenerateRequest) -> None:
    try:
        response = stub.Generate(request, timeout=60)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details(), request)
        assert not valid(request, model), (error.details(), request)
        assert field_violations(error), "INVALID_ARGUMENT without field violations"
        return
    assert valid(request, model), request
    assert len(response.images) == (request.num_images or 1)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests)
def test_any_generate_request_gets_images_or_invalid_argument(fake, request):
    images_or_invalid_argument(*fake, request)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests)
def test_any_generate_request_on_a_real_runner_too(real, request):
    images_or_invalid_argument(*real, request)
