"""Step-level batching on a real runner process: a request joins a running batch at a step
boundary, at the batch's size or another, and leaves when its own steps are done, its image is
the one it gets alone and the one diffusers' own ``__call__`` makes, encoded prompts are cached,
and device operations and cancellation wait for or leave the batch without losing anything;
through a worker, a dropped stream leaves the runner's batch at its next step, however its
cancel falls among dispatches.
Every family with a step-level loop joins: SD, SDXL, SD3 and Flux (``tiny-flux``, with and without
true CFG, and the trained ``shapes``, whose guidance is true CFG)."""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from diffusion.v1 import runner_pb2, worker_pb2
from harness.processes import free_port, wait_until, worker_stub
from harness.streams import Stream
from runner_calls import execute, info, item, perturbed_weights, pixels, runner_stub
from runner_service.limits import BatchLimits
from runner_service.models.catalog import SHIPPED_MODELS, ensure_builtin
from support import running_pair
from tests.test_ops_metrics import scrape, value

SIZE = 32
# A size group of its own beside SIZE's: the smallest size every model here takes (tiny's).
SMALLER = 24
# The long request's steps: what is left of them after its third is the time the test has to send
# the joining ones (16 left too little on a loaded machine: the long one once finished first).
LONG_STEPS = 40
pytestmark = [pytest.mark.process, pytest.mark.slow]


class Models:
    """The session's shared runner, with the model a test asks for: LoadModel runs only where the
    module's last one loaded another model or a test changed its weights since (``changed``), so
    the tests of one model share a load. The tests are in the order that loads each model once."""

    def __init__(self, target: str) -> None:
        self.stub = runner_stub(target)
        self.loaded: str | None = None  # none yet: the module before may have left anything

    def load(self, model: str):
        if model != self.loaded:
            self.stub.LoadModel(runner_pb2.LoadModelRequest(source=model), timeout=120)
            self.loaded = model
        return self.stub

    def changed(self) -> None:
        """The loaded model's weights were changed: the next test loads it again."""
        self.loaded = None


@pytest.fixture(scope="module")
def models(shared_runner) -> Models:
    return Models(shared_runner.target)


class Execution:
    """One Execute in a thread: its progress steps and result, and an event per step seen."""

    def __init__(self, stub, *items: runner_pb2.ExecuteItem) -> None:
        self.call = stub.Execute(runner_pb2.ExecuteRequest(items=list(items), progress=True), timeout=120)
        self.steps: list[int] = []
        self.first_step_at = self.result_at = 0.0
        self.result: runner_pb2.ExecuteResult | None = None
        self.error: grpc.RpcError | None = None
        self.stepped = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                with self.stepped:
                    if response.HasField("progress"):
                        self.steps.append(response.progress.step)
                        self.first_step_at = self.first_step_at or time.monotonic()
                    else:
                        self.result, self.result_at = response.result, time.monotonic()
                    self.stepped.notify_all()
        except grpc.RpcError as error:
            self.error = error

    def wait_for_step(self, step: int) -> None:
        with self.stepped:
            assert self.stepped.wait_for(lambda: len(self.steps) >= step or self.result is not None, 60)

    def join(self) -> runner_pb2.ExecuteResult:
        self.thread.join(120)
        assert self.result is not None, self.error
        return self.result


def guidance_arguments(model: str, pipeline: Any, guidance: float,
                       true_cfg: float | None) -> dict[str, float]:
    """How a caller of diffusers passes a request's guidance (and true CFG) to the model. The
    shapes model, without a guidance embedding, has true CFG only, and its T5 reads 12 tokens:
    prompts padded to the call's default 512 would be ones it never saw."""
    if model == "shapes":
        return {"true_cfg_scale": guidance, "max_sequence_length": pipeline.tokenizer_2.model_max_length}
    return {"guidance_scale": guidance} | ({} if true_cfg is None else {"true_cfg_scale": true_cfg})


@pytest.fixture(scope="module")
def own_pipelines() -> Callable[[str], Any]:
    """Each model's diffusers pipeline in this process, in float32 as the runner loads it on a CPU
    (shapes ships in float16), loaded on first use (tiny-flux serves two tests)."""
    return functools.cache(lambda model: DiffusionPipeline.from_pretrained(
        ensure_builtin(model, None), torch_dtype=torch.float32))


def own_calls(pipeline: Any, model: str, *calls: tuple[int, int, float, float | None]) -> list[np.ndarray]:
    """The images diffusers' own pipeline call makes for each (seed, steps, guidance, true CFG), as uint8."""
    pipeline.set_progress_bar_config(disable=True)
    images = []
    for seed, steps, guidance, true_cfg in calls:
        with torch.inference_mode():
            image = pipeline(prompt=["a red fox"], negative_prompt=[""], num_inference_steps=steps,
                             generator=[torch.Generator("cpu").manual_seed(seed)], width=SIZE, height=SIZE,
                             output_type="np", **guidance_arguments(model, pipeline, guidance, true_cfg)).images[0]
        images.append((image * 255).round().clip(0, 255).astype(np.uint8))
    return images


