"""The worker's checks of what callers send, for every RPC: a GenerateRequest normalized with
defaults filled in, the strings of lifecycle and adapter calls, or one violation per bad field.

Strings that become paths, names or log lines follow ``serving_common.input_rules``, which the
runner applies too.
"""

from __future__ import annotations

import math
import re
import secrets
import uuid
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from diffusion.v1 import common_pb2, runner_pb2, worker_pb2
from serving_common.input_rules import adapter_name_problem, text_problem, text_violations
from worker_service.config import Limits

Violation = tuple[str, str]

# Printable ASCII without spaces: safe in logs and metadata.
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class NormalizedRequest:
    """A valid request with every default applied and a seed chosen."""

    request_id: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    num_images: int
    output_format: int
    # (name, scale) of each adapter, in the request's order.
    adapters: tuple[tuple[str, float], ...] = ()
    task: common_pb2.Task = common_pb2.TASK_TEXT_TO_IMAGE
    strength: float = 0.0  # image-to-image and inpainting only
    # The input image and mask at width x height, as the runner takes them (``image_inputs``).
    image: runner_pb2.RawImage | None = field(default=None, compare=False)
    mask_image: runner_pb2.RawImage | None = field(default=None, compare=False)
    # The pipeline's true_cfg_scale where it is separate from guidance_scale (Flux); None: not sent.
    true_cfg_scale: float | None = None


# What each task takes: an image, a mask, a strength.
DEFAULT_STRENGTH = 0.8
_TASK_INPUTS: dict[int, tuple[bool, bool, bool]] = {
    common_pb2.TASK_TEXT_TO_IMAGE: (False, False, False),
    common_pb2.TASK_IMAGE_TO_IMAGE: (True, False, True),
    common_pb2.TASK_INPAINT: (True, True, True),
    common_pb2.TASK_EDIT: (True, False, False),
}


