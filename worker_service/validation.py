"""The worker's checks of what callers send, for every RPC: a GenerateRequest normalized with
defaults filled in, the strings of lifecycle and adapter calls, or one violation per bad field.

The rules themselves (size grid, tasks and their inputs, guidance and strength bounds, names) are
``serving_common.input_rules``, which the runner applies too; this module maps the worker's
messages onto them, with the worker's own limits (``Limits``, its flags) and defaults.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import cast

import grpc

from diffusion.v1 import common_pb2, runner_pb2, worker_pb2
from serving_common import conditioning_rules
from serving_common.conditioning_rules import (
    KIND_NAMES,
    KIND_TITLES,
    MAX_CONTROLS,
    MAX_PROMPT_IMAGES,
    not_a_lora,
    same_kind,
    wrong_kind,
)
from serving_common.errors import ServiceError
from serving_common.generation_params import Control, GenerationParams, ImagePrompt
from serving_common.input_rules import (
    DEFAULT_STRENGTH,
    TASK_INPUTS,
    VIDEO_TASKS,
    ModelTerms,
    Violation,
    adapter_name_problem,
    adapter_scale_problem,
    chosen_task,
    count_problem,
    fps_problem,
    guidance_problem,
    negative_prompt_problem,
    num_frames_problem,
    partial_images_problem,
    request_id_problem,
    sampler_problem,
    steps_problem,
    strength_problem,
    task_inputs,
    task_violations,
    text_problem,
    text_violations,
    true_cfg_problem,
)
from worker_service.config import MAX_PARALLEL_DEGREE, Limits
from worker_service.generation_defaults import defaults_in_force, size_grid


@dataclass(frozen=True, kw_only=True)
class NormalizedRequest(GenerationParams):
    """A valid request with every default applied and a seed chosen: its generation parameters (what
    the runner gets, ``to_item``) and what stays with the worker."""

    request_id: str
    output_format: int
    # The input image and mask at width x height, as the runner takes them (``image_inputs``).
    image: runner_pb2.RawImage | None = field(default=None, compare=False)
    mask_image: runner_pb2.RawImage | None = field(default=None, compare=False)
    # The conditioning image of each of ``controls`` (at width x height) and the IP-Adapter's
    # reference images (each at its own size), likewise.
    control_images: tuple[runner_pb2.RawImage, ...] = field(default=(), compare=False)
    prompt_images: tuple[runner_pb2.RawImage, ...] = field(default=(), compare=False)
    # Video tasks only (0 and False otherwise): the container's frame rate, and whether the raw frames
    # go back beside the container.
    fps: int = 0
    return_frames: bool = False

    @property
    def video(self) -> bool:
        return self.task in VIDEO_TASKS

    @property
    def frame_bytes(self) -> int:
        """The bytes of its raw frames (a video's): num_frames x height x width x 3."""
        return self.num_frames * self.height * self.width * 3

    @property
    def raw_inputs(self) -> tuple[runner_pb2.RawImage, ...]:
        """Every decoded image it sends the runner: input image, mask, control and reference images."""
        return tuple(raw for raw in (self.image, self.mask_image, *self.control_images, *self.prompt_images)
                     if raw is not None)

    def adapter_names(self) -> tuple[str, ...]:
        """The registered adapters it names, of every kind: LoRAs, ControlNets, its IP-Adapter."""
        return (*(name for name, _ in self.adapters), *(control.name for control in self.controls),
                *((self.ip_adapter.name,) if self.ip_adapter is not None else ()))

    def item(self) -> runner_pb2.ExecuteItem:
        """The runner's ExecuteItem of this request, its decoded images in it."""
        return self.to_item(self.request_id, self.image, self.mask_image, self.control_images, self.prompt_images)


class ValidationError(Exception):
    """The request has bad fields; ``violations`` names each one."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {d}" for f, d in violations))
        self.violations = violations


def normalize(request: worker_pb2.GenerateRequest, limits: Limits, active_ids: Container[str],
              field_prefix: str = "", model: common_pb2.ModelInfo | None = None,
              adapters: Mapping[str, int] | Collection[str] = MappingProxyType({}),
              image_size: tuple[int, int] | None = None,
              mask_size: tuple[int, int] | None = None, streamed: bool = False,
              control_sizes: Sequence[tuple[int, int]] = (),
              prompt_sizes: Sequence[tuple[int, int]] = ()) -> NormalizedRequest:
    """Checks every field of ``request`` and fills in defaults; raises ValidationError, or
    FAILED_PRECONDITION naming each ControlNet or IP-Adapter that is not registered (one registered
    as another kind is a ValidationError naming its field).

    ``field_prefix`` is prepended to field names (``request.`` for GenerateStream). Sizes are
    checked against the loaded ``model``'s size grid too, when it reports one, and adapter names
    against the registered ``adapters`` (name: AdapterKind; names alone are LoRAs). ``image_size`` and ``mask_size`` are
    those of the request's image and mask headers (``image_inputs.input_sizes``), ``control_sizes``
    and ``prompt_sizes`` those of its control and reference images; an unset width or height takes
    the image's, else the first control image's. The images themselves are attached afterwards,
    the image, mask and control images fitted to the size.
    ``streamed``: the caller gets progress events (GenerateStream), the only ones that take previews.
    """
    violations: list[Violation] = []

    def bad(name: str, description: str | None) -> None:
        if description is not None:
            violations.append((field_prefix + name, description))

    grid = size_grid(model, limits)
    defaults = defaults_in_force(model, limits)  # the model's own (generation_config.json), else the flags
    given_size = image_size or (control_sizes[0] if control_sizes else None)
    width = request.width or (given_size[0] if given_size else defaults.width)
    height = request.height or (given_size[1] if given_size else defaults.height)
    bad("width", grid.problem(width))
    bad("height", grid.problem(height))

    terms = ModelTerms.from_model_info(model)
    steps = request.num_inference_steps or defaults.num_inference_steps
    bad("num_inference_steps", steps_problem(steps, limits.max_steps, terms))
    bad("sampler", sampler_problem(request.sampler, terms))
    guidance, true_cfg = _guidance(request, defaults.guidance_scale, limits, terms, bad)
    num_images = request.num_images or 1
    bad("num_images", count_problem(num_images, limits.max_images))

    for name in ("prompt", "negative_prompt"):
        length = len(getattr(request, name))
        if length > limits.max_prompt_chars:
            bad(name, f"must be at most {limits.max_prompt_chars} characters, got {length}")

    as_given = GenerationParams.ruled_in(request)  # the fields passed on as the request sets them
    for name, why in GenerationParams.model_violations(as_given, model):
        bad(name, why)

    if not isinstance(adapters, Mapping):
        adapters = dict.fromkeys(adapters, common_pb2.ADAPTER_KIND_LORA)
    chosen = _adapters(request, limits, adapters, bad)
    task = _task(request, model, terms, image_size is not None, bad)
    unregistered: list[Violation] = []
    controls = _controls(request, model, task, adapters, bad, unregistered.append)
    image_prompt = _image_prompt(request, model, task, grid.largest, prompt_sizes, adapters, bad,
                                 unregistered.append)
    num_frames, fps, output_format = _video(request, task, model, (width, height), bad)
    strength = request.strength if request.HasField("strength") else None
    if strength is None and task_inputs(task).strength:
        strength = DEFAULT_STRENGTH
    bad("strength", strength_problem(task, strength, steps))
    bad("partial_images", partial_images_problem(task, request.partial_images) or (
        "previews come in progress events: GenerateStream (or the HTTP API's stream: true) only"
        if request.partial_images and not streamed else None))
    _fits(request, (width, height), image_size, mask_size, control_sizes, bad)

    request_id = request.request_id or uuid.uuid4().hex
    id_problem = request_id_problem(request_id, limits.max_request_id_chars)
    if id_problem is None and request_id in active_ids:
        id_problem = f"request {request_id} is already queued or running"
    bad("request_id", id_problem)

    if violations:
        raise ValidationError(violations)
    if unregistered:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "; ".join(
            f"{field_prefix}{name}: {why}" for name, why in unregistered),
            [(field_prefix + name, why) for name, why in unregistered])
    return NormalizedRequest(
        request_id=request_id,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=request.seed if request.HasField("seed") else secrets.randbits(64),
        num_images=num_images,
        output_format=output_format,
        adapters=chosen,
        task=task,
        strength=strength if task_inputs(task).strength and strength is not None else 0.0,
        true_cfg_scale=true_cfg,
        num_frames=num_frames,
        fps=fps,
        # RAW's data is the frames already.
        return_frames=request.return_frames and output_format != worker_pb2.OUTPUT_FORMAT_RAW,
        partial_images=request.partial_images,
        sampler=request.sampler,
        controls=controls,
        ip_adapter=image_prompt,
        **as_given,
    )


# Records a violation of the field named, when there is one.
Bad = Callable[[str, str | None], None]


def _task(request: worker_pb2.GenerateRequest, model: common_pb2.ModelInfo | None, terms: ModelTerms | None,
          has_image: bool, bad: Bad) -> common_pb2.Task:
    """The task asked for, or the one that follows from what is given; it must be one the model
    serves and have the inputs it needs. An unknown one is refused, and text-to-image's rules apply."""
    served = terms.tasks if terms is not None and terms.tasks else (common_pb2.TASK_TEXT_TO_IMAGE,)
    name = model.pipeline_class if model is not None and model.pipeline_class else "this model"
    task = chosen_task(request.task, has_image, bool(request.mask_image), served)
    for field_name, why in task_violations(task, served, name, has_image, bool(request.mask_image),
                                           asked=bool(request.task)):
        bad(field_name, why)
    return cast(common_pb2.Task, task) if task in TASK_INPUTS else common_pb2.TASK_TEXT_TO_IMAGE


def _video(request: worker_pb2.GenerateRequest, task: int, model: common_pb2.ModelInfo | None,
           size: tuple[int, int], bad: Bad) -> tuple[int, int, int]:
    """The num_frames, fps and output format of the request: a video's frames and fps defaulted from
    the model's VideoCapabilities and on its grid, one video per request, in a video format (MP4 by
    default, which needs even sizes); an image task takes none of these, nor MP4."""
    output_format = request.output_format
    if output_format not in worker_pb2.OutputFormat.values():
        bad("output_format", f"unknown output format {output_format}")
    caps = model.capabilities.video if model is not None and model.capabilities.HasField("video") else None
    if task not in VIDEO_TASKS:
        bad("num_frames", num_frames_problem(task, request.num_frames, caps))
        bad("fps", fps_problem(task, request.fps, caps))
        if request.return_frames:
            bad("return_frames", "video tasks only")
        if output_format == worker_pb2.OUTPUT_FORMAT_MP4:
            bad("output_format", "MP4 is for video tasks; an image is PNG, JPEG, WEBP or RAW")
        return 0, 0, output_format
    num_frames = request.num_frames or (caps.default_frames if caps is not None else 0)
    fps = request.fps or (caps.default_fps if caps is not None else 0)
    bad("num_frames", num_frames_problem(task, num_frames, caps))
    bad("fps", fps_problem(task, fps, caps))
    if request.num_images > 1:
        bad("num_images", f"a video request makes one video, got {request.num_images}")
    output_format = output_format or worker_pb2.OUTPUT_FORMAT_MP4
    if output_format in (worker_pb2.OUTPUT_FORMAT_JPEG, worker_pb2.OUTPUT_FORMAT_PNG):
        bad("output_format", "a video is MP4, WEBP (animated) or RAW (its frames)")
    elif output_format == worker_pb2.OUTPUT_FORMAT_MP4 and (size[0] % 2 or size[1] % 2):
        bad("output_format", f"MP4 (yuv420p) needs an even width and height, got {size[0]}x{size[1]}")
    return num_frames, fps, output_format


def _fits(request: worker_pb2.GenerateRequest, size: tuple[int, int], image_size: tuple[int, int] | None,
          mask_size: tuple[int, int] | None, control_sizes: Sequence[tuple[int, int]], bad: Bad) -> None:
    """The mask has the image's size; the image and each control image have the requested one
    unless resize_mode fits them."""
    if request.resize_mode not in worker_pb2.ResizeMode.values():
        bad("resize_mode", f"unknown resize mode {request.resize_mode}")
    if mask_size is not None and image_size is not None and mask_size != image_size:
        bad("mask_image", f"is {mask_size[0]}x{mask_size[1]}; the image is {image_size[0]}x{image_size[1]}")
    if request.resize_mode != worker_pb2.RESIZE_MODE_UNSPECIFIED:
        return
    for name, given in (("image", image_size), *((f"controls[{i}].image", s) for i, s in enumerate(control_sizes))):
        if given is not None and given != size:
            bad(name, f"is {given[0]}x{given[1]}, not the {size[0]}x{size[1]} asked for; "
                      "set resize_mode to resize or crop it")


def _check_name(field: str, name: str, kind: int, adapters: Mapping[str, int], bad: Bad,
                unregistered: Callable[[Violation], None]) -> None:
    """A ControlNet's or IP-Adapter's ``name`` (``kind``): one registered as another kind is
    INVALID_ARGUMENT naming ``field`` (``bad``: the request names something that is not of that
    kind, as the runner refuses it); one not registered goes to ``unregistered``
    (FAILED_PRECONDITION: it may be registered later)."""
    registered = adapters.get(name)
    if registered is None:
        unregistered((field, f"{KIND_TITLES[kind]} {name[:64]!r} is not registered "
                             f"(LoadAdapter with kind {KIND_NAMES[kind]})"))
    elif not same_kind(registered, kind):
        bad(field, wrong_kind(name, registered, kind))


def _family_problem(model: common_pb2.ModelInfo | None, kind: int, task: int) -> str | None:
    """Why the loaded model cannot take an adapter of ``kind`` for ``task``: its family takes none
    (capabilities.adapter_kinds; a model that reports no capabilities is left to its runner), or
    the task is not one they steer."""
    name = model.pipeline_class if model is not None and model.pipeline_class else "this model"
    if model is not None and model.HasField("capabilities") and kind not in model.capabilities.adapter_kinds:
        return f"{name}'s family takes no {KIND_TITLES[kind]}s"
    if task not in conditioning_rules.CONDITIONED_TASKS:
        return f"{KIND_TITLES[kind]}s steer text-to-image and image-to-image only, not {_task_name(task)}"
    return None


def _task_name(task: int) -> str:
    return common_pb2.Task.Name(task).removeprefix("TASK_").lower().replace("_", "-") \
        if task in common_pb2.Task.values() else str(task)


def _controls(request: worker_pb2.GenerateRequest, model: common_pb2.ModelInfo | None, task: int,
              adapters: Mapping[str, int], bad: Bad, unregistered: Callable[[Violation], None]) -> tuple[Control, ...]:
    """The request's ControlNets with their defaults: at most MAX_CONTROLS, each with an image, its
    scale and guidance window in bounds, on a model whose family takes them, each name registered as
    a ControlNet (one not registered goes to ``unregistered``)."""
    if not request.controls:
        return ()
    problem = conditioning_rules.count_problem(len(request.controls), MAX_CONTROLS, "controls")
    if problem is not None:
        bad("controls", problem)
        return ()
    bad("controls", _family_problem(model, common_pb2.ADAPTER_KIND_CONTROLNET, task))
    controls = []
    for index, given in enumerate(request.controls):
        at = f"controls[{index}]"
        control = Control(given.name,
                          given.conditioning_scale if given.HasField("conditioning_scale") else 1.0,
                          given.guidance_start if given.HasField("guidance_start") else 0.0,
                          given.guidance_end if given.HasField("guidance_end") else 1.0)
        if not given.name:
            bad(f"{at}.name", "must name a ControlNet registered with LoadAdapter (kind controlnet)")
        else:
            _check_name(f"{at}.name", given.name, common_pb2.ADAPTER_KIND_CONTROLNET, adapters, bad, unregistered)
        if not given.image:
            bad(f"{at}.image", "is required: the conditioning image (PNG, JPEG or WebP)")
        bad(f"{at}.conditioning_scale", conditioning_rules.scale_problem(control.conditioning_scale))
        for name, why in conditioning_rules.guidance_window_problems(control.guidance_start, control.guidance_end):
            bad(f"{at}.{name}", why)
        controls.append(control)
    return tuple(controls)


def _image_prompt(request: worker_pb2.GenerateRequest, model: common_pb2.ModelInfo | None, task: int,
                  largest: int, sizes: Sequence[tuple[int, int]], adapters: Mapping[str, int], bad: Bad,
                  unregistered: Callable[[Violation], None]) -> ImagePrompt | None:
    """The request's IP-Adapter image prompt with its default scale: 1 to MAX_PROMPT_IMAGES images,
    each at most ``largest`` on a side (the model's size grid), on a model whose family takes them;
    a name not registered goes to ``unregistered``."""
    if not request.HasField("ip_adapter"):
        return None
    given = request.ip_adapter
    prompt = ImagePrompt(given.name, given.scale if given.HasField("scale") else 1.0, len(given.images))
    bad("ip_adapter", _family_problem(model, common_pb2.ADAPTER_KIND_IP_ADAPTER, task))
    if not given.name:
        bad("ip_adapter.name", "must name an IP-Adapter registered with LoadAdapter (kind ip_adapter)")
    else:
        _check_name("ip_adapter.name", given.name, common_pb2.ADAPTER_KIND_IP_ADAPTER, adapters, bad, unregistered)
    count = len(given.images)
    bad("ip_adapter.images", "at least 1 reference image (PNG, JPEG or WebP)" if not count else
        conditioning_rules.count_problem(count, MAX_PROMPT_IMAGES, "reference images"))
    for index, (width, height) in enumerate(sizes):
        if max(width, height) > largest:
            bad(f"ip_adapter.images[{index}]", f"is {width}x{height}; at most {largest} on each side (the model's)")
    bad("ip_adapter.scale", conditioning_rules.scale_problem(prompt.scale))
    return prompt


def _adapters(request: worker_pb2.GenerateRequest, limits: Limits, registered: Mapping[str, int],
              bad: Bad) -> tuple[tuple[str, float], ...]:
    """The request's (name, scale) LoRA adapters: registered LoRAs, each once, finite scales in bounds."""
    if len(request.adapters) > limits.max_request_adapters:
        bad("adapters", f"at most {limits.max_request_adapters} adapters, got {len(request.adapters)}")
        return ()
    chosen: list[tuple[str, float]] = []
    for index, ref in enumerate(request.adapters):
        scale = ref.scale if ref.HasField("scale") else 1.0
        if ref.name not in registered:
            bad(f"adapters[{index}].name", f"adapter {ref.name[:64]!r} is not registered (LoadAdapter)")
        elif not same_kind(registered[ref.name], common_pb2.ADAPTER_KIND_LORA):
            bad(f"adapters[{index}].name", not_a_lora(ref.name, registered[ref.name]))
        elif any(name == ref.name for name, _ in chosen):
            bad(f"adapters[{index}].name", f"adapter {ref.name!r} appears twice")
        bad(f"adapters[{index}].scale", adapter_scale_problem(scale, limits.max_adapter_scale))
        chosen.append((ref.name, scale))
    return tuple(chosen)


def _guidance(request: worker_pb2.GenerateRequest, default: float, limits: Limits, terms: ModelTerms | None,
              bad: Bad) -> tuple[float, float | None]:
    """The guidance_scale and the separate true_cfg_scale (None: not sent) the model takes, each set
    or its default, within ``--max-guidance``; a negative prompt only where the model uses it.

    On a GUIDANCE_KIND_TRUE_CFG model (Qwen-Image) true_cfg_scale is guidance_scale under its
    pipeline's name; with capabilities.true_cfg beside another guidance (Flux) it is a second scale,
    and the negative prompt is used only when that scale is above 1.
    """
    given = request.HasField("guidance_scale")
    guidance = request.guidance_scale if given else default
    true_cfg = request.true_cfg_scale if request.HasField("true_cfg_scale") else None
    named = "guidance_scale"  # the field the guidance came in
    if true_cfg is not None and terms is not None and terms.guidance == common_pb2.GUIDANCE_KIND_TRUE_CFG:
        if given and true_cfg != guidance:
            bad("true_cfg_scale", f"is {terms.name}'s guidance_scale: set one of them, or both the same")
        guidance, true_cfg, named = true_cfg, None, "true_cfg_scale"
    problem = guidance_problem(guidance, limits.max_guidance)
    if problem is None and terms is not None and terms.guidance == common_pb2.GUIDANCE_KIND_NONE and given:
        problem = f"{terms.name} takes no guidance"
    bad(named, problem)
    if true_cfg is None and terms is not None and terms.separate_true_cfg:
        true_cfg = terms.default_true_cfg
    if true_cfg is not None:
        bad("true_cfg_scale", true_cfg_problem(terms, true_cfg, limits.max_guidance))
    if request.negative_prompt:
        bad("negative_prompt", negative_prompt_problem(terms, true_cfg))
    return guidance, true_cfg


def request_id_violations(request_id: str, limits: Limits) -> list[Violation]:
    """Cancel's request id: set, and one Generate could have been given."""
    problem = "must not be empty" if not request_id else request_id_problem(request_id, limits.max_request_id_chars)
    return [("request_id", problem)] if problem is not None else []


def required_text(field: str, value: str, when_empty: str) -> list[Violation]:
    """A path, model, target or name: set (else ``when_empty``), and fit for a path and a log line."""
    if not value:
        return [(field, when_empty)]
    return text_violations([(field, value)])


def parallel_violations(parallel: common_pb2.Parallelism) -> list[Violation]:
    """Init's degrees, bounded so that no runner is asked to plan for a huge one; whether a runner's
    devices, the model's family and the sizes can take them is the runner's to judge."""
    return [(f"parallel.{name}", f"must be at most {MAX_PARALLEL_DEGREE}, got {degree}")
            for name, degree in (("ulysses_degree", parallel.ulysses_degree), ("ring_degree", parallel.ring_degree))
            if degree > MAX_PARALLEL_DEGREE]


def adapter_name_violations(name: str) -> list[Violation]:
    """LoadAdapter's and UnloadAdapter's ``name``: one peft can load (``input_rules.ADAPTER_NAME``)."""
    problem = adapter_name_problem(name)
    return [("name", problem)] if problem is not None else []


def adapter_kind_violations(kind: int) -> list[Violation]:
    """LoadAdapter's ``kind``: one of AdapterKind (unset: a LoRA)."""
    if kind in KIND_NAMES:
        return []
    known = ", ".join(f"{value} ({name})" for value, name in KIND_NAMES.items() if value)
    return [("kind", f"unknown adapter kind {kind}; one of {known}")]


def tag_violations(tags: Sequence[str], limits: Limits) -> list[Violation]:
    """Bounds on Sleep and WakeUp tags (component names): how many, how long, no control characters."""
    if len(tags) > limits.max_tags:
        return [("tags", f"at most {limits.max_tags} tags, got {len(tags)}")]
    problems = ((index, text_problem(tag, limits.max_tag_chars)) for index, tag in enumerate(tags))
    return [(f"tags[{index}]", problem) for index, problem in problems if problem is not None]
