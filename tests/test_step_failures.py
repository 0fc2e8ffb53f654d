"""Step counts a scheduler cannot run, and failures inside a step batch.

Stable Diffusion's DDIM (``steps_offset=1``, "leading" spacing, as ``tiny``'s) starts a 1000-step
schedule at timestep 1000, past its training ones (0 to 999): diffusers' own pipeline call fails
with an IndexError in ``scheduler.step`` (diffusers issue 10003). The model reports the most steps
its schedulers run (999 here), and a request for more is refused at the worker and at the runner,
naming ``num_inference_steps``. And a sequence that fails inside a step fails alone: the other
requests of its step batch finish with their own images."""

from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
import pytest
from diffusers.schedulers.scheduling_ddim import DDIMScheduler

from diffusion.v1 import worker_pb2
from harness.processes import worker_stub
from runner_calls import execute, info, item, runner_stub
from runner_service.config import RunnerConfig
from runner_service.core import ModelHost
from runner_service.execution import BatchResult, StepProgress
from runner_service.loaded_model import check_source, load_model
from runner_service.model_roots import ModelRoots
from runner_service.model_sources import HubCache
from serving_common.errors import ServiceError
from support import request, running_pair

pytestmark = pytest.mark.process

TINY_MOST_STEPS = 999


def test_steps_past_what_the_scheduler_runs_are_refused_naming_the_field(tmp_path):
    """A worker admitting 1000 steps, serving ``tiny``: 1000 is refused up front (it failed
    INTERNAL mid-run), at the worker and at the runner alike, and 999 runs."""
    with running_pair(tmp_path, "--max-steps", "1000") as pair, worker_stub(pair.worker.target, warm=False) as worker:
        runner = runner_stub(pair.runner.target)
        size = info(runner).model.min_size
        unguided = {"width": size, "height": size, "guidance_scale": 1.0}  # one UNet row a step
        with pytest.raises(grpc.RpcError) as refused:
            worker.Generate(request(num_inference_steps=1000, **unguided), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert "num_inference_steps" in refused.value.details() and "999" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused_here:
            execute(runner, item(steps=1000, size=size, guidance_scale=1.0))
        assert refused_here.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_inference_steps" in refused_here.value.details()
        assert info(runner).model.capabilities.max_steps == TINY_MOST_STEPS
        status = worker.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
        assert status.model.capabilities.max_steps == TINY_MOST_STEPS
        done = worker.Generate(request(num_inference_steps=TINY_MOST_STEPS, **unguided), timeout=300)
        assert len(done.images) == 1

@pytest.fixture(scope="module")
def tiny(cpu_platform):
    return load_model(check_source("tiny", None, ModelRoots(), HubCache()), None, cpu_platform)


async def served(events) -> tuple[list[int], BatchResult]:
    """A submission's progress steps and its result."""
    steps = []
    async for event in events:
        if isinstance(event, StepProgress):
            steps.append(event.step)
        else:
            return steps, event
    raise AssertionError("no result")


def test_a_sequence_failing_in_a_step_fails_alone_and_the_step_batch_goes_on(cpu_platform, tiny, caplog):
    """The real step engine in this process, with a scheduler that fails at a step count its model
    admits: tiny's DDIM given ``steps_offset=2`` after the load (after the probe of the most steps),
    so a 999-step schedule starts at timestep 1000 and diffusers' own ``step`` raises in that
    sequence's first step. It joins a running request (after that one's first step, by its progress
    event); it fails alone, INTERNAL naming the error, and the running one finishes with the image
    it makes alone."""
    size = tiny.capabilities.min_size or tiny.capabilities.size_multiple
    steady = item(seed=6, steps=8, size=size, request_id="steady")
    overrun = item(seed=7, steps=TINY_MOST_STEPS, size=size, request_id="overrun")

    async def scenario() -> tuple[ServiceError, list[int], BatchResult, BatchResult]:
        host = ModelHost(cpu_platform, RunnerConfig())
        host.slot.model = tiny
        steady_events = host.execute([steady], True)
        first = await anext(steady_events)
        assert isinstance(first, StepProgress) and first.step == 1  # it runs: the other joins its batch
        with pytest.raises(ServiceError) as failed:
            await served(host.execute([overrun], True))
        steps, together = await served(steady_events)
        _, alone = await served(host.execute([steady], False))
        return failed.value, [first.step, *steps], together, alone

    shared = tiny.pipeline.scheduler
    tiny.pipeline.scheduler = DDIMScheduler.from_config(shared.config, steps_offset=2)
    try:
        with caplog.at_level(logging.ERROR, "runner_service.step_engine"):
            failure, steps, together, alone = asyncio.run(scenario())
    finally:
        tiny.pipeline.scheduler = shared
    assert failure.code == grpc.StatusCode.INTERNAL and "IndexError" in str(failure)
    assert "overrun alone; 1 other request(s) of its step batch go on" in caplog.text
    assert steps == list(range(1, 9))
    difference = np.abs(together.outputs[0].pixels.astype(int) - alone.outputs[0].pixels.astype(int)).max()
    assert difference <= 1