class ValidationError(Exception):
    """The request has bad fields; ``violations`` names each one."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {d}" for f, d in violations))
        self.violations = violations


def normalize(request: worker_pb2.GenerateRequest, limits: Limits, active_ids: Container[str],
              field_prefix: str = "", model: common_pb2.ModelInfo | None = None,
              adapters: Container[str] = frozenset(),
              image_size: tuple[int, int] | None = None,
              mask_size: tuple[int, int] | None = None) -> NormalizedRequest:
    """Checks every field of ``request`` and fills in defaults; raises ValidationError.

    ``field_prefix`` is prepended to field names (``request.`` for GenerateStream). Sizes are
    checked against the loaded ``model``'s size grid too, when it reports one, and adapter names
    against the registered ``adapters``. ``image_size`` and ``mask_size`` are those of the
    request's image and mask headers (``image_inputs.input_sizes``); an unset width or height
    takes the image's. The image and mask themselves are attached afterwards, fitted to the size.
    """
    violations: list[tuple[str, str]] = []

    def bad(name: str, description: str) -> None:
        violations.append((field_prefix + name, description))

    width = _size(request.width or (image_size[0] if image_size else 0), "width", limits, model, bad)
    height = _size(request.height or (image_size[1] if image_size else 0), "height", limits, model, bad)

    steps = request.num_inference_steps or limits.default_steps
    if steps > limits.max_steps:
        bad("num_inference_steps", f"must be 1 to {limits.max_steps}, got {steps}")

    guidance, true_cfg = _guidance(request, limits, model, bad)

    num_images = request.num_images or 1
    if num_images > limits.max_images:
        bad("num_images", f"must be 1 to {limits.max_images}, got {num_images}")

    for name in ("prompt", "negative_prompt"):
        length = len(getattr(request, name))
        if length > limits.max_prompt_chars:
            bad(name, f"must be at most {limits.max_prompt_chars} characters, got {length}")

    if request.output_format not in worker_pb2.OutputFormat.values():
        bad("output_format", f"unknown output format {request.output_format}")

    chosen = _adapters(request, limits, adapters, bad)
    task = _task(request, model, image_size is not None, bad)
    strength = _strength(request, task, steps, bad)
    _fits(request, (width, height), image_size, mask_size, bad)

    request_id = request.request_id or uuid.uuid4().hex
    id_problem = _request_id_problem(request_id, limits)
    if id_problem is not None:
        bad("request_id", id_problem)
    elif request_id in active_ids:
        bad("request_id", f"request {request_id} is already queued or running")

    if violations:
        raise ValidationError(violations)
    return NormalizedRequest(
        request_id=request_id,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt,
        width=width,
        height=height,
        steps=steps,
        guidance_scale=guidance,
        seed=request.seed if request.HasField("seed") else secrets.randbits(64),
        num_images=num_images,
        output_format=request.output_format,
        adapters=chosen,
        task=task,
        strength=strength,
        true_cfg_scale=true_cfg,
    )


def _task(request: worker_pb2.GenerateRequest, model: common_pb2.ModelInfo | None, has_image: bool,
          bad: Callable[[str, str], None]) -> common_pb2.Task:
    """The task asked for, or the one that follows from what is given; it must be one the model
    serves and have the inputs it needs."""
    capabilities = model.capabilities if model is not None and model.HasField("capabilities") else None
    served = list(capabilities.tasks) if capabilities is not None and capabilities.tasks else \
        [common_pb2.TASK_TEXT_TO_IMAGE]
    name = model.pipeline_class if model is not None and model.pipeline_class else "this model"
    task = request.task
    if task and task not in _TASK_INPUTS:
        bad("task", f"unknown task {task}")
        return common_pb2.TASK_TEXT_TO_IMAGE
    if not task:
        if request.mask_image:
            task = common_pb2.TASK_INPAINT
        elif has_image:
            task = common_pb2.TASK_EDIT if common_pb2.TASK_EDIT in served else common_pb2.TASK_IMAGE_TO_IMAGE
        else:
            task = common_pb2.TASK_TEXT_TO_IMAGE
    needs_image, needs_mask, _ = _TASK_INPUTS[task]
    task_label = common_pb2.Task.Name(task)
    if task not in served:
        if request.task:
            bad("task", f"{name} serves {', '.join(map(common_pb2.Task.Name, served))}, not {task_label}")
        elif has_image:
            bad("mask_image" if request.mask_image and common_pb2.TASK_IMAGE_TO_IMAGE in served else "image",
                f"{name} cannot take {'a mask' if request.mask_image else 'an image'} (it serves "
                f"{', '.join(map(common_pb2.Task.Name, served))})")
        else:
            bad("image", f"{name} is an edit model: it needs an image to edit")
        return task
    if needs_image != has_image:
        bad("image", f"{task_label} {'needs an image' if needs_image else 'takes no image'}")
    if needs_mask != bool(request.mask_image):
        bad("mask_image", f"{task_label} {'needs a mask' if needs_mask else 'takes no mask'}")
    return task


def _strength(request: worker_pb2.GenerateRequest, task: int, steps: int, bad: Callable[[str, str], None]) -> float:
    """Image-to-image and inpainting: in (0, 1], at least one step's worth; other tasks take none."""
    if not _TASK_INPUTS.get(task, (False, False, False))[2]:
        if request.HasField("strength"):
            bad("strength", f"{common_pb2.Task.Name(task)} takes no strength")
        return 0.0
    strength = request.strength if request.HasField("strength") else DEFAULT_STRENGTH
    if not math.isfinite(strength) or not 0 < strength <= 1:
        bad("strength", f"must be in (0, 1], got {strength:g}")
    elif int(steps * strength) < 1:
        bad("strength", f"{strength:g} of {steps} steps runs none; raise it or num_inference_steps")
    return strength


