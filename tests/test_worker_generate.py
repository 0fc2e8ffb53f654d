"""The worker end to end against a real runner (the session's tiny_pair): images, seeds, formats,
streams, validation."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2
from PIL import Image

from diffusion.v1 import worker_pb2
from harness.processes import REPO, health_status
from serving_common.errors import field_violations

pytestmark = pytest.mark.process
W = worker_pb2


@pytest.fixture(scope="module")
def worker(tiny_pair):
    return tiny_pair.worker


@pytest.fixture(scope="module")
def stub(tiny_stub):
    return tiny_stub


def generate(stub, **fields) -> W.GenerateResponse:
    fields = {"prompt": "a red fox", "num_inference_steps": 4, **fields}
    return stub.Generate(W.GenerateRequest(**fields), timeout=60)


def test_png_decodes_with_right_size_and_mime(stub):
    response = generate(stub, width=64, height=48, seed=7, num_images=2)
    assert len(response.images) == 2
    for i, image in enumerate(response.images):
        assert image.mime_type == "image/png"
        assert (image.width, image.height, image.seed) == (64, 48, 7 + i)
        assert Image.open(io.BytesIO(image.data)).size == (64, 48)
    assert response.model == "tiny" and response.weights_version
    assert response.request_id
    timings = response.timings
    assert timings.total_ms >= timings.execute_ms > 0 and timings.encode_ms > 0 and timings.queue_ms >= 0


def test_same_seed_same_bytes_different_seed_differs(stub):
    first = generate(stub, seed=42).images[0].data
    assert generate(stub, seed=42).images[0].data == first
    assert generate(stub, seed=43).images[0].data != first


def test_unset_seed_is_drawn_and_echoed(stub):
    image = generate(stub).images[0]
    assert generate(stub, seed=image.seed).images[0].data == image.data


def test_seed_wraps_at_2_64(stub):
    response = generate(stub, seed=2**64 - 1, num_images=2)
    assert [i.seed for i in response.images] == [2**64 - 1, 0]


def test_raw_is_passthrough_pixels(stub):
    png = generate(stub, seed=5).images[0]
    raw = generate(stub, seed=5, output_format=W.OUTPUT_FORMAT_RAW).images[0]
    assert raw.mime_type == "application/octet-stream"
    assert len(raw.data) == 64 * 64 * 3
    assert Image.open(io.BytesIO(png.data)).convert("RGB").tobytes() == raw.data


@pytest.mark.parametrize("fmt, mime, pil", [(W.OUTPUT_FORMAT_JPEG, "image/jpeg", "JPEG"),
                                            (W.OUTPUT_FORMAT_WEBP, "image/webp", "WEBP")])
def test_jpeg_and_webp_decode(stub, fmt, mime, pil):
    image = generate(stub, seed=3, output_format=fmt).images[0]
    assert image.mime_type == mime
    decoded = Image.open(io.BytesIO(image.data))
    assert decoded.format == pil and decoded.size == (64, 64)


def test_stream_events_in_order(stub):
    request = W.GenerateStreamRequest(request=W.GenerateRequest(
        request_id="stream-1", prompt="a red fox", num_inference_steps=5, seed=1))
    events = list(stub.GenerateStream(request, timeout=60))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "queued" and events[0].queued.request_id == "stream-1"
    started = kinds.index("started")
    assert set(kinds[:started]) == {"queued"}
    assert [e.progress.step for e in events[started + 1:-1]] == [1, 2, 3, 4, 5]
    assert all(e.progress.total_steps == 5 for e in events[started + 1:-1])
    assert kinds[-1] == "done" and events[-1].done.request_id == "stream-1"
    assert events[-1].done.images[0].data == generate(stub, seed=1, num_inference_steps=5).images[0].data


@pytest.mark.parametrize("fields, field", [
    ({"width": 65}, "width"),
    ({"height": 4096}, "height"),
    ({"width": 4}, "width"),
    ({"num_inference_steps": 501}, "num_inference_steps"),
    ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"guidance_scale": math.nan}, "guidance_scale"),
    ({"guidance_scale": math.inf}, "guidance_scale"),
    ({"num_images": 99}, "num_images"),
    ({"prompt": "x" * 2001}, "prompt"),
    ({"negative_prompt": "x" * 2001}, "negative_prompt"),
    ({"output_format": 99}, "output_format"),
    ({"request_id": "x" * 129}, "request_id"),
    ({"request_id": "has space"}, "request_id"),
])
def test_invalid_fields_are_named(stub, fields, field):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(W.GenerateRequest(**fields), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in field_violations(caught.value)


def test_several_violations_at_once_and_stream_paths(stub):
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.GenerateStream(W.GenerateStreamRequest(request=W.GenerateRequest(width=65, num_images=99)),
                                 timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(field_violations(caught.value)) == {"request.width", "request.num_images"}


def test_defaults_zero_and_unset_are_fine(stub):
    response = stub.Generate(W.GenerateRequest(num_inference_steps=2, width=0, height=0), timeout=60)
    assert (response.images[0].width, response.images[0].height) == (64, 64)


def test_still_serving_after_bad_requests(worker, stub):
    assert health_status(worker.target, "diffusion.v1.WorkerService") == health_pb2.HealthCheckResponse.SERVING
    assert generate(stub, seed=1).images


def test_cancel_unknown_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Cancel(W.CancelRequest(request_id="nope"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_status_reports_ready_model_and_runner(stub):
    status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert status.state == W.WORKER_STATE_READY
    assert status.model.source == "tiny" and status.weights_version
    assert status.runners[0].connected and status.runners[0].info.instance_id
    assert status.queue_depth == 0 and status.requests_in_flight == 0


def test_worker_imports_no_torch():
    code = ("import worker_service.main, worker_service.service; import sys; "
            "heavy = {'torch', 'diffusers', 'transformers', 'safetensors'}; "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & heavy); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_flags_come_from_the_environment(monkeypatch):
    from worker_service.main import parse_args

    monkeypatch.setenv("DIFFUSION_WORKER_MAX_QUEUE", "3")
    monkeypatch.setenv("DIFFUSION_WORKER_AUTO_WAKE", "true")
    monkeypatch.setenv("DIFFUSION_WORKER_RUNNER", "unix:/tmp/runner.sock")
    config, level, as_json = parse_args(["--max-steps", "9", "--model", ""])
    assert (config.max_queue, config.auto_wake, config.runners) == (3, True, ("unix:/tmp/runner.sock",))
    assert (config.limits.max_steps, config.model, level, as_json) == (9, "", "info", False)


def test_a_request_its_runner_cannot_finish_before_the_deadline_is_refused_up_front(stub):
    """The runner measured tiny's costs when it loaded; a request estimated at twice the margin
    over its deadline is refused at once, naming what to change, and never reaches the runner. CPU
    runners report their platform's largest side, 512."""
    from serving_common.cost import CostPoint, request_seconds
    from worker_service.scheduling.estimate import ESTIMATE_MARGIN

    model = stub.GetStatus(W.GetStatusRequest()).model
    assert model.max_size == 512 and len(model.costs) >= 2
    points = [CostPoint(p.pixels, p.step_ms, p.decode_ms) for p in model.costs]
    needed = request_seconds(points, 512 * 512, 500, 1)
    assert needed is not None
    deadline = needed / (2 * ESTIMATE_MARGIN)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(W.GenerateRequest(prompt="a", width=512, height=512, num_inference_steps=500),
                      timeout=deadline)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    one_step = request_seconds(points, 512 * 512, 1, 1)
    assert one_step is not None
    assert "before the deadline" in field_violations(refused.value)[
        "width" if one_step > ESTIMATE_MARGIN * deadline else "num_inference_steps"]
