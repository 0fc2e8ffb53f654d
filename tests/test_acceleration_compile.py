"""A compiled model on a real runner process (its own module: compiling takes a minute or two on
two cores, in parallel with the other test modules): equal to eager within 2/255, with and without
its step cache, through a level-1 sleep and a weights change."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from diffusion.v1 import runner_pb2, runner_pb2_grpc
from harness.processes import start_runner
from runner_calls import SHAPES_ITEM, execute, info, item, load, pixels, runner_stub
from runner_service.models.catalog import SHIPPED_MODELS

pytestmark = [pytest.mark.timeout(900), pytest.mark.process, pytest.mark.slow]


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[runner_pb2_grpc.RunnerServiceStub]:
    runner = start_runner(tmp_path_factory.mktemp("acceleration-compile"))
    try:
        yield runner_stub(runner.target)
    finally:
        runner.stop()


def test_a_compiled_model_equals_eager_with_and_without_its_cache_and_follows_its_weights(stub, tmp_path):
    """Compiled before LoadModel returns (the canaries ran compiled); then a 64 and a 128 image, one
    of each with the cache off (threshold 0), equal the eager model's; a level-1 sleep changes
    nothing, and weights loaded change the image until the stored ones are loaded back."""
    cached = dict(cache="first_block_cache", cache_threshold=0.2)
    load(stub, "shapes", **cached)
    requests = [item(seed=3, **SHAPES_ITEM), item(seed=4, cache_threshold=0.0, **SHAPES_ITEM),
                item(seed=5, **{**SHAPES_ITEM, "size": 128})]
    eager = [pixels(execute(stub, request)[1]) for request in requests]
    compiled_info = load(stub, "shapes", compile=True, **cached)
    assert compiled_info.model.acceleration.compile
    compiled = [pixels(execute(stub, request)[1]) for request in requests]
    differences = [int(np.abs(a.astype(np.int16) - b).max()) for a, b in zip(eager, compiled, strict=True)]
    assert max(differences) <= 2, differences
    skipped = info(stub).cache
    assert 0 < skipped.skipped_rows < skipped.rows

    # The compiled blocks read the parameters: through a level-1 sleep, and weights loaded and back.
    stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=1), timeout=60)
    stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest(), timeout=60)
    assert np.array_equal(pixels(execute(stub, requests[0])[1]), compiled[0])
    stored = load_file(SHIPPED_MODELS["shapes"] / "transformer" / "diffusion_pytorch_model.safetensors")
    original = {"transformer.proj_out.weight": stored["proj_out.weight"].float()}  # as loaded
    for tensors in ({name: tensor * 0.5 for name, tensor in original.items()}, original):
        save_file(tensors, tmp_path / "proj_out.safetensors")
        stub.LoadWeights(runner_pb2.RunnerServiceLoadWeightsRequest(path=str(tmp_path / "proj_out.safetensors")),
                         timeout=120)
        changed = pixels(execute(stub, requests[0])[1])
        assert np.array_equal(changed, compiled[0]) == (tensors is original)
