"""Drives any diffusers text-to-image pipeline the same way, from its call signature.

Families differ in what their ``__call__`` takes: PixArt has only the legacy ``callback`` (a
``callback_on_step_end`` disappears into ``**kwargs``), Flux's ``guidance_scale`` is a distilled
embedding, with "true" classifier-free guidance (``true_cfg_scale`` and a negative prompt) beside
it, and Qwen-Image's classifier-free guidance is ``true_cfg_scale``, Wuerstchen runs a prior
and a decoder with their own guidance and steps, HunyuanDiT, PixArt and Sana snap sizes to
resolution bins unless told not to, and a T5 trained on short prompts needs a shorter
``max_sequence_length`` than the call's default. ``adapt`` reads one pipeline's signature and config once, at
load; ``PipelineAdapter.generate`` then calls it with every family's own names, and checks that
the images have the size asked for. What it found is the model's ``Capabilities``, which the
worker validates requests against. What no signature says (a pipeline that rounds sizes itself)
comes from the family registry, ``runner_service.families``.

A pipeline whose call takes ``num_frames`` makes videos (Wan): it serves TEXT_TO_VIDEO, or
IMAGE_TO_VIDEO where its call also takes an image, and its ``Capabilities.video`` holds its frame
grid; ``generate`` then returns one video per prompt.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.auto_pipeline import (
    AUTO_IMAGE2IMAGE_PIPELINES_MAPPING,
    AUTO_INPAINT_PIPELINES_MAPPING,
    AUTO_TEXT2IMAGE_PIPELINES_MAPPING,
    AutoPipelineForImage2Image,
    AutoPipelineForInpainting,
    AutoPipelineForText2Image,
)
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from PIL import Image

from diffusion.v1 import common_pb2
from runner_service.denoising.loop import max_sequence_length
from runner_service.device_output import channels_last
from runner_service.families import family_of
from runner_service.families.record import VideoGrid
from runner_service.samplers import offered, schedule_runs, scheduler_for
from serving_common.errors import failed_precondition, invalid_argument
from serving_common.generation_params import GenerationParams

logger = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None]  # called with the steps done (1-based) and in all after every step
# Called with the steps done, in all, and the latents (n x C x h x w) after every denoising step.
LatentsCallback = Callable[[int, int, torch.Tensor], None]

# Sizes are probed up to this many multiples of the VAE's grid when looking for the pipeline's own.
_GRID_PROBES = 64
# The size grid of a pipeline without a VAE scale factor to derive one from: the usual VAE's 8.
DEFAULT_SIZE_MULTIPLE = 8
# The frame rates a video may be encoded at: a property of the container only, so any rate a player
# shows; a video family without a record of its own is encoded at DEFAULT_FPS.
MIN_FPS, MAX_FPS, DEFAULT_FPS = 1, 60, 16


# The call argument the request's guidance_scale goes to, per kind.
_GUIDANCE_ARGUMENT = {
    common_pb2.GUIDANCE_KIND_CLASSIFIER_FREE: "guidance_scale",  # against the negative prompt
    common_pb2.GUIDANCE_KIND_DISTILLED: "guidance_scale",  # feeds a guidance embedding (Flux dev); one pass
    common_pb2.GUIDANCE_KIND_TRUE_CFG: "true_cfg_scale",  # a second pass against the negative prompt (Qwen-Image)
    common_pb2.GUIDANCE_KIND_PRIOR: "prior_guidance_scale",  # a prior + decoder pipeline's prior (Wuerstchen)
}


@dataclass(frozen=True)
class VideoRange:
    """The frames a video model makes: frame_step x k + 1 of them, from min_frames up to max_frames
    (0: no limit of the model's own), and the frame rate its videos are encoded at by default."""

    frame_step: int
    min_frames: int
    max_frames: int
    default_frames: int  # its call's num_frames default
    default_fps: int
    min_fps: int = MIN_FPS
    max_fps: int = MAX_FPS


@dataclass(frozen=True)
class Capabilities:
    """What one pipeline can honour (reported in ModelInfo.capabilities and min/max/multiple sizes)."""

    negative_prompt: bool  # with true_cfg: used only when the true CFG scale is above 1
    guidance: common_pb2.GuidanceKind  # how the request's guidance_scale reaches the pipeline
    default_guidance: float
    step_callback: str  # "callback_on_step_end", "callback" or ""
    stages: int  # denoising stages per request, each num_inference_steps long
    min_size: int
    size_multiple: int  # what widths and heights must be multiples of, enforced as it is by worker and runner
    max_size: int  # 0: no limit of the model's own
    tasks: tuple[str, ...] = ("TEXT_TO_IMAGE",)  # the protocol's Task names, without the prefix
    # The call takes ``true_cfg_scale`` (Flux, Qwen-Image), and its default there (Flux 1: off).
    true_cfg: bool = False
    default_true_cfg: float = 0.0
    video: VideoRange | None = None  # a video model's frames; None: it makes images
    max_steps: int = 0  # the most num_inference_steps its schedulers run (``scheduler_max_steps``); 0: no limit found
    samplers: tuple[str, ...] = ()  # what a request's sampler may name (``samplers.offered``)

    @property
    def separate_true_cfg(self) -> bool:
        """Whether ``true_cfg_scale`` is a request's own (Flux), not where its guidance_scale goes
        (Qwen-Image, GUIDANCE_KIND_TRUE_CFG)."""
        return self.true_cfg and self.guidance != common_pb2.GUIDANCE_KIND_TRUE_CFG

    @property
    def step_events(self) -> bool:
        return bool(self.step_callback)

    def total_steps(self, steps: int) -> int:
        return self.stages * steps


class OutputSizeMismatch(Exception):
    """The pipeline made images of another size than asked for; they are never returned."""


def short_reason(error: BaseException, limit: int = 200) -> str:
    """An exception in one short line: its type and the first line of its message (some pipeline
    errors quote their whole config)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class ImageInputs:
    """The image inputs of a batch, one per image generated: what image-to-image, inpainting and
    edit pipelines take (``strength``: None for an edit)."""

    images: list[Image.Image]
    masks: list[Image.Image] | None = None
    strength: float | None = None


@dataclass(frozen=True)
class ImageRows:
    """The images of one pipeline call, one entry each: its prompt, negative prompt and generator."""

    prompts: list[str]
    negative_prompts: list[str]
    generators: list[torch.Generator]

    @classmethod
    def of(cls, prompt: str, negative_prompt: str, seeds: list[int]) -> ImageRows:
        """One image of ``prompt`` per seed, each with its own CPU generator."""
        return cls([prompt] * len(seeds), [negative_prompt] * len(seeds),
                   [torch.Generator("cpu").manual_seed(seed) for seed in seeds])


@dataclass
class PipelineAdapter:
    pipeline: DiffusionPipeline
    capabilities: Capabilities
    _parameters: frozenset[str]  # what its __call__ takes
    _fixed: dict[str, Any]  # arguments every call gets (resolution binning off, legacy callback_steps)
    # What the call asks for: "pt" (images left on the device) where its family's record says that is
    # its "np" output before the conversion to numpy (``output_type_of``), else "np".
    output_type: str = "np"
    _derived: dict[str, PipelineAdapter] = field(default_factory=dict, compare=False)

    def for_task(self, task: str) -> PipelineAdapter:
        """The adapter serving ``task``: this one, or for image-to-image and inpainting a pipeline
        derived with diffusers' ``from_pipe`` on first use, sharing this one's modules (so sleep,
        LoadWeights and adapters apply to it too, and the weights are never copied)."""
        if task not in self.capabilities.tasks:
            raise invalid_argument({"task": f"{type(self.pipeline).__name__} serves {list(self.capabilities.tasks)}, "
                                            f"not {task}"})
        if task not in _AUTO_PIPELINES:
            return self
        derived = self._derived.get(task)
        if derived is None:
            derived = self._adapter_of(_AUTO_PIPELINES[task].from_pipe(self.pipeline))
            self._derived[task] = derived
            logger.info("derived %s from %s for %s, sharing its modules", type(derived.pipeline).__name__,
                        type(self.pipeline).__name__, task)
        return derived

    def with_controlnet(self, task: str, controlnet: torch.nn.Module) -> PipelineAdapter:
        """The adapter of this pipeline's ControlNet pipeline for ``task`` (diffusers' auto pipelines'
        ``from_pipe`` with ``controlnet``: ``StableDiffusionControlNetPipeline``, its image-to-image
        sibling, SDXL's), sharing this one's modules; made for one call, whose ControlNets it holds."""
        return self._adapter_of(_AUTO_PIPELINES.get(task, AutoPipelineForText2Image).from_pipe(
            self.pipeline, controlnet=controlnet))

    @property
    def control_image_argument(self) -> str:
        """Where a ControlNet pipeline's call takes its conditioning images: ``image`` from text alone,
        ``control_image`` beside an input image."""
        return "control_image" if "control_image" in self._parameters else "image"

    def _adapter_of(self, pipeline: DiffusionPipeline) -> PipelineAdapter:
        """The adapter of a pipeline derived from this one's (its call's conventions read again)."""
        pipeline.set_progress_bar_config(disable=True)  # type: ignore[no-untyped-call]  # diffusers leaves it untyped
        parameters = inspect.signature(pipeline.__call__).parameters
        step_callback, fixed = _call_conventions(pipeline, parameters)
        # What its call takes of this one's: FluxControlNetImg2ImgPipeline's takes no negative prompt nor true CFG
        # (a request with true CFG on is refused before it, ``controlnets.control_violations``), so where the
        # guidance is true CFG (``shapes``: Flux without a guidance embedding) it goes unguided, as diffusers does.
        guidance = self.capabilities.guidance
        if guidance != common_pb2.GUIDANCE_KIND_NONE and _GUIDANCE_ARGUMENT[guidance] not in parameters:
            guidance = common_pb2.GUIDANCE_KIND_NONE
        capabilities = replace(self.capabilities, step_callback=step_callback, guidance=guidance,
                               negative_prompt=self.capabilities.negative_prompt and "negative_prompt" in parameters,
                               true_cfg=self.capabilities.true_cfg and "true_cfg_scale" in parameters)
        return PipelineAdapter(pipeline, capabilities, frozenset(parameters), fixed, self.output_type)

    def generate(self, rows: ImageRows, call: GenerationParams, on_step: StepCallback,
                 inputs: ImageInputs | None = None, on_latents: LatentsCallback | None = None,
                 conditioning: Mapping[str, Any] | None = None) -> torch.Tensor:
        """Images (n x height x width x 3 floats in [0, 1]; on the device where ``output_type`` is
        "pt": the caller converts and copies them, ``device_output``) of ``rows`` with what ``call``
        says of the whole call (its shared fields: size, steps, guidance_scale, true_cfg_scale where
        separate and set, num_frames), calling ``on_step`` with the steps done and in all after every
        denoising step of every stage (an exception it raises stops the run). A video model makes videos of
        ``num_frames`` instead, n x num_frames x height x width x 3 (its call takes one input image:
        the first). ``on_latents`` (a single-stage image model's) sees the latents before each
        ``on_step``, unpacked where the family packs them (``unpacked_latents``). ``conditioning``: more
        arguments of the call (an IP-Adapter's image embeddings, ``ip_adapters.IpAdapterSet.pipeline_call``)."""
        capabilities = self.capabilities
        width, height, steps, num_frames = call.width, call.height, call.num_inference_steps, call.num_frames
        arguments: dict[str, Any] = dict(self._fixed, prompt=rows.prompts, num_inference_steps=steps,
                                         generator=rows.generators, output_type=self.output_type)
        if "width" in self._parameters:
            arguments.update(width=width, height=height)
        if capabilities.negative_prompt:
            arguments["negative_prompt"] = rows.negative_prompts
        arguments.update(self.scales(call.guidance_scale, call.true_cfg_scale))
        if capabilities.stages == 2:
            arguments["prior_num_inference_steps"] = steps
        video = capabilities.video is not None
        if video:
            arguments["num_frames"] = num_frames
        if inputs is not None:
            arguments["image"] = inputs.images[0] if video else inputs.images
            if inputs.masks is not None:
                arguments["mask_image"] = inputs.masks
            if inputs.strength is not None:
                arguments["strength"] = inputs.strength
        arguments.update(conditioning or {})
        arguments.update(self._step_callbacks(on_step, capabilities.total_steps(steps),
                                              None if video or capabilities.stages != 1 else on_latents,
                                              (width, height)))
        pipeline = self.pipeline
        if not callable(pipeline):  # adapt keeps only callable pipelines
            raise TypeError(f"{type(pipeline).__name__} cannot generate images")
        with self._sampled(call.sampler):
            output = pipeline(**arguments)
        images = _channels_last_floats(output.frames if video else output.images)
        expected = (len(rows.prompts), *((num_frames,) if video else ()), height, width, 3)
        if images.shape != expected:
            made = "x".join(map(str, images.shape[-2:-4:-1])) if images.ndim == len(expected) else str(images.shape)
            what = f"{images.shape[1]}-frame videos" if video and images.ndim == len(expected) else "images"
            asked = f"{num_frames}-frame {width}x{height}" if video else f"{width}x{height}"
            raise OutputSizeMismatch(
                f"{type(pipeline).__name__} made {made} {what} for a {asked} request; nothing returned")
        return images

    @contextlib.contextmanager
    def _sampled(self, sampler: str) -> Iterator[None]:
        """The call with the ``sampler``'s scheduler, new for it, in place of the pipeline's own (on
        the device thread, which runs one call at a time); none: the pipeline's own."""
        if not sampler:
            yield
            return
        own = self.pipeline.scheduler
        self.pipeline.scheduler = scheduler_for(own, sampler)
        try:
            yield
        finally:
            self.pipeline.scheduler = own

    def scales(self, guidance: float, true_cfg: float | None) -> dict[str, float]:
        """The guidance arguments ``generate`` passes the pipeline for these values, by name
        (Qwen-Image's and ``shapes``' guidance is its ``true_cfg_scale``; Flux takes both)."""
        capabilities = self.capabilities
        found: dict[str, float] = {}
        if capabilities.guidance != common_pb2.GUIDANCE_KIND_NONE:
            found[_GUIDANCE_ARGUMENT[capabilities.guidance]] = guidance
        if true_cfg is not None and capabilities.separate_true_cfg:
            found["true_cfg_scale"] = true_cfg
        return found

    def _step_callbacks(self, on_step: StepCallback, planned: int, on_latents: LatentsCallback | None,
                        size: tuple[int, int]) -> dict[str, Any]:
        """The callback arguments that call ``on_step`` with a step count running across the
        stages (and ``on_latents`` before it, with the latents of an image ``size`` wide and high).
        The total is the pipeline's own count of its timesteps where it keeps one (a strength below
        1 runs fewer steps), else ``planned``."""
        done = 0

        def step(latents: object) -> None:
            nonlocal done
            done += 1
            counted = getattr(self.pipeline, "_num_timesteps", None)
            single = self.capabilities.stages == 1 and isinstance(counted, int) and counted > 0
            total = int(counted) if single and counted else planned
            if on_latents is not None and isinstance(latents, torch.Tensor):
                on_latents(done, total, self.unpacked_latents(latents, *size))
            on_step(done, total)

        def step_end(pipeline: object, index: int, timestep: object, tensors: dict[str, Any]) -> dict[str, Any]:
            step(tensors.get("latents"))
            return tensors

        def legacy(index: int, timestep: object, latents: object) -> None:
            step(latents)

        kind = self.capabilities.step_callback
        if kind == "callback":
            return {"callback": legacy}
        if kind != "callback_on_step_end":
            return {}
        callbacks: dict[str, Any] = {"callback_on_step_end": step_end}
        if self.capabilities.stages == 2:
            callbacks["prior_callback_on_step_end"] = step_end
        return callbacks

    def unpacked_latents(self, latents: torch.Tensor, width: int, height: int) -> torch.Tensor:
        """A step's latents as n x C x h x w: Flux and Qwen-Image pack them in 2x2 patches inside
        their loop (n x tokens x 4C), which their own ``_unpack_latents`` undoes (Qwen-Image's with
        a frame axis, dropped)."""
        if latents.ndim == 3:
            pipeline = self.pipeline
            latents = pipeline._unpack_latents(latents, height, width, pipeline.vae_scale_factor)
        return latents[:, :, 0] if latents.ndim == 5 else latents

    def canary(self) -> PipelineAdapter:
        """One step of one image (of a video model, one video of the fewest frames) at the smallest
        size, for each task: a model that loads but cannot
        generate fails here, with a short reason, before it is ever READY. A derived task that
        fails (a tiny SD3 transformer has too few channels to inpaint) is dropped from the tasks,
        with a warning, so the capabilities say only what generates. Then ``SAMPLER_CANARY_STEPS``
        of the first task with each sampler, stopped after its first step (by then the pipeline has
        set its timesteps and stepped it): one its pipeline's call cannot run (Flux's passes a ``mu``
        that DPM-Solver takes only with dynamic shifting, CogView4's timesteps UniPC does not take)
        is dropped likewise. Returns the adapter whose tasks and samplers all passed."""
        size = self.capabilities.min_size or self.capabilities.size_multiple
        grey, white = Image.new("RGB", (size, size), (128, 128, 128)), Image.new("L", (size, size), 255)
        canary_inputs = {"TEXT_TO_IMAGE": None, "EDIT": ImageInputs([grey]),
                         "IMAGE_TO_IMAGE": ImageInputs([grey], strength=1.0),
                         "INPAINT": ImageInputs([grey], [white], strength=1.0),
                         "TEXT_TO_VIDEO": None, "IMAGE_TO_VIDEO": ImageInputs([grey])}
        video = self.capabilities.video
        frames = video.min_frames if video is not None else 0

        def run(task: str, steps: int = 1, sampler: str = "", on_step: StepCallback = lambda done, total: None) -> None:
            with torch.inference_mode():
                self.for_task(task).generate(
                    ImageRows.of("canary", "", [0]),
                    GenerationParams(width=size, height=size, num_inference_steps=steps,
                                     guidance_scale=self.capabilities.default_guidance, num_frames=frames,
                                     sampler=sampler),
                    on_step, canary_inputs[task])

        working = []
        for task in self.capabilities.tasks:
            try:
                run(task)
            except Exception as error:  # noqa: BLE001 - any failure means the model cannot serve it
                if task in _AUTO_PIPELINES:
                    logger.warning("%s cannot serve %s, which is left out: %s", type(self.pipeline).__name__,
                                   task, short_reason(error))
                    self._derived.pop(task, None)
                    continue
                made = f"{frames}-frame {size}x{size} video" if frames else f"{size}x{size} image"
                raise failed_precondition(
                    f"{type(self.pipeline).__name__} loads but cannot generate a {made} in one step: "
                    f"{short_reason(error)}") from error
            working.append(task)
        samplers = []
        for sampler in self.capabilities.samplers:  # with the model's first task
            try:
                run(working[0], SAMPLER_CANARY_STEPS, sampler, _first_step_ran)
            except _FirstStepRan:
                pass
            except Exception as error:  # noqa: BLE001 - any failure means the pipeline cannot run it
                logger.warning("%s cannot run the sampler %s, which is left out: %s", type(self.pipeline).__name__,
                               sampler, short_reason(error))
                continue
            samplers.append(sampler)
        return replace(self, capabilities=replace(self.capabilities, tasks=tuple(working), samplers=tuple(samplers)))


# The steps a sampler's canary sets: the fewest PNDM runs (its Runge-Kutta warm-up fails on fewer, in
# diffusers' own call too).
SAMPLER_CANARY_STEPS = 4


class _FirstStepRan(Exception):
    """Ends a sampler's canary after its first step."""


def _first_step_ran(done: int, total: int) -> None:
    raise _FirstStepRan
# The pipelines derived from a text-to-image one for the tasks that take an image.
_AUTO_PIPELINES: dict[str, Any] = {"IMAGE_TO_IMAGE": AutoPipelineForImage2Image, "INPAINT": AutoPipelineForInpainting}
_AUTO_MAPPINGS = {"IMAGE_TO_IMAGE": AUTO_IMAGE2IMAGE_PIPELINES_MAPPING, "INPAINT": AUTO_INPAINT_PIPELINES_MAPPING}


def _tasks(pipeline: DiffusionPipeline, parameters: Any) -> tuple[str, ...]:
    """A video model (its call takes ``num_frames``) serves IMAGE_TO_VIDEO where its call takes an
    image, else TEXT_TO_VIDEO; an edit model (its call takes an image) serves EDIT; a text-to-image
    one also the tasks diffusers' auto pipelines have a pipeline for, for its model type."""
    if "num_frames" in parameters:
        return ("IMAGE_TO_VIDEO",) if "image" in parameters else ("TEXT_TO_VIDEO",)
    if "image" in parameters:
        return ("EDIT",)
    name = type(pipeline).__name__
    model_type = next((key for key, kind in AUTO_TEXT2IMAGE_PIPELINES_MAPPING.items() if kind.__name__ == name), None)
    return ("TEXT_TO_IMAGE", *(task for task, mapping in _AUTO_MAPPINGS.items() if model_type in mapping))


def _call_conventions(pipeline: DiffusionPipeline, parameters: Any) -> tuple[str, dict[str, Any]]:
    """The step callback a pipeline's call signature has, and the arguments every call gets."""
    fixed: dict[str, Any] = dict(max_sequence_length(pipeline))
    if "use_resolution_binning" in parameters:
        fixed["use_resolution_binning"] = False
    if "callback_on_step_end" in parameters:
        return "callback_on_step_end", fixed
    if "callback" in parameters:
        if "callback_steps" in parameters:
            fixed["callback_steps"] = 1
        return "callback", fixed
    return "", fixed


def adapt(pipeline: DiffusionPipeline) -> PipelineAdapter:
    """Reads a pipeline's call signature and config: the capabilities and the fixed arguments."""
    parameters = inspect.signature(pipeline.__call__).parameters
    guidance = _guidance_kind(pipeline, parameters)
    default = parameters[_GUIDANCE_ARGUMENT[guidance]].default if guidance != common_pb2.GUIDANCE_KIND_NONE else None
    step_callback, fixed = _call_conventions(pipeline, parameters)
    video, grid = _video(pipeline, parameters)
    multiple = grid.size_multiple if grid is not None else _size_multiple(pipeline, parameters)
    true_cfg = parameters["true_cfg_scale"].default if "true_cfg_scale" in parameters else None
    capabilities = Capabilities(
        # A distilled guidance has no unconditional pass: a negative prompt needs true CFG's.
        negative_prompt="negative_prompt" in parameters
        and (guidance != common_pb2.GUIDANCE_KIND_DISTILLED or true_cfg is not None),
        guidance=guidance,
        default_guidance=float(default) if isinstance(default, int | float) else 0.0,
        step_callback=step_callback,
        stages=2 if "prior_num_inference_steps" in parameters else 1,
        min_size=_min_size(pipeline, multiple),
        size_multiple=multiple,
        max_size=grid.max_size if grid is not None else _max_size(pipeline),
        tasks=_tasks(pipeline, parameters),
        true_cfg=true_cfg is not None,
        default_true_cfg=float(true_cfg) if isinstance(true_cfg, int | float) else 0.0,
        video=video,
        max_steps=min((most for most in map(scheduler_max_steps, _schedulers(pipeline)) if most), default=0),
        samplers=offered(pipeline),
    )
    return PipelineAdapter(pipeline, capabilities, frozenset(parameters), fixed, output_type_of(pipeline))


def output_type_of(pipeline: DiffusionPipeline) -> str:
    """The ``output_type`` a pipeline's call asks for: "pt" where its family's record says its "pt"
    output is its "np" output before the conversion to numpy (``Family.tensor_output``), else "np"
    (Kandinsky 3, whose "pt" is not mapped to [0, 1]; a pipeline of no family here: not checked)."""
    family = family_of(pipeline)
    return "pt" if family is not None and family.tensor_output else "np"


def _channels_last_floats(output: Any) -> torch.Tensor:
    """A call's images or videos as floats in [0, 1], channels last: its "pt" output (channels
    before height and width) rearranged on its device; its "np" output (already channels last) as
    a tensor on the host, sharing its memory."""
    if isinstance(output, torch.Tensor):
        return channels_last(output)
    return torch.from_numpy(np.asarray(output))


def _schedulers(pipeline: DiffusionPipeline) -> list[Any]:
    """Every scheduler the pipeline's call steps with (a prior's too)."""
    return [module for module in pipeline.components.values() if isinstance(module, SchedulerMixin)]


def scheduler_max_steps(scheduler: Any) -> int:
    """The most steps the scheduler runs: at most one per training timestep
    (``num_train_timesteps``), and no more than its own schedule for that many steps can run. A
    schedule whose timesteps are offset past the training ones (DDIM or DDPM with
    ``steps_offset=1`` and "leading" spacing, as Stable Diffusion's: timestep 1000 of 0 to 999 at
    1000 steps) fails in ``step``, in diffusers' own call too (diffusers issue 10003), so such a
    model takes at most 999. Found by dry runs of the schedule (``schedule_runs``): from the ceiling down,
    in doubling gaps, then halving between the last count that failed and the first that ran. 0
    where there is no ceiling or not even one step dry-runs (a scheduler driven its own way, as
    Würstchen's ratios): no limit found."""
    ceiling = getattr(scheduler.config, "num_train_timesteps", None)
    if not isinstance(ceiling, int) or ceiling < 1 or not schedule_runs(scheduler, 1):
        return 0
    if schedule_runs(scheduler, ceiling):
        return ceiling
    failed, ran = ceiling, max(ceiling - 1, 1)
    while not schedule_runs(scheduler, ran):  # ends at 1 step at the latest, which runs
        failed, ran = ran, max(2 * ran - ceiling, 1)
    while failed - ran > 1:
        middle = (ran + failed) // 2
        ran, failed = (middle, failed) if schedule_runs(scheduler, middle) else (ran, middle)
    return ran


def _video(pipeline: DiffusionPipeline, parameters: Any) -> tuple[VideoRange | None, VideoGrid | None]:
    """A video model's frames, and its family's grid (frames and sizes: video pipelines name their
    VAE factors their own way); (None, None) for an image model. Without a family record: frames
    on the VAE's temporal factor (``vae_scale_factor_temporal``, else any count), sizes as an image
    model's, ``DEFAULT_FPS``."""
    if "num_frames" not in parameters:
        return None, None
    family = family_of(pipeline)
    record = family.video if family is not None else None
    grid = record.grid(pipeline) if record is not None else None
    temporal = getattr(pipeline, "vae_scale_factor_temporal", None)
    step = grid.frame_step if grid is not None else temporal if isinstance(temporal, int) and temporal > 0 else 1
    most = grid.max_frames if grid is not None else 0
    default = parameters["num_frames"].default
    frames = default if isinstance(default, int) and default > 0 else step + 1
    video = VideoRange(frame_step=step, min_frames=1, max_frames=most,
                       default_frames=min(frames, most) if most else frames,
                       default_fps=record.default_fps if record is not None else DEFAULT_FPS)
    return video, grid


def _guidance_kind(pipeline: DiffusionPipeline, parameters: Any) -> common_pb2.GuidanceKind:
    transformer_config = getattr(pipeline.components.get("transformer"), "config", None)
    if "guidance_scale" in parameters and getattr(transformer_config, "guidance_embeds", False):
        return common_pb2.GUIDANCE_KIND_DISTILLED
    if "true_cfg_scale" in parameters:
        return common_pb2.GUIDANCE_KIND_TRUE_CFG
    if "prior_guidance_scale" in parameters:
        return common_pb2.GUIDANCE_KIND_PRIOR
    if "guidance_scale" in parameters:
        return common_pb2.GUIDANCE_KIND_CLASSIFIER_FREE
    return common_pb2.GUIDANCE_KIND_NONE


def _vae_grid(pipeline: DiffusionPipeline) -> int:
    """The multiple the latents need: the VAE's scale factor times a transformer's patch size, and
    the factor the pipeline's image processor aligns to (Flux and Qwen-Image pack latents 2x2 and
    say so only there); 0 when the pipeline has no VAE factor."""
    scale = getattr(pipeline, "vae_scale_factor", None)
    if not isinstance(scale, int) or scale < 1:
        return 0
    patch = getattr(getattr(pipeline.components.get("transformer"), "config", None), "patch_size", None)
    grid = scale * patch if isinstance(patch, int) and patch > 1 else scale
    aligned = getattr(getattr(getattr(pipeline, "image_processor", None), "config", None), "vae_scale_factor", None)
    return math.lcm(grid, aligned) if isinstance(aligned, int) and aligned > 0 else grid


def _accepts_size(check_inputs: Callable[..., Any], arguments: dict[str, Any], size: int) -> bool:
    try:
        check_inputs(**dict(arguments, height=size, width=size))
    except Exception:  # noqa: BLE001 - whatever it raises, the size is not one it takes
        return False
    return True


def _size_multiple(pipeline: DiffusionPipeline, parameters: Any) -> int:
    """The multiple widths and heights must be of: the pipeline's own rule where it rounds sizes (its
    family's ``rounds_to``: Kandinsky 3, Wuerstchen), else the smallest multiple of the VAE grid that
    its ``check_inputs`` accepts (many pipelines demand more than the VAE needs: SDXL 8, Sana 32,
    CogView4 16), else the VAE grid, else (no VAE scale factor) ``DEFAULT_SIZE_MULTIPLE``. Nothing
    else constrains sizes: worker and runner enforce this value as it is, so a tiny build's VAE of
    one block (factor 1) takes any size its transformer does.

    ``check_inputs`` is called with the prompt, the size and each of its other arguments at the
    ``__call__`` default of the same name (None where there is none): it only inspects them.
    """
    family = family_of(pipeline)
    if family is not None and family.rounds_to:
        return family.rounds_to
    grid = _vae_grid(pipeline)
    check_inputs = getattr(pipeline, "check_inputs", None)
    if not grid:
        return DEFAULT_SIZE_MULTIPLE
    if check_inputs is None:
        return grid
    arguments: dict[str, Any] = {}
    for name, parameter in inspect.signature(check_inputs).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = parameters[name].default if name in parameters else parameter.default
        arguments[name] = None if default is inspect.Parameter.empty else default
    arguments["prompt"] = "a"
    if "callback_steps" in arguments:
        arguments["callback_steps"] = 1
    for factor in range(1, _GRID_PROBES + 1):
        if _accepts_size(check_inputs, arguments, grid * factor):
            return grid * factor
    return grid


def _min_latent_unet(config: Any) -> int:
    """The smallest latent side a ``UNet2DConditionModel`` denoises one image at.

    A GroupNorm needs more than one value per group: where a level's blocks have one channel per
    group (at the first resnet of a level, its input has the previous level's channels), its
    feature map, ``ceil(side / 2**level)``, must be at least 2 wide.
    """
    channels = list(getattr(config, "block_out_channels", None) or [])
    groups = getattr(config, "norm_num_groups", None)
    latent = 1
    for level, out in enumerate(channels):
        smallest = min(out, channels[level - 1]) if level else out
        if groups and smallest // groups <= 1:
            latent = max(latent, 2**level + 1)
    return latent


def _min_latent_decoder(config: Any) -> int:
    """The smallest latent side an ``AutoencoderKL`` decodes: its first blocks run at the latent's size."""
    channels = list(getattr(config, "block_out_channels", None) or [])
    groups = getattr(config, "norm_num_groups", None)
    return 2 if channels and groups and channels[-1] // groups <= 1 else 1


def _min_size(pipeline: DiffusionPipeline, multiple: int) -> int:
    """The smallest size on the grid: for a UNet pipeline, the smallest multiple whose latent gives
    every GroupNorm of the UNet and the VAE decoder more than one value per group, for one image
    without classifier-free guidance (24 for ``tiny``, 8 for ``small``); else the multiple. The
    canary then checks that size really generates."""
    components = pipeline.components
    unet, vae = components.get("unet"), components.get("vae")
    scale = getattr(pipeline, "vae_scale_factor", None)
    if unet is None or vae is None or not isinstance(scale, int) or not multiple:
        return multiple
    latent = max(_min_latent_unet(unet.config), _min_latent_decoder(vae.config))
    return multiple * math.ceil(latent * scale / multiple)


def _max_size(pipeline: DiffusionPipeline) -> int:
    """The largest size a transformer's fixed position embedding covers (diffusers' ``PatchEmbed``
    with ``pos_embed_max_size`` patches, as in SD3: it refuses larger inputs); 0 when there is none
    (interpolated or rotary embeddings take any size)."""
    embedding = getattr(pipeline.components.get("transformer"), "pos_embed", None)
    patches = getattr(embedding, "pos_embed_max_size", None)
    grid = _vae_grid(pipeline)
    return patches * grid if isinstance(patches, int) and patches > 0 and grid else 0
