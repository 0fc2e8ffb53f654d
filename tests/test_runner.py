"""The runner sidecar, through a real process on loopback: loading, executing, cancelling."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from diffusion.v1 import runner_pb2
from harness.processes import health_status
from runner_calls import execute, generate, info, item, pixels, runner_stub
from serving_common.errors import field_violations

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def stub(shared_runner):
    return runner_stub(shared_runner.target)


@pytest.fixture(scope="module")
def tiny(stub):
    return stub.LoadModel(runner_pb2.LoadModelRequest(source="tiny"), timeout=120).info


def test_info_before_a_model_is_loaded(shared_runner):
    described = shared_runner.info_unloaded
    assert not described.HasField("model")
    assert len(described.instance_id) == 32
    assert described.platform == "cpu"
    assert described.device_name
    assert 0 < described.memory.used_bytes < described.memory.total_bytes
    assert health_status(shared_runner.target, "diffusion.v1.RunnerService") == 1  # SERVING
    assert health_status(shared_runner.target, "") == 1


def test_execute_without_a_model_fails_precondition(shared_runner):
    error = shared_runner.execute_unloaded
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "LoadModel" in error.details()


def test_load_model_reports_components_found_by_name(tiny, stub):
    names = {c.name: c for c in tiny.model.components}
    assert set(names) == {"unet", "vae", "text_encoder"}
    assert all(c.parameter_count > 0 and c.bytes == 4 * c.parameter_count for c in names.values())
    assert names["unet"].class_name == "UNet2DConditionModel"
    assert tiny.model.pipeline_class == "StableDiffusionPipeline"
    assert tiny.weights_version and info(stub).weights_version == tiny.weights_version


@pytest.mark.parametrize("fields, field", [({"source": ""}, "source"), ({"source": "tiny", "dtype": 99}, "dtype")])
def test_bad_load_model_requests_are_invalid_argument(stub, fields, field):
    with pytest.raises(grpc.RpcError) as error:
        stub.LoadModel(runner_pb2.LoadModelRequest(**fields))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in field_violations(error.value)


def test_same_seed_same_pixels_and_different_seeds_differ(tiny, stub):
    first, again, other = generate(stub, seed=11), generate(stub, seed=11), generate(stub, seed=12)
    assert first.shape == (64, 64, 3)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_step_events_number_every_step(tiny, stub):
    events, result = execute(stub, item(seed=3, steps=6), progress=True)
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert all(e.total_steps == 6 and list(e.request_ids) == ["req-3"] for e in events)
    assert [e.elapsed_ms for e in events] == sorted(e.elapsed_ms for e in events)
    assert result.execute_ms > 0 and result.weights_version == tiny.weights_version


def test_a_paced_call_is_sent_its_first_and_last_steps_and_every_preview(tiny, stub):
    """An hour between messages: what pacing never holds back still comes, the steps between do not."""
    events, result = execute(stub, item(seed=3, steps=8, partial_images=2), progress=True,
                             progress_interval_ms=3_600_000)
    assert [e.step for e in events if not e.previews] == [1, 8]
    assert sorted(p.partial_image_index for e in events for p in e.previews) == [0, 1]
    assert len(events) < 8 and len(result.outputs[0].images) == 1


def test_no_progress_events_unless_asked(tiny, stub):
    events, _ = execute(stub, item(seed=3, steps=3))
    assert events == []


def test_each_image_depends_only_on_its_own_seed(tiny, stub):
    _, batch = execute(stub, item(seed=21, request_id="a", num_images=2), item(seed=40, request_id="b"))
    assert [[i.seed for i in o.images] for o in batch.outputs] == [[21, 22], [40]]
    alone = {seed: generate(stub, seed=seed) for seed in (21, 22, 40)}
    # Batched kernels may round differently from single-image ones; the seed decides the image.
    for (output, image), seed in zip([(0, 0), (0, 1), (1, 0)], (21, 22, 40), strict=True):
        difference = np.abs(pixels(batch, output, image).astype(int) - alone[seed].astype(int)).max()
        assert difference <= 2, (seed, difference)


def test_incompatible_batch_is_invalid_argument_naming_the_field(tiny, stub):
    with pytest.raises(grpc.RpcError) as error:
        execute(stub, item(seed=1), item(seed=2, size=72))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert {"items[1].width", "items[1].height"} <= set(field_violations(error.value))


def test_cancel_stops_denoising_and_frees_the_runner(tiny, stub):
    steps_seen = []
    call = stub.Execute(runner_pb2.ExecuteRequest(items=[item(seed=5, steps=500)], progress=True))

    def consume() -> None:
        try:
            for event in call:
                steps_seen.append((event.progress.step, time.perf_counter()))
                if len(steps_seen) == 3:
                    call.cancel()
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=consume)
    reader.start()
    reader.join(60)
    assert not reader.is_alive()
    step_seconds = (steps_seen[-1][1] - steps_seen[0][1]) / (len(steps_seen) - 1)
    cancelled_at = time.perf_counter()
    events, _ = execute(stub, item(seed=6, steps=1), progress=True)
    waited = time.perf_counter() - cancelled_at
    # The next request waits for at most about one step of the cancelled run, not 497 of them.
    assert [e.step for e in events] == [1]
    assert waited < 20 * step_seconds + 2.0, (waited, step_seconds)