def difference(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


SHAPES_TRAINED = (SHIPPED_MODELS["shapes"] / "model_index.json").exists()


@pytest.mark.parametrize(("model", "true_cfg"), [
    ("tiny-flux", None), pytest.param("tiny-flux", 3.0, id="tiny-flux-true-cfg"),
    pytest.param("shapes", None, marks=pytest.mark.skipif(not SHAPES_TRAINED, reason="shapes is not trained yet")),
    ("tiny-sdxl", None), ("tiny-sd3", None), ("tiny", None),
])
def test_a_request_joins_a_running_batch_and_keeps_its_own_image(models, own_pipelines, model, true_cfg):
    """The long request is guided (classifier-free; Flux: its true CFG where asked, with the
    distilled guidance 7.5 beside it; shapes: true CFG 7.5); the short one is not. A smaller one
    (guided) joins beside the short one at a step boundary, as a size group of its own (its own
    denoiser call in the same steps), instead of waiting for the batch to drain. Each image is the
    one it gets alone; the long and short ones are the ones diffusers' own call makes."""
    stub = models.load(model)
    assert info(stub).model.capabilities.step_batching
    true_cfg_field = {} if true_cfg is None else {"true_cfg_scale": true_cfg}
    long = item(seed=5, steps=LONG_STEPS, size=SIZE, request_id="long", **true_cfg_field)
    short = item(seed=6, steps=4, size=SIZE, request_id="short", guidance_scale=1.0)
    smaller = item(seed=7, steps=4, size=SMALLER, request_id="smaller")
    first = Execution(stub, long)
    first.wait_for_step(3)
    second, third = Execution(stub, short), Execution(stub, smaller)
    joined, joined_smaller = second.join(), third.join()
    # They joined while the long one ran and left when their own four steps were done.
    assert first.result is None and len(first.steps) < LONG_STEPS, first.steps
    assert second.steps == [1, 2, 3, 4] and third.steps == [1, 2, 3, 4], (second.steps, third.steps)
    together = first.join()
    assert first.steps == list(range(1, LONG_STEPS + 1))
    alone_long, alone_short, alone_smaller = (pixels(execute(stub, one)[1]) for one in (long, short, smaller))
    own_long, own_short = own_calls(own_pipelines(model), model, (5, LONG_STEPS, 7.5, true_cfg), (6, 4, 1.0, None))
    for name, served, alone, own in [("long", pixels(together), alone_long, own_long),
                                     ("short", pixels(joined), alone_short, own_short)]:
        assert difference(served, alone) <= 1, name
        assert difference(served, own) <= 1, name
    assert difference(pixels(joined_smaller), alone_smaller) <= 1


def test_the_same_batch_composition_is_bit_identical(models):
    stub = models.load("tiny")
    items = [item(seed=7, steps=5, size=SIZE, request_id="a"), item(seed=8, steps=5, size=SIZE, request_id="b")]
    first, second = execute(stub, *items)[1], execute(stub, *items)[1]
    for output in range(2):
        assert np.array_equal(pixels(first, output), pixels(second, output))


def test_a_cancelled_request_leaves_the_batch_and_the_others_finish(models):
    stub = models.load("tiny")
    staying = Execution(stub, item(seed=9, steps=12, size=SIZE, request_id="staying"))
    leaving = Execution(stub, item(seed=10, steps=12, size=SIZE, request_id="leaving"))
    leaving.wait_for_step(2)
    leaving.call.cancel()
    result = staying.join()
    leaving.thread.join(60)  # its reader ends with the cancel's error
    assert staying.steps == list(range(1, 13)) and len(leaving.steps) < 12
    assert leaving.error is not None and leaving.error.code() == grpc.StatusCode.CANCELLED
    assert difference(pixels(result), pixels(execute(stub, item(seed=9, steps=12, size=SIZE))[1])) <= 1


def test_the_batch_is_capped_by_max_batch_images(models):
    stub = models.load("tiny")
    # The default --max-batch-images (16): four requests of four images fill the batch, a fifth
    # request of one image waits for room.
    images = BatchLimits.max_batch_images // 4
    running = [Execution(stub, item(seed=s, steps=8, size=SIZE, num_images=images, request_id=f"cap-{s}"))
               for s in (1, 2, 3, 4)]
    for execution in running:
        execution.wait_for_step(1)
    waiting = Execution(stub, item(seed=5, steps=2, size=SIZE, request_id="cap-5"))
    assert waiting.join().outputs[0].images[0].seed == 5
    assert waiting.first_step_at >= min(e.join() and e.result_at for e in running)


def test_a_device_operation_waits_for_the_batch_to_drain(models):
    stub = models.load("tiny")
    running = [Execution(stub, item(seed=s, steps=8, size=SIZE, request_id=f"op-{s}")) for s in (1, 2)]
    for execution in running:
        execution.wait_for_step(1)
    later = Execution(stub, item(seed=3, steps=2, size=SIZE, request_id="op-3"))
    checksum = stub.GetWeightsChecksum(runner_pb2.RunnerServiceGetWeightsChecksumRequest(), timeout=60)
    # It ran between steps, once what had been admitted finished (their results may still be on
    # their way to this process's reader threads); what came later runs after it.
    assert checksum.checksum and all(e.join() and len(e.steps) == 8 for e in running)
    assert later.join().outputs[0].images[0].seed == 3 and later.steps == [1, 2]



def test_prompts_are_cached_and_new_weights_invalidate_them(models, tmp_path: Path):
    stub = models.load("tiny")
    before = info(stub).prompt_cache
    execute(stub, item(seed=1, steps=2, size=SIZE, prompt="a cached prompt"))
    execute(stub, item(seed=2, steps=2, size=SIZE, prompt="a cached prompt"))
    after = info(stub).prompt_cache
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    assert after.entries >= 1 and 0 < after.bytes <= after.max_bytes
    weights = tmp_path / "unet.safetensors"
    perturbed_weights(weights)
    models.changed()
    stub.LoadWeights(runner_pb2.RunnerServiceLoadWeightsRequest(path=str(weights)), timeout=60)
    execute(stub, item(seed=3, steps=2, size=SIZE, prompt="a cached prompt"))
    reloaded = info(stub).prompt_cache
    assert (reloaded.misses - after.misses, reloaded.hits - after.hits, reloaded.entries) == (1, 0, 1)

# The runner's log: each Execute it starts, and each request's end (the step it left at when its
# call ended, or the whole run).
EXECUTE_LINE = re.compile(r"execute \d+ request\(s\).*\[request_id=([^\]]+)\]$", re.M)
STOPPED_LINE = re.compile(r"stopped (\S+) after step (\d+): the call ended$", re.M)
EXECUTED_LINE = re.compile(r"executed in \d+ ms \[request_id=([^\]]+)\]$", re.M)
# Far more steps than pass while a dropped stream's cancel reaches the runner, on a loaded machine too
# (60 ran to their end once under CI's three test processes).
DROP_STEPS = 400


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A worker sending up to 4 images at a time to a runner that batches at steps, with its
    metrics on a port and the runner polled every 0.2 s (its prompt cache shows in the metrics)."""
    port = free_port()
    with running_pair(tmp_path_factory.mktemp("served"), "--max-batch-size", "4", "--metrics-port", str(port),
                      "--runner-poll-interval", "0.2") as pair, worker_stub(pair.worker.target) as stub:
        yield SimpleNamespace(runner=pair.runner, stub=stub, metrics=f"http://127.0.0.1:{port}/metrics")


def test_the_worker_sends_a_request_into_the_running_batch(served):
    """Through the worker: a short request sent while a long one runs finishes first, and the
    runner's prompt cache shows in the worker's metrics."""
    runner, worker_calls = served.runner, served.stub

    def request(request_id: str, steps: int) -> worker_pb2.GenerateRequest:
        return worker_pb2.GenerateRequest(request_id=request_id, prompt="a lantern", num_inference_steps=steps,
                                          width=SIZE, height=SIZE, seed=1, output_format=worker_pb2.OUTPUT_FORMAT_RAW)

    long = Stream(worker_calls, request("long", 40))
    long.wait_step(2)
    short = worker_calls.Generate(request("short", 2), timeout=60)
    assert long.done is None and short.images[0].seed == 1  # done while the long one runs
    long.finish()
    assert long.done is not None and long.done.images[0].seed == 1
    worker_calls.Generate(request("again", 2), timeout=60)
    samples = wait_until(lambda: (s := scrape(served.metrics)) and value(
        s, "diffusion_runner_prompt_cache_hits_total", target=runner.target) >= 2 and s, 10, "cache metrics")
    assert value(samples, "diffusion_runner_prompt_cache_misses_total", target=runner.target) >= 1
    assert value(samples, "diffusion_runner_prompt_cache_bytes", target=runner.target) > 0


def stream_request(request_id: str, steps: int, seed: int = 1, num_images: int = 1) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=request_id, prompt="a lantern", num_inference_steps=steps,
                                      width=64, height=64, seed=seed, num_images=num_images,
                                      output_format=worker_pb2.OUTPUT_FORMAT_RAW)


def runner_ends(runner, ids: list[str]) -> tuple[set[str], dict[str, list[int]], set[str]]:
    """Of ``ids``, from the runner's log: those it was sent, the steps each left at when its call
    ended (one entry per time), and those that ran to their end."""
    log, wanted = runner.log(), set(ids)

    def named(match: re.Match[str]) -> set[str]:
        return set(match.group(1).split(",")) & wanted

    sent = {i for m in EXECUTE_LINE.finditer(log) for i in named(m)}
    stopped: dict[str, list[int]] = {}
    for match in STOPPED_LINE.finditer(log):
        for request_id in named(match):
            stopped.setdefault(request_id, []).append(int(match.group(2)))
    finished = {i for m in EXECUTED_LINE.finditer(log) for i in named(m)}
    return sent, stopped, finished


def holds(stub, ids: list[str]) -> set[str]:
    """Which of ``ids`` the worker still holds (queued, running or being encoded)."""
    status = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    return {r.request_id for r in status.active_requests} & set(ids)


@pytest.mark.parametrize(("round_", "gap"), [(1, 0.0), (2, 0.0003), (3, 0.0003), (4, 0.001)])
def test_dropped_streams_stop_the_runner_whatever_the_interleaving(served, round_, gap):
    """Issue 20 item 6: twelve long streams, each read up to its first event, then dropped one
    after another in queue order. Their cancels fall while the worker dispatches the next ones (as
    room frees), writes them events, or the runner admits or steps them: each round spaces them
    differently. The worker lets go of every one, and each the runner got leaves its batch once, at
    a step boundary, never running to its end."""
    runner, stub = served.runner, served.stub
    ids = [f"drop-{round_}-{index}" for index in range(12)]
    streams = [Stream(stub, stream_request(request_id, DROP_STEPS, seed=index))
               for index, request_id in enumerate(ids)]
    for stream in streams:
        stream.wait_for("queued")
    for stream in streams:
        stream.call.cancel()
        time.sleep(gap)  # not a wait: spaces the cancels, so that dispatches fall between them
    for stream in streams:
        stream.join()
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED
    # Every Execute the runner got for them ends: each of its requests left, or (the bug) finished. The
    # log is read, the worker left alone: a call to it could collect what a lost cancel left behind.
    sent, stopped, finished = wait_until(
        lambda: (ends := runner_ends(runner, ids)) and ends[0] <= set(ends[1]) | ends[2] and ends[0] and ends,
        120, "every request the runner was sent to leave it")
    assert not finished, f"ran to the end although dropped: {sorted(finished)}"
    assert all(len(stopped[i]) == 1 and stopped[i][0] < DROP_STEPS for i in sent), stopped
    # The worker lets go of them too: its in-flight count falls as each call's close reaches it.
    wait_until(lambda: not holds(stub, ids) and stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
               .requests_in_flight == 0, 60, "the worker to hold none of them")
    print(f"round {round_}, gap {gap * 1000:g} ms: {len(sent)} of 12 reached the runner, "
          f"{sum(s[0] for s in stopped.values())} steps run in all")


def test_a_dropped_stream_leaves_the_step_batch_while_the_rest_of_its_batch_runs(served):
    """Three requests dispatched together (queued while a 4-image request takes the whole batch):
    one dropped leaves the runner's batch at the next step, the two others run to their end."""
    runner, stub = served.runner, served.stub
    steps = 30
    blocker = Stream(stub, stream_request("rest-blocker", 500, num_images=4))
    blocker.wait_for("progress")
    streams = {name: Stream(stub, stream_request(f"rest-{name}", steps, seed=seed))
               for seed, name in enumerate(["a", "dropped", "b"])}
    wait_until(lambda: stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).queue_depth == 3, 60,
               "the three queued")
    assert stub.Cancel(worker_pb2.CancelRequest(request_id="rest-blocker"), timeout=5).was == "running"
    for stream in streams.values():
        stream.wait_for("progress")
    with runner.frozen():  # the batch is still running when the stream is dropped
        streams["dropped"].call.cancel()
        wait_until(lambda: not holds(stub, ["rest-dropped"]), 30, "the worker to let go of the dropped one")
    for name in ("a", "b"):
        streams[name].finish(120)
        assert streams[name].done is not None and streams[name].kinds.count("progress") == steps, streams[name].error
    _, stopped, finished = runner_ends(runner, ["rest-dropped"])
    assert not finished and len(stopped["rest-dropped"]) == 1 and stopped["rest-dropped"][0] < steps, stopped
