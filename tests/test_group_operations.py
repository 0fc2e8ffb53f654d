"""A runner group's ModelHost operations when rank 0's caller has gone away (issue 27): each rank
asks rank 0's watch right before it changes the model, so a cancelled or expired LoadModel,
LoadWeights or Sleep changes nothing on any rank, and the group serves on (none of them ends it).

Two real gloo ranks, each with its own ``ModelHost`` on tiny Flux with CFG-parallel: every guided
step's two branches are computed on different ranks, so a rank whose weights or sleep state
differed from rank 0's would change the image (or fail it). Rank 0 runs the scenario in a spawned
process and reports through a pipe.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import multiprocessing.connection
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from diffusion.v1 import runner_pb2
from runner_service.config import RunnerConfig
from runner_service.core import ModelHost
from runner_service.device_gate import CallWatch
from runner_service.execution import BatchResult
from runner_service.families import FAMILIES
from runner_service.group import GroupMember, launch
from runner_service.parallel import ParallelPlan
from runner_service.platforms import select_platform
from serving_common.errors import ServiceError

pytestmark = [pytest.mark.timeout(600), pytest.mark.process, pytest.mark.slow]

DEADLINE_S = 300.0
CFG = ParallelPlan(cfg=True)
ITEM = runner_pb2.ExecuteItem(request_id="r", prompt="a red circle", negative_prompt="blurry", true_cfg_scale=3.0,
                              width=32, height=32, num_inference_steps=2, guidance_scale=3.5, seed=5, num_images=1)


def ended(method: str) -> CallWatch:
    """The watch of a call that has ended (its client cancelled it, or its deadline passed)."""
    watch = CallWatch(method)
    watch.end()
    return watch


async def image(host: ModelHost) -> bytes:
    async for event in host.execute([ITEM], progress=False):
        if isinstance(event, BatchResult):
            output = event.outputs[0]
            return bytes(output.pixels.tobytes())  # type: ignore[union-attr]  # an image task's output
    raise AssertionError("no result")


async def refused(call: Any) -> str:
    """The status code name of a call expected to fail."""
    try:
        await call
    except ServiceError as error:
        return error.code.name
    return "OK"


async def scenario(host: ModelHost, weights: Path) -> dict[str, Any]:
    await host.load("tiny-flux", None, parallel=CFG)
    found: dict[str, Any] = {"base": await image(host)}
    found["load_weights"] = await refused(host.load_weights(str(weights), "", ended("LoadWeights")))
    found["after_load_weights"] = await image(host)
    found["sleep"] = await refused(host.sleep(1, [], ended("Sleep")))
    found["after_sleep"] = await image(host)
    found["load_model"] = await refused(host.load("tiny-flux", None, ended("LoadModel"),
                                                  parallel=ParallelPlan(ulysses_degree=2)))
    model = host.model
    assert model is not None and model.parallel is not None
    found["plan_after_load_model"] = model.parallel.plan
    found["after_load_model"] = await image(host)
    # The same LoadWeights with its caller still there changes the image: the refusals above were
    # not vacuous.
    await host.load_weights(str(weights), "", CallWatch("LoadWeights"))
    found["loaded"] = await image(host)
    return found


def serve(line: multiprocessing.connection.Connection, weights: Path, member: GroupMember) -> None:
    torch.set_num_threads(1)
    host = ModelHost(select_platform("cpu"), RunnerConfig(), member)
    if member.rank != 0:
        host.follow()
        return
    try:
        line.send(("ok", asyncio.run(scenario(host, weights))))
    except Exception as error:  # noqa: BLE001 - reported to the test
        line.send(("failed", repr(error)))
    finally:
        host.stop_group()


def rank0(line: multiprocessing.connection.Connection, weights: Path) -> None:
    launch(["cpu", "cpu"], functools.partial(serve, line, weights))


def test_a_call_that_ended_changes_nothing_on_any_rank_and_the_group_serves_on(tmp_path: Path) -> None:
    weight = FAMILIES["flux"].build().transformer.x_embedder.weight.detach()
    weights = tmp_path / "x_embedder.safetensors"
    save_file({"transformer.x_embedder.weight": (weight * 1.5).contiguous()}, str(weights))
    context = multiprocessing.get_context("spawn")
    line, rank0_line = context.Pipe()
    process = context.Process(target=rank0, args=(rank0_line, weights), name="rank-0")
    process.start()
    rank0_line.close()
    try:
        assert line.poll(DEADLINE_S), "the group did not report"
        status, found = line.recv()
        assert status == "ok", found
        process.join(DEADLINE_S)
        assert process.exitcode == 0  # no rank was left unable to undo: the group ended in order
    finally:
        if process.is_alive():
            process.kill()
    assert found["load_weights"] == found["sleep"] == found["load_model"] == "CANCELLED"
    assert found["after_load_weights"] == found["after_sleep"] == found["after_load_model"] == found["base"]
    assert found["plan_after_load_model"] == CFG
    assert found["loaded"] != found["base"]
