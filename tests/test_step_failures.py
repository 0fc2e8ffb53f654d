"""Step counts a scheduler cannot run.

Stable Diffusion's DDIM (``steps_offset=1``, "leading" spacing, as ``tiny``'s) starts a 1000-step
schedule at timestep 1000, past its training ones (0 to 999): diffusers' own pipeline call fails
with an IndexError in ``scheduler.step`` (diffusers issue 10003). The model reports the most steps
its schedulers run (999 here), and a request for more is refused at the worker and at the runner,
naming ``num_inference_steps``."""

from __future__ import annotations

import grpc
import pytest

from diffusion.v1 import worker_pb2
from harness.processes import worker_stub
from runner_calls import execute, info, item, runner_stub
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
