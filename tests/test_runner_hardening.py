"""The runner defends itself, on the session's shared runner process (no model roots, tiny at 64x64):
files that are not regular or too big, its own request bounds, the model's size grid, LoadModel
failures that keep the model, sleep and wake that fail part way, and the spill directories of runners
that died."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from diffusion.v1 import runner_pb2
from runner_calls import generate, info, item, refused, tiny_model_copy
from serving_common.errors import field_violations
from serving_common.owned_dirs import lock_directory

R = runner_pb2
MIB = 1024 * 1024
pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def hardened(shared_runner):
    """The shared runner with tiny loaded, and the image it makes for seed 5."""
    stub = shared_runner.load("tiny")
    return SimpleNamespace(stub=stub, base=shared_runner.base, stale=shared_runner.stale,
                           reference=generate(stub, seed=5))


def unchanged(hardened, version: str | None = None) -> None:
    """The runner still serves, with tiny, bit-identically (and at ``version`` when given)."""
    described = info(hardened.stub)
    assert described.model.source == "tiny" and not any(c.asleep for c in described.model.components)
    if version is not None:
        assert described.weights_version == version
    assert np.array_equal(generate(hardened.stub, seed=5), hardened.reference)


def test_stale_spill_directories_of_killed_runners_are_removed_at_start(hardened):
    assert not hardened.stale["killed"].exists() and hardened.stale["live"].exists()
    # The runner's own spill directory (--spill-dir) is locked while it runs.
    assert lock_directory(hardened.base / "spill") is None


def test_devices_and_fifos_are_refused_without_being_opened(hardened, tmp_path):
    zero = tmp_path / "zero"
    zero.mkdir()
    (zero / "a.safetensors").symlink_to("/dev/zero")
    fifo = tmp_path / "w.safetensors"
    os.mkfifo(fifo)
    version = info(hardened.stub).weights_version
    for path, words in [(zero, "a device"), (fifo, "a FIFO")]:
        started = time.perf_counter()
        error = refused(hardened.stub.LoadWeights, R.RunnerServiceLoadWeightsRequest(path=str(path)), timeout=10)
        elapsed = time.perf_counter() - started
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert words in field_violations(error)["path"]
        assert elapsed < 2.0, elapsed
    unchanged(hardened, version)


def test_a_file_over_the_weights_budget_is_refused_before_it_is_read(hardened, tmp_path):
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as sparse:  # 65 MiB on paper, nothing on disk
        sparse.truncate(65 * MIB)
    error = refused(hardened.stub.LoadWeights, R.RunnerServiceLoadWeightsRequest(path=str(big)), timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-weights-bytes" in field_violations(error)["path"]
    unchanged(hardened)


def test_a_thousand_files_of_unknown_tensors_are_one_short_invalid_argument(hardened, tmp_path):
    directory = tmp_path / "many"
    directory.mkdir()
    for index in range(1000):
        save_file({f"unet.nothing_{index}.weight": torch.zeros(1)}, directory / f"{index:04}.safetensors")
    error = refused(hardened.stub.LoadWeights, R.RunnerServiceLoadWeightsRequest(path=str(directory)), timeout=30)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("1000 unknown tensor names") and len(error.details()) < 300
    assert len(field_violations(error)) <= 11


@pytest.mark.parametrize("fields, field", [
    ({"num_images": 64}, "items[0].num_images"),
    ({"size": 4096}, "items[0].width"),
    ({"steps": 5000}, "items[0].num_inference_steps"),
    ({"guidance_scale": 3e38}, "items[0].guidance_scale"),
    ({"guidance_scale": float("inf")}, "items[0].guidance_scale"),
    ({"size": 16}, "items[0].width"),  # below tiny's minimum
    ({"size": 60}, "items[0].height"),  # off the multiple
])
def test_execute_is_held_to_the_runners_own_bounds(hardened, fields, field):
    with pytest.raises(grpc.RpcError) as error:
        list(hardened.stub.Execute(R.ExecuteRequest(items=[item(**fields)]), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in field_violations(error.value)


def test_a_batch_is_held_to_its_total_images(hardened):
    with pytest.raises(grpc.RpcError) as error:
        list(hardened.stub.Execute(R.ExecuteRequest(items=[item(seed=1, num_images=10), item(seed=2, num_images=10)]),
                                   timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items" in field_violations(error.value)


def test_the_model_reports_its_size_grid_and_its_smallest_size_runs(hardened):
    model = info(hardened.stub).model
    assert (model.min_size, model.size_multiple) == (24, 8)
    assert generate(hardened.stub, steps=1, size=24).shape == (24, 24, 3)


@pytest.mark.parametrize("tags, field", [(["unet"] * 65, "tags"), (["x" * 200], "tags[0]")])
def test_sleep_and_wake_tags_are_bounded(hardened, tags, field):
    for call, request in [(hardened.stub.Sleep, R.RunnerServiceSleepRequest(level=1, tags=tags)),
                          (hardened.stub.WakeUp, R.RunnerServiceWakeUpRequest(tags=tags))]:
        error = refused(call, request, timeout=10)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in field_violations(error)
    unchanged(hardened)


def broken_models(base):
    """Model directories that fail in different places, each made once."""
    broken = base / "broken-index"
    broken.mkdir(exist_ok=True)
    (broken / "model_index.json").write_text("{ not json")
    fifo = base / "fifo-weights"
    if not fifo.exists():
        tiny_model_copy(fifo)
        weights = fifo / "unet" / "diffusion_pytorch_model.safetensors"
        weights.unlink()
        os.mkfifo(weights)
    return {"broken": broken, "fifo": fifo}


@pytest.mark.parametrize("source, code, words", [
    ("/no/such/model", grpc.StatusCode.INVALID_ARGUMENT, "does not exist"),
    ("/etc", grpc.StatusCode.INVALID_ARGUMENT, "no model_index.json"),
    ("tinyy", grpc.StatusCode.INVALID_ARGUMENT, "did you mean 'tiny'"),
    ("fifo", grpc.StatusCode.INVALID_ARGUMENT, "a FIFO"),
    ("broken", grpc.StatusCode.FAILED_PRECONDITION, "cannot load"),
])
def test_a_failed_load_model_keeps_the_model_serving(hardened, source, code, words):
    before = info(hardened.stub)
    source = str(broken_models(hardened.base).get(source, source))
    started = time.perf_counter()
    error = refused(hardened.stub.LoadModel, R.LoadModelRequest(source=source), timeout=30)
    assert time.perf_counter() - started < 10
    assert error.code() == code, error
    assert words in error.details() + str(field_violations(error))
    after = info(hardened.stub)
    assert after.instance_id == before.instance_id and after.model == before.model
    unchanged(hardened, before.weights_version)


def test_a_sleep_that_fails_part_way_puts_nothing_to_sleep(hardened):
    components = [c.name for c in info(hardened.stub).model.components]
    blocker = hardened.base / "spill" / f"{components[-1]}.safetensors"
    blocker.mkdir()  # the last component's spill file cannot be written
    try:
        error = refused(hardened.stub.Sleep, R.RunnerServiceSleepRequest(level=1), timeout=30)
    finally:
        blocker.rmdir()
    assert error.code() == grpc.StatusCode.INTERNAL
    assert components[-1] in error.details() and "nothing was put to sleep" in error.details()
    assert list((hardened.base / "spill").iterdir()) == []
    unchanged(hardened)


def test_a_wake_up_that_fails_part_way_wakes_nothing_and_says_what_sleeps(hardened):
    hardened.stub.Sleep(R.RunnerServiceSleepRequest(level=1), timeout=30)
    components = [c.name for c in info(hardened.stub).model.components]
    spilled = hardened.base / "spill" / f"{components[-1]}.safetensors"
    aside = spilled.rename(spilled.with_suffix(".aside"))
    try:
        error = refused(hardened.stub.WakeUp, R.RunnerServiceWakeUpRequest(), timeout=30)
    finally:
        aside.rename(spilled)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert f"still asleep: {', '.join(components)}" in error.details()
    assert all(c.asleep for c in info(hardened.stub).model.components)
    hardened.stub.WakeUp(R.RunnerServiceWakeUpRequest(), timeout=30)
    unchanged(hardened)