def _fits(request: worker_pb2.GenerateRequest, size: tuple[int, int], image_size: tuple[int, int] | None,
          mask_size: tuple[int, int] | None, bad: Callable[[str, str], None]) -> None:
    """The mask has the image's size; the image has the requested one unless resize_mode fits it."""
    if request.resize_mode not in worker_pb2.ResizeMode.values():
        bad("resize_mode", f"unknown resize mode {request.resize_mode}")
    if mask_size is not None and image_size is not None and mask_size != image_size:
        bad("mask_image", f"is {mask_size[0]}x{mask_size[1]}; the image is {image_size[0]}x{image_size[1]}")
    if image_size is not None and image_size != size and request.resize_mode == worker_pb2.RESIZE_MODE_UNSPECIFIED:
        bad("image", f"is {image_size[0]}x{image_size[1]}, not the {size[0]}x{size[1]} asked for; "
                     "set resize_mode to resize or crop it")


def _adapters(request: worker_pb2.GenerateRequest, limits: Limits, registered: Container[str],
              bad: Callable[[str, str], None]) -> tuple[tuple[str, float], ...]:
    """The request's (name, scale) adapters: registered names, each once, finite scales in bounds."""
    if len(request.adapters) > limits.max_request_adapters:
        bad("adapters", f"at most {limits.max_request_adapters} adapters, got {len(request.adapters)}")
        return ()
    chosen: list[tuple[str, float]] = []
    for index, ref in enumerate(request.adapters):
        scale = ref.scale if ref.HasField("scale") else 1.0
        if ref.name not in registered:
            bad(f"adapters[{index}].name", f"adapter {ref.name[:64]!r} is not registered (LoadAdapter)")
        elif any(name == ref.name for name, _ in chosen):
            bad(f"adapters[{index}].name", f"adapter {ref.name!r} appears twice")
        if not math.isfinite(scale) or abs(scale) > limits.max_adapter_scale:
            bad(f"adapters[{index}].scale", f"must be from -{limits.max_adapter_scale:g} to "
                                            f"{limits.max_adapter_scale:g}, got {scale:g}")
        chosen.append((ref.name, scale))
    return tuple(chosen)


def _guidance(request: worker_pb2.GenerateRequest, limits: Limits, model: common_pb2.ModelInfo | None,
              bad: Callable[[str, str], None]) -> tuple[float, float | None]:
    """The guidance_scale and the separate true_cfg_scale (None: not sent) the model takes, each set
    or its default, within ``--max-guidance``; a negative prompt only where the model uses it.

    On a GUIDANCE_KIND_TRUE_CFG model (Qwen-Image) true_cfg_scale is guidance_scale under its
    pipeline's name; with capabilities.true_cfg beside another guidance (Flux) it is a second scale,
    and the negative prompt is used only when that scale is above 1.
    """
    capabilities = model.capabilities if model is not None and model.HasField("capabilities") else None
    name = model.pipeline_class if model is not None and model.pipeline_class else "this model"
    true_cfg_kind = capabilities is not None and capabilities.guidance == common_pb2.GUIDANCE_KIND_TRUE_CFG
    given = request.HasField("guidance_scale")
    guidance = request.guidance_scale if given else _default_guidance(limits, capabilities)
    true_cfg = request.true_cfg_scale if request.HasField("true_cfg_scale") else None
    named = "guidance_scale"  # the field the guidance came in
    if true_cfg is not None and true_cfg_kind:
        if given and true_cfg != guidance:
            bad("true_cfg_scale", f"is {name}'s guidance_scale: set one of them, or both the same")
        guidance, true_cfg, named = true_cfg, None, "true_cfg_scale"
    if not math.isfinite(guidance) or not 0 <= guidance <= limits.max_guidance:
        bad(named, f"must be 0 to {limits.max_guidance:g}, got {guidance:g}")
    elif capabilities is not None and capabilities.guidance == common_pb2.GUIDANCE_KIND_NONE and given:
        bad("guidance_scale", f"{name} takes no guidance")
    separate = capabilities is not None and capabilities.true_cfg and not true_cfg_kind
    if true_cfg is None and separate and capabilities is not None:
        true_cfg = capabilities.default_true_cfg_scale
    if true_cfg is not None:
        if capabilities is not None and not capabilities.true_cfg:
            bad("true_cfg_scale", f"{name} takes no true_cfg_scale")
        elif not math.isfinite(true_cfg) or not 0 <= true_cfg <= limits.max_guidance:
            bad("true_cfg_scale", f"must be 0 to {limits.max_guidance:g}, got {true_cfg:g}")
    if request.negative_prompt and capabilities is not None:
        if not capabilities.negative_prompt:
            bad("negative_prompt", f"{name} takes no negative prompt")
        elif separate and (true_cfg or 0) <= 1:
            bad("negative_prompt", f"{name} uses a negative prompt only with a true_cfg_scale above 1")
    return guidance, true_cfg


