"""Every diffusers text-to-image family through a real worker and runner, with the same guarantees.

Each text-to-image family's tiny random build (declared in ``runner_service.families``: the
configs of diffusers' own pipeline tests, tokenizers built in memory; built once per test run by
``fixtures_families``) is loaded with Init, which ends READY only after the
runner's one-step canary, and then checked: the exact size asked for, the same bytes for the same
seed, per-image seeds, one progress event per step, cancellation within a step, sleep and wake
(levels 1 and 2, partial) bit-identical, LoadWeights of the model's own files, the image
tasks it reports (image-to-image, inpainting) generating, an image refused where it reports none,
the size grid it reports being the one enforced, and true CFG where the pipeline takes it. The families
share one runner and one worker; the tests of one family run together (a module-scoped
parametrized fixture), so each family is loaded once. The video families (``Family.video``) are not
text-to-image families (``TEXT_TO_IMAGE`` leaves them out): ``test_video_families`` checks them.
"""

from __future__ import annotations

import base64
import io
import itertools
import re
from typing import cast

import grpc
import numpy as np
import openai
import pytest
from PIL import Image
from safetensors.torch import load_file, save_file

from diffusion.v1 import common_pb2, worker_pb2
from harness.processes import free_port, start_runner, start_worker, worker_stub
from harness.streams import Stream
from runner_service.families import FAMILIES, TEXT_TO_IMAGE
from serving_common.errors import field_violations
from support import cli

W = worker_pb2
STEPS = 2
# Far more steps than a cancelled request may run: at most a few steps pass between the progress
# event the test sees and the runner reading the cancellation.
LONG_STEPS = 400
# Batched kernels may round differently from single-image ones.
BATCH_TOLERANCE = 2

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(300)]
# The families whose pipeline takes true_cfg_scale, and its default there.
TRUE_CFG_FAMILIES = {"flux": 1.0, "qwen-image": 4.0}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def processes(tmp_path_factory, model_root, family_root):
    logs = tmp_path_factory.mktemp("family-logs")
    runner = start_runner(logs, "--model-root", str(model_root), "--model-root", str(family_root))
    port = free_port()
    worker = start_worker(logs, runner.target, "--model", "", "--http-port", str(port),
                          "--runner-keepalive", "0", ready=False)  # a frozen runner is not a lost one
    worker.extra.update(base_url=f"http://127.0.0.1:{port}/v1")
    yield runner, worker
    worker.stop()
    runner.stop()


@pytest.fixture(scope="module")
def stub(processes):
    with worker_stub(processes[1].target, warm=False) as stub:
        yield stub


class Family:
    """One family loaded in the worker: its name, directory, ModelInfo and a baseline image."""

    def __init__(self, name: str, directory, model: common_pb2.ModelInfo, stub) -> None:
        self.name, self.directory, self.model, self.stub = name, directory, model, stub
        self.size = max(8, model.min_size)  # the worker's --min-size is 8
        self.baseline = self.pixels(self.generate(seed=5))

    @property
    def total_steps(self) -> int:
        return STEPS * self.model.capabilities.stages

    def request(self, **fields) -> W.GenerateRequest:
        defaults = dict(prompt="a red fox in the snow", num_inference_steps=STEPS, width=self.size,
                        height=self.size, seed=5, output_format=W.OUTPUT_FORMAT_RAW)
        return W.GenerateRequest(**{**defaults, **fields})

    def generate(self, **fields) -> W.GenerateResponse:
        return self.stub.Generate(self.request(**fields), timeout=120)

    @property
    def separate_true_cfg(self) -> bool:
        """Whether true_cfg_scale is a scale of its own (Flux), not the guidance_scale (Qwen-Image)."""
        capabilities = self.model.capabilities
        return capabilities.true_cfg and capabilities.guidance != common_pb2.GUIDANCE_KIND_TRUE_CFG

    @staticmethod
    def pixels(response: W.GenerateResponse, index: int = 0) -> np.ndarray:
        image = response.images[index]
        return np.frombuffer(image.data, np.uint8).reshape(image.height, image.width, 3)


@pytest.fixture(scope="module", params=sorted(TEXT_TO_IMAGE))
def family(request, stub, family_directory) -> Family:
    name = request.param
    directory = family_directory(name)
    model = stub.Init(W.InitRequest(model=str(directory)), timeout=300).model
    return Family(name, directory, model, stub)


