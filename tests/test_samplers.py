"""A request's sampler (GenerateRequest.sampler): each name of issue 39's table makes the image that
diffusers' own pipeline makes with that scheduler swapped in (``pipe.scheduler =
Cls.from_config(pipe.scheduler.config, **flags)``, the same seed), within 1/255, through the
pipeline call (request-level), through the step loop alone, and in a step batch beside a sequence
of another sampler, sharing its denoiser calls: on ``tiny`` (Stable Diffusion, every sampler of
the table) and on ``tiny-flux`` (flow matching: euler, unipc and dpmpp_2m with flow sigmas).
Served by a real worker and runner: the model's capabilities list its samplers, a request with
another name is INVALID_ARGUMENT naming ``sampler`` and listing them (over gRPC and as OpenAI's
400), requests of two samplers share a running step batch and each keeps its own image, and the
gRPC call, the Python client, the CLI and the HTTP API's ``extra_body`` pass it, the image's
parameters naming A1111's sampler."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Callable
from typing import Any, cast

import grpc
import numpy as np
import openai
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HeunDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    LCMScheduler,
    LMSDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)
from PIL import Image

from clients.client import DiffusionClient
from diffusion.v1 import worker_pb2
from runner_service.denoising.loop import SequenceSpec, max_sequence_length
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families import loop_for
from runner_service.models.catalog import ensure_builtin
from runner_service.pipeline_adapter import ImageRows, PipelineAdapter, adapt
from runner_service.step_engine import decode_finished
from serving_common.errors import field_violations
from serving_common.generation_params import GenerationParams
from support import cli

pytestmark = pytest.mark.process

CPU = torch.device("cpu")
SIZE = 32
STEPS = 4
# Issue 39's table: each name's diffusers scheduler and flags.
TABLE: dict[str, tuple[type, dict[str, Any]]] = {
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    "heun": (HeunDiscreteScheduler, {}),
    "lms": (LMSDiscreteScheduler, {}),
    "ddim": (DDIMScheduler, {}),
    "pndm": (PNDMScheduler, {}),
    "unipc": (UniPCMultistepScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {}),
    "dpmpp_2m_karras": (DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
    "dpmpp_2m_sde_karras": (DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++",
                                                          "use_karras_sigmas": True}),
    "dpm2": (KDPM2DiscreteScheduler, {}),
    "dpm2_a": (KDPM2AncestralDiscreteScheduler, {}),
    "lcm": (LCMScheduler, {}),
}
FLOW = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
FLOW_TABLE: dict[str, tuple[type, dict[str, Any]]] = {
    "euler": (FlowMatchEulerDiscreteScheduler, {}),
    "unipc": (UniPCMultistepScheduler, FLOW),
    "dpmpp_2m": (DPMSolverMultistepScheduler, FLOW),
}
# tiny-flux's scheduler shifts its sigmas by no image size, and its pipeline passes DPM-Solver a shift
# all the same, which it refuses (``test_tiny_flux_leaves_out_what_its_own_call_cannot_run``);
# tiny-sd3's runs all three.
TABLES = {"tiny": TABLE, "tiny-flux": {name: FLOW_TABLE[name] for name in ("euler", "unipc")},
          "tiny-sd3": FLOW_TABLE}
CASES = [(model, sampler) for model, table in TABLES.items() for sampler in table]


def uint8(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """Floats in [0, 1] (an array, or ``generate``'s host tensor) as uint8 by the host conversion."""
    floats = torch.as_tensor(images).float().numpy()  # as diffusers' pt_to_numpy left them
    return np.asarray((floats * 255).round().clip(0, 255).astype(np.uint8))


def difference(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.fixture(scope="module")
def models() -> Callable[[str], tuple[DiffusionPipeline, PipelineAdapter]]:
    """Each model's pipeline as the runner loads it (float32 on the CPU) and its adapter, loaded on first use."""
    loaded: dict[str, tuple[DiffusionPipeline, PipelineAdapter]] = {}

    def load(name: str) -> tuple[DiffusionPipeline, PipelineAdapter]:
        if name not in loaded:
            pipeline = DiffusionPipeline.from_pretrained(ensure_builtin(name, None), torch_dtype=torch.float32)
            pipeline.set_progress_bar_config(disable=True)
            loaded[name] = (pipeline, adapt(pipeline))
        return loaded[name]

    return load


def specs(model: str, sampler: str, partner: str) -> tuple[SequenceSpec, SequenceSpec]:
    """A guided image of ``sampler`` and an unguided one of ``partner`` with another prompt and seed
    (classifier-free guidance 7.5 against a negative prompt; tiny-flux: its distilled guidance)."""
    flux = model == "tiny-flux"
    return (SequenceSpec("a red fox", "" if flux else "blurry", SIZE, SIZE, STEPS, 3.5 if flux else 7.5, 11, (),
                         sampler=sampler),
            SequenceSpec("a green square", "", SIZE, SIZE, STEPS, 1.0, 12, (), sampler=partner))


def diffusers_image(model: str, pipeline: DiffusionPipeline, spec: SequenceSpec,
                    table: dict[str, tuple[type, dict[str, Any]]] | None = None) -> np.ndarray:
    """What diffusers' own call makes with the sampler's scheduler swapped in, as a caller of diffusers
    swaps it (and the T5 length the runner reads prompts at, for tiny-flux)."""
    own = pipeline.scheduler
    scheduler, flags = (table or TABLES[model])[spec.sampler]
    pipeline.scheduler = scheduler.from_config(own.config, **flags)
    negative = {} if model == "tiny-flux" else {"negative_prompt": [spec.negative_prompt]}
    try:
        with torch.inference_mode():
            images = pipeline(prompt=[spec.prompt], num_inference_steps=spec.steps, guidance_scale=spec.guidance,
                              generator=[torch.Generator("cpu").manual_seed(spec.seed)], width=spec.width,
                              height=spec.height, output_type="np", **negative,
                              **max_sequence_length(pipeline)).images
    finally:
        pipeline.scheduler = own
    return uint8(images)[0]


def test_each_model_offers_its_kinds_samplers(models):
    """A noise-prediction UNet whose pipeline scales its inputs offers the whole table; a flow-matching
    transformer the flow samplers its own call runs."""
    for model, table in TABLES.items():
        assert models(model)[1].canary().capabilities.samplers == tuple(table), model


def test_tiny_flux_leaves_out_what_its_own_call_cannot_run(models):
    pipeline = models("tiny-flux")[0]
    with pytest.raises(AssertionError):
        diffusers_image("tiny-flux", pipeline, SequenceSpec("a red fox", "", SIZE, SIZE, 1, 3.5, 1, (),
                                                            sampler="dpmpp_2m"), FLOW_TABLE)


@pytest.mark.parametrize(("model", "sampler"), CASES)
def test_a_sampler_makes_diffusers_image_alone_and_in_a_mixed_step_batch(models, model, sampler):
    """Through the pipeline call and the step loop alone, and stepped beside an image of the next
    sampler of the table (its own scheduler, its ancestral noise from its own generator): every
    denoiser call takes both while both run."""
    pipeline, adapter = models(model)
    names = list(TABLES[model])
    partner = names[(names.index(sampler) + 1) % len(names)]
    first, second = specs(model, sampler, partner)
    expected = [diffusers_image(model, pipeline, spec) for spec in (first, second)]

    with torch.inference_mode():
        called = uint8(adapter.generate(ImageRows.of(first.prompt, first.negative_prompt, [first.seed]),
                                        GenerationParams(width=SIZE, height=SIZE, num_inference_steps=STEPS,
                                                         guidance_scale=first.guidance, sampler=sampler),
                                        lambda done, total: None))[0]
    assert difference(called, expected[0]) <= 1, "pipeline call"
    assert type(pipeline.scheduler) is type(adapter.pipeline.scheduler)  # the call's own was put back

    loop = loop_for(pipeline, CPU)
    assert loop is not None
    with torch.inference_mode():
        alone = loop.start(first, PromptCache(), "v")
        while not alone.finished:
            loop.step([alone])
        assert difference(decode_finished(loop, [alone])[id(alone)], expected[0]) <= 1, "step loop, alone"

        calls = []
        hook = getattr(pipeline, loop.denoiser).register_forward_hook(lambda *_: calls.append(1))
        try:
            sequences = [loop.start(spec, PromptCache(), "v") for spec in (first, second)]
            assert sequences[0].scheduler is not sequences[1].scheduler
            decoded: dict[int, np.ndarray] = {}
            while not all(sequence.finished for sequence in sequences):
                loop.step(sequences)
                decoded.update(decode_finished(loop, [s for s in sequences if s.finished and id(s) not in decoded]))
        finally:
            hook.remove()
    assert len(calls) == max(sequence.total for sequence in sequences)  # one call per step for both
    for sequence, image in zip(sequences, expected, strict=True):
        assert difference(decoded[id(sequence)], image) <= 1, f"step batch: {sequence.spec.sampler}"


# -- served ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(serve, real_runner):
    """A worker serving tiny on the session's runner, with the HTTP API."""
    return serve(on=real_runner, http=True)


def request(sampler: str, seed: int, steps: int = STEPS, guidance: float = 7.5) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(prompt="a red fox", width=SIZE, height=SIZE, num_inference_steps=steps,
                                      guidance_scale=guidance, seed=seed, sampler=sampler)


def png_pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def png_parameters(data: bytes) -> str:
    with Image.open(io.BytesIO(data)) as image:
        return str(image.info["parameters"])


def test_the_capabilities_list_the_samplers_and_another_name_is_invalid_argument(stub, pair):
    status = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=30)
    assert tuple(status.model.capabilities.samplers) == tuple(TABLE)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request("dpmpp_3m", seed=1), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    why = field_violations(cast(grpc.Call, refused.value))["sampler"]
    assert "'dpmpp_3m'" in why and "euler, euler_a, heun" in why and "dpm2_a, lcm" in why

    with pytest.raises(openai.BadRequestError) as caught:
        openai.OpenAI(base_url=pair.base_url, api_key="unused", max_retries=0).images.generate(
            prompt="a red fox", size=f"{SIZE}x{SIZE}", extra_body={"sampler": "dpmpp_3m"})
    assert caught.value.status_code == 400 and caught.value.body["param"] == "sampler", caught.value.body
    assert "euler_a" in caught.value.body["message"]


def test_requests_of_two_samplers_share_a_running_step_batch_and_keep_their_images(stub, models):
    """The second request (of another sampler, unguided) joins the first's step batch on the runner
    and finishes while it runs; each image is diffusers' with its scheduler swapped in."""
    long_steps = 40  # what is left of them after the third is the time the short one has to join
    long, short = request("euler_a", seed=5, steps=long_steps), request("dpmpp_2m_sde_karras", seed=6, guidance=1.0)
    stepped, results = threading.Event(), {}

    def stream_long() -> None:
        for event in stub.GenerateStream(worker_pb2.GenerateStreamRequest(request=long), timeout=120):
            if event.HasField("progress") and event.progress.step >= 3:
                stepped.set()
            if event.HasField("done"):
                results["long"] = event.done
        stepped.set()

    thread = threading.Thread(target=stream_long, daemon=True)
    thread.start()
    assert stepped.wait(120)
    results["short"] = stub.Generate(short, timeout=120)
    assert "long" not in results, "the long request ended before the short one joined and left"
    thread.join(120)
    pipeline = models("tiny")[0]
    for name, sent in (("long", long), ("short", short)):
        spec = SequenceSpec(sent.prompt, "", SIZE, SIZE, sent.num_inference_steps, sent.guidance_scale, sent.seed,
                            (), sampler=sent.sampler)
        image = results[name].images[0].data
        assert difference(png_pixels(image), diffusers_image("tiny", pipeline, spec)) <= 1, name
    assert "Sampler: Euler a," in png_parameters(results["long"].images[0].data)
    assert results["short"].images[0].parameters["sampler"] == "DPM++ 2M SDE Karras"


def test_the_client_the_cli_and_the_http_api_pass_the_sampler(pair, tmp_path):
    with DiffusionClient(pair.worker.target) as client:
        made = client.generate("a red fox", width=SIZE, height=SIZE, steps=2, seed=3, sampler="heun")
    assert "Sampler: Heun," in png_parameters(made.images[0].data)

    output = tmp_path / "fox.png"
    done = cli("generate", "a red fox", "-o", str(output), "--width", str(SIZE), "--height", str(SIZE),
               "--steps", "2", "--sampler", "dpm2_a", env={"DIFFUSION_TARGET": pair.worker.target})
    assert done.returncode == 0, done.stderr
    assert "Sampler: DPM2 a," in png_parameters(output.read_bytes())

    sdk = openai.OpenAI(base_url=pair.base_url, api_key="unused", max_retries=0)
    answer = sdk.images.generate(prompt="a red fox", size=f"{SIZE}x{SIZE}",
                                 extra_body={"sampler": "lms", "num_inference_steps": 2, "seed": 3})
    assert answer.data[0].b64_json is not None
    assert "Sampler: LMS," in png_parameters(base64.b64decode(answer.data[0].b64_json))
