"""Acceleration on a real runner process: what each model is offered, refusals that name their
field and leave the loaded model serving, int8 weights (smaller, close to plain, restored bit for
bit by a level-1 sleep), a dispatcher backend, and a wake-up dropping the rows a cache kept (the
compiled model: test_cache_compile.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from harness.processes import start_runner
from runner_calls import SHAPES_ITEM, execute, info, item, load, pixels, refused, runner_stub
from runner_service.acceleration.apply import CACHES
from runner_service.acceleration.apply import QUANTIZATIONS as QUANTIZATION_KERNELS
from runner_service.config import RunnerConfig
from runner_service.core import ModelHost
from runner_service.device_gate import CallWatch
from serving_common.input_rules import CACHE_METHODS, QUANTIZATIONS, AccelerationPlan

pytestmark = [pytest.mark.timeout(600), pytest.mark.process]


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runner_pb2_grpc.RunnerServiceStub]:
    runner = start_runner(tmp_path_factory.mktemp("acceleration-runner"))
    try:
        yield runner_stub(runner.target)
    finally:
        runner.stop()


def shapes_image(stub: runner_pb2_grpc.RunnerServiceStub, seed: int = 3) -> np.ndarray:
    return pixels(execute(stub, item(seed=seed, **SHAPES_ITEM))[1])


def transformer_bytes(runner: common_pb2.RunnerInfo) -> int:
    return next(c.bytes for c in runner.model.components if c.name == "transformer")


def psnr(first: np.ndarray, second: np.ndarray) -> float:
    error = float(np.mean((first.astype(np.float64) - second) ** 2))
    return float("inf") if error == 0 else 10 * np.log10(255 ** 2 / error)


@pytest.fixture(scope="module")
def plain(stub: runner_pb2_grpc.RunnerServiceStub) -> tuple[common_pb2.RunnerInfo, np.ndarray]:
    loaded = load(stub, "shapes")
    return loaded, shapes_image(stub)


def test_offer_follows_the_models_denoiser(stub, plain):
    shapes, _ = plain
    offered = shapes.model.acceleration_offer
    assert list(offered.cache_methods) == ["first_block_cache", "taylorseer", "dual_block_cache"]
    assert "int8-weight-only" in offered.quantizations and "float8-weight-only" not in offered.quantizations
    assert {"native", "_native_math"} <= set(offered.attention_backends) and "flash" not in offered.attention_backends
    assert offered.compile
    assert shapes.model.acceleration == common_pb2.Acceleration()
    assert not shapes.HasField("cache")
    unet = load(stub, "tiny").model.acceleration_offer
    assert list(unet.cache_methods) == ["deep_cache"], "a UNet has no transformer blocks diffusers describes"


def test_what_a_runner_can_offer_is_what_the_workers_rule_knows() -> None:
    """Init and the worker's flags refuse a cache or quantization outside the shared names."""
    assert set(QUANTIZATION_KERNELS) == set(QUANTIZATIONS) and tuple(CACHES) == CACHE_METHODS


@pytest.mark.parametrize(("acceleration", "field"), [
    (dict(cache="first_block_cache", cache_threshold=0.1), "acceleration.cache"),  # tiny's UNet
    (dict(quantization="int3-weight-only"), "acceleration.quantization"),
    (dict(attention_backend="flash"), "acceleration.attention_backend"),  # no flash-attn on CPU
    (dict(cache="first_block_cache", cache_threshold=-0.1), "acceleration.cache_threshold"),
    (dict(cache_threshold=0.1), "acceleration.cache"),
])
def test_a_plan_the_model_cannot_take_is_refused_naming_its_field_and_the_model_serves_on(stub, plain, acceleration,
                                                                                          field):
    _, image = plain
    current = info(stub).model
    if current.source != "shapes" or current.acceleration != common_pb2.Acceleration():
        load(stub, "shapes")  # another test loaded another model or plan; a refusal leaves it in place
    error = refused(stub.LoadModel, runner_pb2.LoadModelRequest(
        source="tiny", acceleration=common_pb2.Acceleration(**acceleration)), timeout=300)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (error.details() or "")
    assert info(stub).model.source == "shapes"
    assert np.array_equal(shapes_image(stub), image)


def test_int8_weights_are_smaller_close_to_plain_and_sleep_restores_them(stub, plain):
    loaded_plain, image = plain
    loaded = load(stub, "shapes", quantization="int8-weight-only")
    assert loaded.model.acceleration.quantization == "int8-weight-only"
    assert transformer_bytes(loaded) < 0.4 * transformer_bytes(loaded_plain)
    quantized = shapes_image(stub)
    assert psnr(quantized, image) > 25, psnr(quantized, image)
    checksum = stub.GetWeightsChecksum(runner_pb2.RunnerServiceGetWeightsChecksumRequest(), timeout=60).checksum
    for level in (1, 2):  # level 2 reads the weights back from the files and quantizes them again
        stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=level), timeout=60)
        stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest(), timeout=60)
        assert np.array_equal(shapes_image(stub), quantized), level
        assert stub.GetWeightsChecksum(runner_pb2.RunnerServiceGetWeightsChecksumRequest(),
                                       timeout=60).checksum == checksum, level


def test_an_attention_backend_serves_as_the_default_one(stub, plain):
    """torch's math kernel through diffusers' dispatcher: the same image as the default SDPA."""
    _, image = plain
    loaded = load(stub, "shapes", attention_backend="_native_math")
    assert loaded.model.acceleration.attention_backend == "_native_math"
    assert int(np.abs(shapes_image(stub).astype(np.int16) - image).max()) <= 2


def test_a_wake_up_forgets_the_rows_cached_before_it(cpu_platform):
    """The rows a cache kept from before a sleep are dropped at wake-up (and at a weights change):
    they were computed by the weights put to sleep."""
    async def scenario() -> None:
        host = ModelHost(cpu_platform, RunnerConfig())
        await host.load("tiny-flux", None, plan=AccelerationPlan(cache="first_block_cache", cache_threshold=0.2))
        model = host.model
        assert model is not None and model.row_cache is not None and host.step_batched_tasks(model)
        async for _ in host.execute([item(seed=1, steps=4, guidance_scale=1.0)], progress=False):
            pass
        assert model.row_cache.live_rows > 0
        await host.sleep(1, [], CallWatch("Sleep"))
        await host.wake([], CallWatch("WakeUp"))
        assert model.row_cache.live_rows == 0

    asyncio.run(scenario())