def _default_guidance(limits: Limits, capabilities: common_pb2.ModelCapabilities | None) -> float:
    """The model's own default guidance where it reports one (Flux 3.5, SD 7.5, none: 0), else the worker's."""
    if capabilities is None:
        return limits.default_guidance
    if capabilities.guidance == common_pb2.GUIDANCE_KIND_NONE:
        return 0.0
    return capabilities.default_guidance_scale or limits.default_guidance


def _size(value: int, name: str, limits: Limits, model: common_pb2.ModelInfo | None,
          bad: Callable[[str, str], None]) -> int:
    """A width or height on the model's grid: a multiple of the size_multiple it reports (the rule
    the runner enforces, as it is) from the larger of the two minimums to the smaller of the two
    maximums. Unset: the default size, rounded up onto the grid. No model: the bounds only."""
    multiple = model.size_multiple if model is not None and model.size_multiple else 1
    smallest = max(limits.min_size, model.min_size if model else 0, multiple)
    size = value or max(smallest, math.ceil(limits.default_size / multiple) * multiple)
    largest = min(limits.max_size, model.max_size) if model and model.max_size else limits.max_size
    if size % multiple or not smallest <= size <= largest:
        bad(name, f"must be a multiple of {multiple} from {smallest} to {largest}, got {size}")
    return size


def _request_id_problem(request_id: str, limits: Limits) -> str | None:
    if len(request_id) > limits.max_request_id_chars:
        return f"must be at most {limits.max_request_id_chars} characters, got {len(request_id)}"
    if not _REQUEST_ID.fullmatch(request_id):
        return "must be printable ASCII without spaces"
    return None


def request_id_violations(request_id: str, limits: Limits) -> list[Violation]:
    """Cancel's request id: set, and one Generate could have been given."""
    problem = "must not be empty" if not request_id else _request_id_problem(request_id, limits)
    return [("request_id", problem)] if problem is not None else []


def required_text(field: str, value: str, when_empty: str) -> list[Violation]:
    """A path, model, target or name: set (else ``when_empty``), and fit for a path and a log line."""
    if not value:
        return [(field, when_empty)]
    return text_violations([(field, value)])


def adapter_name_violations(name: str) -> list[Violation]:
    """LoadAdapter's and UnloadAdapter's ``name``: one peft can load (``input_rules.ADAPTER_NAME``)."""
    problem = adapter_name_problem(name)
    return [("name", problem)] if problem is not None else []


def tag_violations(tags: Sequence[str], limits: Limits) -> list[Violation]:
    """Bounds on Sleep and WakeUp tags (component names): how many, how long, no control characters."""
    if len(tags) > limits.max_tags:
        return [("tags", f"at most {limits.max_tags} tags, got {len(tags)}")]
    problems = ((index, text_problem(tag, limits.max_tag_chars)) for index, tag in enumerate(tags))
    return [(f"tags[{index}]", problem) for index, problem in problems if problem is not None]
