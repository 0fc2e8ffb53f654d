"""ControlNets per request (issue 39 item 2), the runner's side: a ControlNet directory registered by
name (LoadAdapter, ADAPTER_KIND_CONTROLNET) steers the requests that name it, and each image equals
the one diffusers' own ControlNet pipeline (``StableDiffusionControlNetPipeline``,
``StableDiffusionXLControlNetPipeline``, ``StableDiffusion3ControlNetPipeline``,
``FluxControlNetPipeline``; the family's multi-ControlNet for several) makes from the same
components and seed, within 1/255: through the step loop alone, in a step batch beside a plain image
and an image of two other ControlNets at other scales and parts of the steps (one denoiser call per
step for all three), and through the request-level pipeline call; and from an input image
(``StableDiffusion[XL]ControlNetImg2ImgPipeline``, ``FluxControlNetImg2ImgPipeline``; diffusers has
none for SD3, whose image-to-image requests are refused controls). On ``tiny`` (Stable Diffusion),
``tiny-sdxl``, ``tiny-sd3`` and ``tiny-flux`` (with true CFG, whose negative row takes the positive
row's residuals), with the built-in ``tiny-controlnet``, ``tiny-sdxl-controlnet``,
``tiny-sd3-controlnet`` and ``tiny-flux-controlnet``. ``tiny-sd3``'s one transformer block is its
last, which SD3 adds no ControlNet residual to (``context_pre_only``): its tests run it with two
blocks (the same config and seed otherwise), so that the ControlNet shows. SD3's pipeline draws the
control image's VAE noise from torch's global generator: its reference is seeded as the runner
seeds it (``control_noise_seed``).

The store: a ControlNet of another family or a directory of another model is refused naming
``path``; the store keeps what fits in its bytes, evicting the least recently used unpinned one,
which loads again when named. Served by a real runner process: registered, listed, generating, a
request naming an unknown one FAILED_PRECONDITION naming ``controls[i].name`` (INVALID_ARGUMENT where
that name is a LoRA's), bounds refused
naming the field, a ControlNet's name in the LoRA field INVALID_ARGUMENT in the worker's words, a
ControlNet of another family refused naming ``path``, and a level-2 sleep frees it and wake
restores it. ``shapes`` (Flux without a guidance embedding, whose guidance is its true_cfg_scale)
with a ControlNet from an input image: guidance above 1 refused naming ``guidance_scale`` on both
batching paths, and at 1 both paths make one image.
"""

from __future__ import annotations

import inspect
import json
import shutil
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.models.controlnets.controlnet_flux import FluxControlNetModel, FluxMultiControlNetModel
from diffusers.models.controlnets.controlnet_sd3 import SD3MultiControlNetModel
from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.pipelines.controlnet.pipeline_controlnet import StableDiffusionControlNetPipeline
from diffusers.pipelines.controlnet.pipeline_controlnet_img2img import StableDiffusionControlNetImg2ImgPipeline
from diffusers.pipelines.controlnet.pipeline_controlnet_sd_xl import StableDiffusionXLControlNetPipeline
from diffusers.pipelines.controlnet.pipeline_controlnet_sd_xl_img2img import StableDiffusionXLControlNetImg2ImgPipeline
from diffusers.pipelines.controlnet_sd3.pipeline_stable_diffusion_3_controlnet import StableDiffusion3ControlNetPipeline
from diffusers.pipelines.flux.pipeline_flux_controlnet import FluxControlNetPipeline
from diffusers.pipelines.flux.pipeline_flux_controlnet_image_to_image import FluxControlNetImg2ImgPipeline
from PIL import Image

from diffusion.v1 import common_pb2, runner_pb2
from harness.processes import ServiceProcess, start_runner
from lora_files import make_lora
from runner_calls import execute, info, item, pixels, refused, runner_stub
from runner_service.adapter_stores import AdapterSource
from runner_service.controlnets import ControlNets, call_controls, control_violations, controlnet_kinds
from runner_service.denoising.controls import SequenceControl, control_image, control_noise_seed
from runner_service.denoising.loop import ImageSource, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families import loop_for
from runner_service.families.seeded import seeded
from runner_service.model_roots import ModelRoots
from runner_service.models.build import BUILT_CONTROLNET_NAMES
from runner_service.models.catalog import ensure_builtin
from runner_service.models.controlnets import BUILT_CONTROLNETS, save_controlnet
from runner_service.pipeline_adapter import ImageInputs, ImageRows, adapt
from runner_service.step_engine import decode_finished
from runner_service.weights import read_tensors
from serving_common.errors import ServiceError, field_violations
from serving_common.generation_params import GenerationParams