def test_init_reports_the_capabilities_the_adapter_found(family):
    model, capabilities = family.model, family.model.capabilities
    assert model.min_size == FAMILIES[family.name].smallest_size
    assert model.size_multiple >= 1 and model.min_size % model.size_multiple == 0
    assert capabilities.step_events and capabilities.stages in (1, 2)
    assert capabilities.guidance != common_pb2.GUIDANCE_KIND_UNSPECIFIED
    assert capabilities.default_guidance_scale > 0
    assert capabilities.true_cfg == (family.name in TRUE_CFG_FAMILIES)
    assert capabilities.default_true_cfg_scale == TRUE_CFG_FAMILIES.get(family.name, 0)
    # Its step loop passed the canary at load: its text-to-image requests join a running batch.
    assert capabilities.step_batching and common_pb2.TASK_TEXT_TO_IMAGE in capabilities.step_batching_tasks
    status = family.stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert status.state == W.WORKER_STATE_READY and status.model.capabilities == capabilities


def test_exact_size_and_the_same_bytes_for_the_same_seed(family):
    width, height = family.size, 2 * family.size
    if family.model.max_size:
        height = min(height, family.model.max_size // 8 * 8)
    response = family.generate(width=width, height=height)
    assert (response.images[0].width, response.images[0].height) == (width, height)
    assert family.pixels(response).shape == (height, width, 3)
    assert family.generate(width=width, height=height).images[0].data == response.images[0].data
    assert family.pixels(family.generate(seed=5)).tobytes() == family.baseline.tobytes()


def test_two_images_get_consecutive_seeds_each_as_alone(family):
    response = family.generate(seed=40, num_images=2)
    assert [image.seed for image in response.images] == [40, 41]
    assert response.images[0].data != response.images[1].data
    for index, seed in enumerate((40, 41)):
        alone = family.pixels(family.generate(seed=seed))
        difference = np.abs(family.pixels(response, index).astype(int) - alone.astype(int)).max()
        assert difference <= BATCH_TOLERANCE, (seed, difference)


def test_one_progress_event_per_step(family):
    stream = Stream(family.stub, family.request(request_id=f"progress-{family.name}"))
    rest = stream.finish(timeout=120)
    assert stream.error is None
    steps = [event.progress for event in stream.events if event.HasField("progress")]
    assert [(p.step, p.total_steps) for p in steps] == [(i, family.total_steps) for i in
                                                        range(1, family.total_steps + 1)]
    assert rest and rest[-1].HasField("done")


def picture(size: int) -> bytes:
    colours = np.random.RandomState(3).randint(0, 255, (4, 4, 3)).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(colours).resize((size, size)).save(buffer, "PNG")
    return buffer.getvalue()


def test_image_tasks_it_reports_generate_and_an_image_is_refused_otherwise(family):
    tasks = set(family.model.capabilities.tasks)
    image = picture(family.size)
    mask = io.BytesIO()
    Image.new("L", (family.size, family.size), 255).save(mask, "PNG")
    inputs = {common_pb2.TASK_IMAGE_TO_IMAGE: {"image": image},
              common_pb2.TASK_INPAINT: {"image": image, "mask_image": mask.getvalue()}}
    for task, fields in inputs.items():
        if task not in tasks:
            with pytest.raises(grpc.RpcError) as error:
                family.generate(**fields)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert set(field_violations(error.value)) & {"image", "mask_image"}, field_violations(error.value)
            continue
        # A strength of 0.5 of 4 steps runs 2 of them, in the pipeline derived from the loaded one.
        stream = Stream(family.stub, family.request(num_inference_steps=4, strength=0.5, **fields))
        stream.finish(timeout=120)
        assert stream.error is None, stream.error
        steps = [(event.progress.step, event.progress.total_steps) for event in stream.events
                 if event.HasField("progress")]
        assert steps == [(1, 2), (2, 2)]
        done = stream.done
        assert done is not None and (done.images[0].width, done.images[0].height) == (family.size, family.size)


def test_cancel_stops_the_runner_within_a_step(family, processes):
    runner = processes[0]
    request_id = f"cancel-{family.name}"
    stream = Stream(family.stub, family.request(request_id=request_id, num_inference_steps=LONG_STEPS))
    stream.wait_step(2)
    # Held in flight while the cancel reaches the worker: a family's tiny steps can take a few ms,
    # so on a fast (or briefly starved) path the whole run could otherwise end before it.
    with runner.frozen():
        seen = max(event.progress.step for event in stream.events if event.HasField("progress"))
        assert family.stub.Cancel(W.CancelRequest(request_id=request_id), timeout=5).was == "running"
    stream.finish()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED
    # The next request runs once the runner has stopped; it logged the step it stopped after.
    assert family.pixels(family.generate(seed=5)).tobytes() == family.baseline.tobytes()
    total = LONG_STEPS * family.model.capabilities.stages
    # Request-level: "stopped after step N of T"; step-level: "stopped <request ids> after step N: ...".
    stops = re.findall(rf"stopped (?:after step (\d+) of {total}\b|{request_id} after step (\d+):)", runner.log())
    stops = [int(whole or batched) for whole, batched in stops]
    assert stops, "the runner never said where it stopped"
    stopped = stops[-1]
    assert seen <= stopped < seen + 20, (seen, stopped)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_give_the_same_bytes(family, level):
    slept = family.stub.Sleep(W.SleepRequest(level=level), timeout=60)
    assert set(slept.sleeping_components) == {c.name for c in family.model.components}
    assert family.stub.WakeUp(W.WakeUpRequest(), timeout=120).sleeping_components == []
    assert family.pixels(family.generate(seed=5)).tobytes() == family.baseline.tobytes()


def test_partial_wake_then_full_wake_gives_the_same_bytes(family):
    names = sorted(c.name for c in family.model.components)
    family.stub.Sleep(W.SleepRequest(level=1), timeout=60)
    woke = family.stub.WakeUp(W.WakeUpRequest(tags=names[:1]), timeout=60)
    assert sorted(woke.sleeping_components) == names[1:]
    with pytest.raises(grpc.RpcError) as refused:
        family.generate()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    family.stub.WakeUp(W.WakeUpRequest(), timeout=60)
    assert family.pixels(family.generate(seed=5)).tobytes() == family.baseline.tobytes()


def test_load_weights_of_its_own_files_changes_nothing(family, model_root):
    """Each component's own safetensors, named ``<component>.<name as saved>``: any checkpoint names
    the module converts on load (Qwen-Image's text encoder) are converted here too."""
    for component in family.model.components:
        files = sorted((family.directory / component.name).glob("*.safetensors"))
        assert files, component.name
        saved = {}
        for file in files:
            saved.update(load_file(file))
        path = model_root / f"{family.name}-{component.name}-own.safetensors"
        save_file({f"{component.name}.{key}": value.contiguous() for key, value in saved.items()}, str(path))
        loaded = family.stub.LoadWeights(W.LoadWeightsRequest(path=str(path)), timeout=120)
        assert len(loaded.loaded_names) == len(saved), component.name
        assert all(name.startswith(f"{component.name}.") for name in loaded.loaded_names)
    assert family.pixels(family.generate(seed=5)).tobytes() == family.baseline.tobytes()


def refused(family: Family, **fields) -> dict[str, str]:
    """The field violations of a request the worker refuses."""
    with pytest.raises(grpc.RpcError) as error:
        family.generate(**fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value
    return field_violations(cast(grpc.Call, error.value))


def test_the_size_grid_it_reports_is_the_one_enforced(family):
    """A size on the reported grid, off the multiples of 8 where the grid allows one, generates at
    exactly that size; one off it is refused naming the same multiple."""
    multiple = family.model.size_multiple
    assert family.stub.GetStatus(W.GetStatusRequest(), timeout=5).model.size_multiple == multiple
    size = next(v for v in itertools.count(family.size) if v % multiple == 0 and (v % 8 or multiple % 8 == 0))
    assert not family.model.max_size or size <= family.model.max_size
    response = family.generate(width=size, height=size)
    assert (response.images[0].width, response.images[0].height) == (size, size)
    off = size + 1 if multiple > 1 else 7  # a grid of 1: below the worker's --min-size
    violations = refused(family, width=off)
    assert f"multiple of {multiple} from" in violations["width"], violations


def test_a_field_the_model_cannot_honour_is_refused_by_name(family):
    capabilities = family.model.capabilities
    if not capabilities.negative_prompt or (family.separate_true_cfg and capabilities.default_true_cfg_scale <= 1):
        assert "negative_prompt" in refused(family, negative_prompt="blurry")
    if not capabilities.true_cfg:
        assert "true_cfg_scale" in refused(family, true_cfg_scale=2)
    assert family.pixels(family.generate(seed=5)).tobytes() == family.baseline.tobytes()  # it goes on


def test_true_cfg_scale_where_the_pipeline_takes_it(family):
    """Flux: a true_cfg_scale above 1 guides against the negative prompt (empty when unset), which
    changes the image; a negative prompt without such a scale is nothing it can use. Qwen-Image:
    true_cfg_scale is its guidance_scale."""
    if not family.model.capabilities.true_cfg:
        pytest.skip("its pipeline takes no true_cfg_scale")
    if family.separate_true_cfg:
        against_empty = family.pixels(family.generate(true_cfg_scale=4))
        against_negative = family.pixels(family.generate(true_cfg_scale=4, negative_prompt="blurry"))
        assert len({family.baseline.tobytes(), against_empty.tobytes(), against_negative.tobytes()}) == 3
        assert "negative_prompt" in refused(family, true_cfg_scale=1, negative_prompt="blurry")
    else:
        as_guidance = family.pixels(family.generate(guidance_scale=3, negative_prompt="blurry"))
        as_true_cfg = family.pixels(family.generate(true_cfg_scale=3, negative_prompt="blurry"))
        assert as_true_cfg.tobytes() == as_guidance.tobytes() != family.baseline.tobytes()
        assert "true_cfg_scale" in refused(family, guidance_scale=2, true_cfg_scale=3)
    for bad in (-1, float("nan"), 1e9):
        assert "true_cfg_scale" in refused(family, true_cfg_scale=bad)


def test_true_cfg_reaches_the_runner_from_http_and_the_cli(family, processes, tmp_path):
    """The OpenAI ``extra_body`` field and ``diffusion generate --true-cfg-scale`` give the image
    the gRPC field gives, which true CFG changed."""
    if not family.separate_true_cfg:
        pytest.skip("true_cfg_scale is not a scale of its own here")
    worker = processes[1]
    expected = family.pixels(family.generate(true_cfg_scale=4, negative_prompt="blurry"))
    assert expected.tobytes() != family.baseline.tobytes()
    sdk = openai.OpenAI(base_url=worker.extra["base_url"], api_key="unused", max_retries=0, timeout=120)
    answer = sdk.images.generate(prompt="a red fox in the snow", size=f"{family.size}x{family.size}",  # type: ignore[arg-type]
                                 extra_body={"seed": 5, "num_inference_steps": STEPS, "negative_prompt": "blurry",
                                             "true_cfg_scale": 4})
    over_http = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json or ""))).convert("RGB"))
    assert over_http.tobytes() == expected.tobytes()
    out = tmp_path / "cli.png"
    result = cli("--target", worker.target, "generate", "a red fox in the snow", "-o", str(out), "--width",
                 str(family.size), "--height", str(family.size), "--steps", str(STEPS), "--seed", "5",
                 "--negative-prompt", "blurry", "--true-cfg-scale", "4")
    assert result.returncode == 0, result.stderr
    assert np.asarray(Image.open(out).convert("RGB")).tobytes() == expected.tobytes()


def test_different_true_cfg_scales_share_a_step_batch_each_at_its_own(family):
    """On a step-batched model, requests sent together with different true_cfg_scales run in one
    step batch, a negative row each at its own scale: each image is the one it gets alone."""
    if not (family.separate_true_cfg and family.model.capabilities.step_batching):
        pytest.skip("true_cfg_scale is not a scale of its own here, or the model is batched per request")
    fields = [dict(true_cfg_scale=scale, seed=index, negative_prompt="blurry") for index, scale in enumerate([4, 4, 2])]
    streams = [Stream(family.stub, family.request(request_id=f"step-cfg-{index}-{family.name}", **each))
               for index, each in enumerate(fields)]
    for stream, each in zip(streams, fields, strict=True):
        stream.finish(timeout=120)
        assert stream.error is None and stream.done is not None, stream.error
        alone = family.pixels(family.generate(**each))
        assert np.abs(family.pixels(stream.done).astype(int) - alone.astype(int)).max() <= BATCH_TOLERANCE