pytestmark = pytest.mark.process

CPU = torch.device("cpu")
SIZE = 32
STEPS = 4
GUIDANCE = 7.5
PIPELINES = {"tiny": StableDiffusionControlNetPipeline, "tiny-sdxl": StableDiffusionXLControlNetPipeline,
             "tiny-sd3": StableDiffusion3ControlNetPipeline, "tiny-flux": FluxControlNetPipeline}
MULTI = {"tiny": MultiControlNetModel, "tiny-sdxl": MultiControlNetModel, "tiny-sd3": SD3MultiControlNetModel,
         "tiny-flux": FluxMultiControlNetModel}
IMAGE_PIPELINES = {"tiny": StableDiffusionControlNetImg2ImgPipeline,
                   "tiny-sdxl": StableDiffusionXLControlNetImg2ImgPipeline, "tiny-flux": FluxControlNetImg2ImgPipeline}
# Flux's true CFG (a negative row) where it is on: the ControlNet reads the positive row alone.
TRUE_CFG = {"tiny-flux": 2.0}
STRENGTH = 0.6
CONTROLNET_OF = {model: name for name, model in BUILT_CONTROLNETS.items()}
MANY_BYTES = 1 << 30


def uint8(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """Floats in [0, 1] (an array, or ``generate``'s host tensor) as uint8 by the host conversion."""
    floats = torch.as_tensor(images).float().numpy()  # as diffusers' pt_to_numpy left them
    return np.asarray((floats * 255).round().clip(0, 255).astype(np.uint8))


def difference(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def condition(seed: int) -> Image.Image:
    """A conditioning image of random pixels."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))


def raw(image: Image.Image) -> runner_pb2.RawImage:
    return runner_pb2.RawImage(pixels=image.tobytes(), width=image.width, height=image.height, channels=3)


def store(max_bytes: int = MANY_BYTES) -> ControlNets:
    """A ControlNet store reading any path, as a runner without --model-root does."""
    roots = ModelRoots()
    return ControlNets(max_bytes, roots, partial(read_tensors, roots=roots, max_bytes=max_bytes))


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each built-in ControlNet written once, as ``diffusion-build-model`` writes it."""
    base = tmp_path_factory.mktemp("controlnets")
    return {name: save_controlnet(name, base / name) for name in BUILT_CONTROLNETS}


@pytest.fixture(scope="module")
def models() -> Callable[[str], Any]:
    """Each model's pipeline as the runner loads it (float32 on the CPU), loaded on first use."""
    loaded: dict[str, Any] = {}

    def load(name: str) -> Any:
        if name not in loaded:
            pipeline = DiffusionPipeline.from_pretrained(ensure_builtin(name, None), torch_dtype=torch.float32)
            if name == "tiny-sd3":  # two blocks: SD3 adds no ControlNet residual to its last
                transformer = seeded(lambda: SD3Transformer2DModel.from_config(
                    {**pipeline.transformer.config, "num_layers": 2}))
                pipeline = type(pipeline)(**{**pipeline.components, "transformer": transformer})
            pipeline.set_progress_bar_config(disable=True)
            loaded[name] = pipeline
        return loaded[name]

    return load


def diffusers_image(pipeline: Any, controlnet: torch.nn.Module | None, prompt: str, seed: int,
                    images: list[Image.Image], scales: list[float], starts: list[float], ends: list[float],
                    model: str) -> np.ndarray:
    """What diffusers' own ControlNet pipeline makes of the same components (the plain pipeline where none)."""
    arguments = dict(prompt=[prompt], negative_prompt=["blurry"], num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                     generator=[torch.Generator("cpu").manual_seed(seed)], width=SIZE, height=SIZE, output_type="np")
    if model in TRUE_CFG:
        arguments["true_cfg_scale"] = TRUE_CFG[model]
    torch.manual_seed(control_noise_seed(seed))  # SD3's control noise: from the global generator
    with torch.inference_mode():
        if controlnet is None:
            return uint8(pipeline(**arguments).images)[0]
        controlled = PIPELINES[model](**pipeline.components, controlnet=controlnet)
        controlled.set_progress_bar_config(disable=True)
        one = len(images) == 1
        name = "image" if model in ("tiny", "tiny-sdxl") else "control_image"
        return uint8(controlled(**arguments, **{name: images[0] if one else images},
                                controlnet_conditioning_scale=scales[0] if one else scales,
                                control_guidance_start=starts[0] if one else starts,
                                control_guidance_end=ends[0] if one else ends).images)[0]


def denoiser(pipeline: Any) -> torch.nn.Module:
    return getattr(pipeline, "unet", None) or pipeline.transformer


def test_the_built_in_controlnets_are_named_where_torch_is_not_imported():
    assert BUILT_CONTROLNET_NAMES == tuple(BUILT_CONTROLNETS)


@pytest.mark.parametrize("model", list(PIPELINES))
def test_a_controlnet_makes_diffusers_image_alone_in_a_mixed_step_batch_and_in_a_pipeline_call(
        models, directories, model):
    pipeline = models(model)
    nets = store()
    name = CONTROLNET_OF[model]
    nets.register(pipeline, AdapterSource(name, directories[name]))
    net = nets.require(pipeline, [name])[name]
    images = [condition(seed) for seed in (1, 2, 3)]
    # One ControlNet over every step; none; two (the same module twice, other images) at other scales over parts.
    cases = [
        ("a red fox", 11, [images[0]], [1.0], [0.0], [1.0]),
        ("a green square", 12, [], [], [], []),
        ("a blue circle", 13, images[1:], [0.5, 1.5], [0.25, 0.0], [0.75, 0.5]),
    ]
    expected = [diffusers_image(pipeline, None if not pictures else net if len(pictures) == 1
                                else MULTI[model]([net] * len(pictures)),
                                prompt, seed, pictures, scales, starts, ends, model)
                for prompt, seed, pictures, scales, starts, ends in cases]
    assert difference(expected[0], expected[1]) > 8  # the ControlNet changes the image

    def spec(prompt: str, seed: int, pictures: list[Image.Image], scales: list[float], starts: list[float],
             ends: list[float]) -> SequenceSpec:
        controls = tuple(SequenceControl(net, control_image(picture, SIZE, SIZE, pipeline.vae_scale_factor, CPU),
                                         scale, start, end)
                         for picture, scale, start, end in zip(pictures, scales, starts, ends, strict=True))
        return SequenceSpec(prompt, "blurry", SIZE, SIZE, STEPS, GUIDANCE, seed, (), TRUE_CFG.get(model, 0.0),
                            controls=controls)

    loop = loop_for(pipeline, CPU)
    assert loop is not None
    specs = [spec(*case) for case in cases]
    with torch.inference_mode():
        alone = loop.start(specs[0], PromptCache(), "v")
        while not alone.finished:
            loop.step([alone])
        assert difference(decode_finished(loop, [alone])[id(alone)], expected[0]) <= 1, "step loop, alone"

        calls = []
        hook = denoiser(pipeline).register_forward_hook(lambda *_: calls.append(1))
        try:
            sequences = [loop.start(each, PromptCache(), "v") for each in specs]
            while not all(sequence.finished for sequence in sequences):
                loop.step(sequences)
        finally:
            hook.remove()
        decoded = decode_finished(loop, sequences)
    assert len(calls) == STEPS  # the three share every denoiser call
    for index, sequence in enumerate(sequences):
        assert difference(decoded[id(sequence)], expected[index]) <= 1, f"step batch, image {index}"

    # Request level: the ControlNet pipeline derived from the model's, for a batch sharing its ControlNets.
    adapter = adapt(pipeline)
    prompt, seed, pictures, scales, starts, ends = cases[2]
    batch = [item(seed=seed, size=SIZE, steps=STEPS, prompt=prompt, negative_prompt="blurry",
                  controls=[runner_pb2.ExecuteControl(name=name, image=raw(picture), conditioning_scale=scale,
                                                      guidance_start=start, guidance_end=end)
                            for picture, scale, start, end in zip(pictures, scales, starts, ends, strict=True)])]
    controlled = call_controls(nets, adapter, "TEXT_TO_IMAGE", batch)
    assert controlled is not None
    with torch.inference_mode(), controlled.noise(CPU):
        called = uint8(controlled.adapter.generate(
            ImageRows.of(prompt, "blurry", [seed]),
            GenerationParams(width=SIZE, height=SIZE, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                             true_cfg_scale=TRUE_CFG.get(model)),
            lambda done, total: None, conditioning=controlled.arguments))[0]
    assert difference(called, expected[2]) <= 1, "pipeline call"


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux"])
def test_controlnets_of_other_depths_share_a_step_and_each_image_is_diffusers(models, directories, tmp_path, model):
    """A ControlNet of two (double) blocks beside the built-in one of one: their residual lists differ
    in length, so the call's are spread to one per transformer block as the transformer reads each
    (Flux's deeper one has no single blocks: that list comes from the built-in one alone)."""
    pipeline = models(model)
    nets = store()
    name = CONTROLNET_OF[model]
    nets.register(pipeline, AdapterSource(name, directories[name]))
    shallow: Any = nets.require(pipeline, [name])[name]
    config = {**shallow.config, "num_layers": 2, **({"num_single_layers": 0} if model == "tiny-flux" else {})}
    deeper = seeded(lambda: type(shallow).from_config(config))
    for part, parameter in deeper.named_parameters():  # their zero-initialized layers, drawn
        if part.startswith(("controlnet_", "pos_embed_input")):
            torch.nn.init.normal_(parameter, std=0.1)
    deeper.save_pretrained(tmp_path / "deeper", safe_serialization=True)
    nets.register(pipeline, AdapterSource("deeper", tmp_path / "deeper"))
    modules = nets.require(pipeline, [name, "deeper"])
    picture = condition(6)
    cases = [("a red fox", 31, modules[name]), ("a blue circle", 32, modules["deeper"])]
    expected = [diffusers_image(pipeline, net, prompt, seed, [picture], [1.0], [0.0], [1.0], model)
                for prompt, seed, net in cases]
    assert difference(expected[1], diffusers_image(pipeline, None, "a blue circle", 32, [], [], [], [], model)) > 8
    loop = loop_for(pipeline, CPU)
    assert loop is not None
    calls = []
    hook = denoiser(pipeline).register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.inference_mode():
            sequences = [loop.start(SequenceSpec(prompt, "blurry", SIZE, SIZE, STEPS, GUIDANCE, seed, (),
                                                 TRUE_CFG.get(model, 0.0), controls=(SequenceControl(
                                                     net, control_image(picture, SIZE, SIZE, pipeline.vae_scale_factor,
                                                                        CPU), 1.0, 0.0, 1.0),)),
                                    PromptCache(), "v") for prompt, seed, net in cases]
            while not all(sequence.finished for sequence in sequences):
                loop.step(sequences)
            decoded = decode_finished(loop, sequences)
    finally:
        hook.remove()
    assert len(calls) == STEPS
    for index, sequence in enumerate(sequences):
        assert difference(decoded[id(sequence)], expected[index]) <= 1, f"image {index}"


@pytest.mark.parametrize("model", list(IMAGE_PIPELINES))
def test_an_image_to_image_request_with_a_controlnet_makes_diffusers_image(models, directories, model):
    """From an input image at strength 0.6 (the shorter schedule the ControlNet's window is counted
    in), through the step loop and the request-level call, equal to diffusers' ControlNet
    image-to-image pipeline."""
    pipeline = models(model)
    nets = store()
    name = CONTROLNET_OF[model]
    nets.register(pipeline, AdapterSource(name, directories[name]))
    net = nets.require(pipeline, [name])[name]
    picture, start = condition(4), condition(5)
    cls = IMAGE_PIPELINES[model]
    taken = inspect.signature(cls.__init__).parameters  # Flux's takes no image encoder
    reference = cls(**{name: part for name, part in pipeline.components.items() if name in taken}, controlnet=net)
    reference.set_progress_bar_config(disable=True)
    negative = {} if model == "tiny-flux" else {"negative_prompt": ["blurry"]}  # Flux's takes no negative prompt
    with torch.inference_mode():
        expected = uint8(reference(
            prompt=["a red fox"], **negative, image=[start], control_image=picture, strength=STRENGTH,
            num_inference_steps=STEPS, guidance_scale=GUIDANCE, generator=[torch.Generator("cpu").manual_seed(21)],
            controlnet_conditioning_scale=1.0, control_guidance_start=0.25, width=SIZE, height=SIZE,
            output_type="np").images)[0]

    adapter = adapt(pipeline)
    loop = loop_for(pipeline, CPU)
    assert loop is not None
    control = SequenceControl(net, control_image(picture, SIZE, SIZE, pipeline.vae_scale_factor, CPU), 1.0, 0.25, 1.0)
    source = ImageSource("IMAGE_TO_IMAGE", adapter.for_task("IMAGE_TO_IMAGE").pipeline, start, STRENGTH)
    with torch.inference_mode():
        sequence = loop.start(SequenceSpec("a red fox", "blurry", SIZE, SIZE, STEPS, GUIDANCE, 21, (), source=source,
                                           controls=(control,)), PromptCache(), "v")
        while not sequence.finished:
            loop.step([sequence])
        assert difference(decode_finished(loop, [sequence])[id(sequence)], expected) <= 1, "step loop"

    batch = [item(seed=21, size=SIZE, steps=STEPS, prompt="a red fox", negative_prompt="blurry",
                  task=common_pb2.TASK_IMAGE_TO_IMAGE, strength=STRENGTH,
                  controls=[runner_pb2.ExecuteControl(name=name, image=raw(picture), conditioning_scale=1.0,
                                                      guidance_start=0.25, guidance_end=1.0)])]
    controlled = call_controls(nets, adapter, "IMAGE_TO_IMAGE", batch)
    assert controlled is not None
    with torch.inference_mode(), controlled.noise(CPU):
        called = uint8(controlled.adapter.generate(
            ImageRows.of("a red fox", "blurry", [21]),
            GenerationParams(width=SIZE, height=SIZE, num_inference_steps=STEPS, guidance_scale=GUIDANCE),
            lambda done, total: None, ImageInputs([start], None, STRENGTH), conditioning=controlled.arguments))[0]
    assert difference(called, expected) <= 1, "pipeline call"


def test_a_controlnet_of_another_model_is_refused_naming_path(models, directories, tmp_path):
    pipeline = models("tiny")
    nets = store()
    with pytest.raises(ServiceError) as refusal:
        nets.register(pipeline, AdapterSource("xl", directories["tiny-sdxl-controlnet"]))
    assert refusal.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(refusal.value.violations)["path"].count("cross_attention_dim")
    with pytest.raises(ServiceError) as refusal:
        nets.register(pipeline, AdapterSource("unet", ensure_builtin("tiny", None) / "unet"))
    assert refusal.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "UNet2DConditionModel, not a ControlNetModel" in dict(refusal.value.violations)["path"]
    assert not nets.registered


@pytest.mark.parametrize(("model", "change", "named"), [
    ("tiny-sd3", {"joint_attention_dim": 64}, "joint_attention_dim"),
    ("tiny-sd3", {"use_pos_embed": False}, "position embedding"),
    ("tiny-flux", {"guidance_embeds": False}, "guidance_embeds"),
    ("tiny-flux", {"num_mode": 4}, "union ControlNet"),
    ("tiny-flux", {"conditioning_embedding_channels": 16}, "hint block"),
])
def test_a_transformer_controlnet_that_does_not_fit_or_is_not_served_is_refused_naming_path(
        models, directories, tmp_path, model, change, named):
    """Read from its config alone, before its weights: another width or guidance embedding, or a kind
    the family's pipeline does not serve (SD3.5's without position embedding, Flux's union and XLabs')."""
    config = json.loads((directories[CONTROLNET_OF[model]] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    nets = store()
    with pytest.raises(ServiceError) as refusal:
        nets.register(models(model), AdapterSource("odd", tmp_path))
    assert refusal.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert named in dict(refusal.value.violations)["path"]
    with pytest.raises(ServiceError) as refusal:  # the other transformer family's
        nets.register(models(model), AdapterSource("other", directories[
            "tiny-flux-controlnet" if model == "tiny-sd3" else "tiny-sd3-controlnet"]))
    assert "not a" in dict(refusal.value.violations)["path"]
    assert not nets.registered


def test_an_sd3_image_to_image_request_takes_no_controlnets(models):
    """diffusers has no SD3 ControlNet pipeline from an input image: refused naming the controls."""
    picture = condition(1)
    control = runner_pb2.ExecuteControl(name="edges", image=raw(picture), conditioning_scale=1.0, guidance_end=1.0)
    request = item(seed=1, size=SIZE, steps=2, task=common_pb2.TASK_IMAGE_TO_IMAGE, strength=0.5, controls=[control])
    assert controlnet_kinds(models("tiny-sd3")) == controlnet_kinds(models("tiny-flux")) == [
        common_pb2.ADAPTER_KIND_CONTROLNET]  # ModelCapabilities.adapter_kinds lists them
    violations = dict(control_violations([request], models("tiny-sd3"), ()))
    assert "from text alone" in violations["items[0].controls"]
    assert not control_violations([item(seed=1, size=SIZE, steps=2, controls=[control])], models("tiny-sd3"), ())
    assert not control_violations([request], models("tiny-flux"), ())


def test_a_flux_image_to_image_request_with_controlnets_takes_no_true_cfg(models):
    """FluxControlNetImg2ImgPipeline takes no negative prompt nor true_cfg_scale: an image-to-image
    request with ControlNets whose true CFG is on (above 1, given or the model's default) is refused
    naming true_cfg_scale, on either path, rather than run without it."""
    control = runner_pb2.ExecuteControl(name="edges", image=raw(condition(1)), conditioning_scale=1.0,
                                        guidance_end=1.0)
    image = {"task": common_pb2.TASK_IMAGE_TO_IMAGE, "strength": 0.5, "image": raw(condition(2))}
    guided = item(seed=1, size=SIZE, steps=2, negative_prompt="blurry", true_cfg_scale=2.0, controls=[control],
                  **image)
    flux = models("tiny-flux")
    assert "takes no true CFG" in dict(control_violations([guided], flux, {}))["items[0].true_cfg_scale"]
    unset = item(seed=1, size=SIZE, steps=2, controls=[control], **image)
    assert "items[0].true_cfg_scale" in dict(control_violations([unset], flux, {}, default_true_cfg=2.0))
    assert not control_violations([unset], flux, {})  # Flux 1's default: off
    off = item(seed=1, size=SIZE, steps=2, negative_prompt="blurry", true_cfg_scale=1.0, controls=[control], **image)
    assert not control_violations([off], flux, {})
    from_text = item(seed=1, size=SIZE, steps=2, negative_prompt="blurry", true_cfg_scale=2.0, controls=[control])
    assert not control_violations([from_text], flux, {})  # FluxControlNetPipeline takes it


def test_the_store_evicts_the_least_recently_used_by_bytes_and_loads_it_again(models, directories, tmp_path):
    pipeline = models("tiny")
    source = directories["tiny-controlnet"]
    paths = {name: Path(shutil.copytree(source, tmp_path / name)) for name in ("first", "second")}
    measured = store()
    size = measured.register(pipeline, AdapterSource("probe", source)).parameter_bytes
    nets = store(max_bytes=size * 3 // 2)  # one fits
    nets.register(pipeline, AdapterSource("first", paths["first"]))
    nets.register(pipeline, AdapterSource("second", paths["second"]))
    assert [net.name for net in nets.registered.values() if net.resident] == ["second"]
    again = nets.require(pipeline, ["first"])["first"]  # loads again from its path, evicting "second"
    assert [net.name for net in nets.registered.values() if net.resident] == ["first"]
    reference = measured.require(pipeline, ["probe"])["probe"]
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), reference.parameters(), strict=True))

    nets.register(pipeline, AdapterSource("first", paths["first"], pin=True))  # pinned: never evicted
    with pytest.raises(ServiceError) as refusal:
        nets.require(pipeline, ["second"])
    assert refusal.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    nets.unregister(pipeline, "first")
    assert nets.require(pipeline, ["second"])["second"] is not None


# -- served -----------------------------------------------------------------------------------------


def control(name: str, picture: Image.Image, **fields: float) -> runner_pb2.ExecuteControl:
    return runner_pb2.ExecuteControl(name=name, image=raw(picture), conditioning_scale=fields.get("scale", 1.0),
                                     guidance_start=fields.get("start", 0.0), guidance_end=fields.get("end", 1.0))


def test_served_a_registered_controlnet_steers_its_requests_and_sleeps_with_the_model(
        shared_runner, models, directories, tmp_path):
    stub = shared_runner.load("tiny")
    path = str(directories["tiny-controlnet"])
    request = runner_pb2.RunnerServiceLoadAdapterRequest(name="edges", path=path,
                                                         kind=common_pb2.ADAPTER_KIND_CONTROLNET)
    try:
        registered = stub.LoadAdapter(request, timeout=120)
        assert registered.adapter.kind == common_pb2.ADAPTER_KIND_CONTROLNET and registered.adapter.resident
        assert registered.adapter.parameter_bytes > 0 and len(registered.adapter.digest) == 64
        assert [a.name for a in registered.info.adapters if a.kind == common_pb2.ADAPTER_KIND_CONTROLNET] == ["edges"]
        assert common_pb2.ADAPTER_KIND_CONTROLNET in registered.info.model.capabilities.adapter_kinds

        picture = condition(1)
        controlled = item(seed=11, size=SIZE, steps=STEPS, prompt="a red fox", negative_prompt="blurry",
                          guidance_scale=GUIDANCE, controls=[control("edges", picture)])
        plain = item(seed=12, size=SIZE, steps=STEPS, prompt="a green square", negative_prompt="blurry",
                     guidance_scale=GUIDANCE, request_id="plain")
        made = pixels(execute(stub, controlled)[1])
        pipeline = models("tiny")
        net = store()
        net.register(pipeline, AdapterSource("edges", directories["tiny-controlnet"]))
        expected = diffusers_image(pipeline, net.require(pipeline, ["edges"])["edges"], "a red fox", 11, [picture],
                                   [1.0], [0.0], [1.0], "tiny")
        assert difference(made, expected) <= 1
        assert difference(pixels(execute(stub, plain)[1]),
                          diffusers_image(pipeline, None, "a green square", 12, [], [], [], [], "tiny")) <= 1

        unknown = item(seed=1, size=SIZE, steps=2, controls=[control("nobody", picture)])
        error = refused(lambda r, **kw: list(stub.Execute(r, **kw)), runner_pb2.ExecuteRequest(items=[unknown]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "items[0].controls[0].name" in field_violations(error)
        bounds = item(seed=1, size=SIZE, steps=2, controls=[control("edges", picture, scale=3.0, start=0.5, end=0.5)])
        error = refused(lambda r, **kw: list(stub.Execute(r, **kw)), runner_pb2.ExecuteRequest(items=[bounds]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert {"items[0].controls[0].conditioning_scale", "items[0].controls[0].guidance_start"} <= set(
            field_violations(error))
        stub.LoadAdapter(runner_pb2.RunnerServiceLoadAdapterRequest(
            name="style", path=str(make_lora(tmp_path / "style.safetensors", seed=1))), timeout=60)
        lora = item(seed=1, size=SIZE, steps=2, controls=[control("style", picture)])
        error = refused(lambda r, **kw: list(stub.Execute(r, **kw)), runner_pb2.ExecuteRequest(items=[lora]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(error)["items[0].controls[0].name"] == (
            "'style' is registered as a LoRA, not as a ControlNet")
        as_lora = item(seed=1, size=SIZE, steps=2, adapters=[common_pb2.AdapterRef(name="edges")])
        error = refused(lambda r, **kw: list(stub.Execute(r, **kw)), runner_pb2.ExecuteRequest(items=[as_lora]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # the worker's words (test_conditioning_worker)
        assert field_violations(error)["items[0].adapters[0].name"] == (
            "'edges' is a ControlNet, not a LoRA: name it in controls")
        wrong = runner_pb2.RunnerServiceLoadAdapterRequest(name="xl", path=str(directories["tiny-sdxl-controlnet"]),
                                                           kind=common_pb2.ADAPTER_KIND_CONTROLNET)
        error = refused(stub.LoadAdapter, wrong, timeout=60)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "path" in field_violations(error)

        asleep = stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=2), timeout=120).info
        assert [a.resident for a in asleep.adapters if a.name == "edges"] == [False]
        awake = stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest(), timeout=120).info
        assert [a.resident for a in awake.adapters if a.name == "edges"] == [True]
        assert difference(pixels(execute(stub, controlled)[1]), made) == 0
    finally:
        for name in {"edges", "style"} & {adapter.name for adapter in info(stub).adapters}:
            stub.UnloadAdapter(runner_pb2.RunnerServiceUnloadAdapterRequest(name=name), timeout=60)
    assert not info(stub).adapters


@pytest.fixture(scope="module")
def request_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A runner that runs each Execute as one pipeline call (``--batching request``)."""
    process = start_runner(tmp_path_factory.mktemp("request-runner"), "--batching", "request")
    try:
        yield process
    finally:
        process.stop()


def test_served_a_flux_image_to_image_request_with_controlnets_and_true_cfg_is_refused_not_run_without_it(
        request_runner, directories):
    """The request-level path ran FluxControlNetImg2ImgPipeline, which takes no true CFG: the image
    came back equal to the one without it. It is refused INVALID_ARGUMENT naming true_cfg_scale;
    without true CFG (nor the negative prompt Flux uses only with it) the same request runs."""
    stub = runner_stub(request_runner.target)
    stub.LoadModel(runner_pb2.LoadModelRequest(source="tiny-flux"), timeout=120)
    stub.LoadAdapter(runner_pb2.RunnerServiceLoadAdapterRequest(
        name="edges", path=str(directories["tiny-flux-controlnet"]), kind=common_pb2.ADAPTER_KIND_CONTROLNET),
        timeout=120)
    fields = dict(seed=21, size=SIZE, steps=2, prompt="a red fox", task=common_pb2.TASK_IMAGE_TO_IMAGE,
                  strength=STRENGTH, image=raw(condition(5)), controls=[control("edges", condition(4))])
    guided = item(**fields, negative_prompt="blurry", true_cfg_scale=2.0)
    error = refused(lambda r, **kw: list(stub.Execute(r, **kw)), runner_pb2.ExecuteRequest(items=[guided]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "takes no true CFG" in field_violations(error)["items[0].true_cfg_scale"]
    made = pixels(execute(stub, item(**fields))[1])
    assert made.shape == (SIZE, SIZE, 3)


@pytest.fixture(scope="module")
def shapes_controlnet(models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ControlNet for ``shapes`` (Flux without a guidance embedding: its guidance travels as
    true_cfg_scale), built from its transformer as ``tiny-flux-controlnet`` is, seeded."""
    transformer = models("shapes").transformer
    config = transformer.config
    net = seeded(lambda: FluxControlNetModel.from_transformer(
        transformer, num_layers=1, num_single_layers=1, attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads, load_weights_from_transformer=False))
    path = tmp_path_factory.mktemp("shapes-controlnet")
    net.save_pretrained(path, safe_serialization=True)
    return path


def test_served_a_shapes_image_to_image_request_with_controlnets_and_guidance_is_refused_on_both_paths(
        request_runner, shared_runner, shapes_controlnet):
    """``shapes`` (Flux without a guidance embedding) takes its guidance as true_cfg_scale, which
    FluxControlNetImg2ImgPipeline does not take: the request-level path failed INTERNAL (a TypeError)
    even at guidance 1, and the step loop ran it guided. Guidance above 1 is refused INVALID_ARGUMENT
    naming guidance_scale on both paths; at 1 (off) both run, unguided, to the same image."""
    stubs = [runner_stub(runner.target) for runner in (request_runner, shared_runner)]
    fields = dict(seed=21, size=SIZE, steps=2, prompt="a red circle", task=common_pb2.TASK_IMAGE_TO_IMAGE,
                  strength=STRENGTH, image=raw(condition(5)), controls=[control("edges", condition(4))])
    made = []
    for stub in stubs:
        stub.LoadModel(runner_pb2.LoadModelRequest(source="shapes"), timeout=120)
        stub.LoadAdapter(runner_pb2.RunnerServiceLoadAdapterRequest(
            name="edges", path=str(shapes_controlnet), kind=common_pb2.ADAPTER_KIND_CONTROLNET), timeout=120)
        try:
            guided = item(**fields, negative_prompt="blurry", guidance_scale=4.0)
            error = refused(lambda r, run=stub.Execute, **kw: list(run(r, **kw)),
                            runner_pb2.ExecuteRequest(items=[guided]))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "takes no true CFG" in field_violations(error)["items[0].guidance_scale"]
            made.append(pixels(execute(stub, item(**fields, guidance_scale=1.0))[1]))
        finally:
            stub.UnloadAdapter(runner_pb2.RunnerServiceUnloadAdapterRequest(name="edges"), timeout=60)
    assert difference(*made) <= 1
