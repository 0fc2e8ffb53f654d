"""The rules of what callers send, written once for the worker and the runner.

Each side maps its own messages onto these calls (the worker's GenerateRequest in
``worker_service.validation``, the runner's ExecuteItem in ``runner_service.execution``) and keeps
its own limits (the worker's flags, the runner's ``BatchLimits``); the rules are here:

- the size grid of a model (``SizeGrid``);
- the task of a request, and the image, mask and strength each task takes;
- the bounds of guidance scales, strengths, adapter scales and counts, and what a model's
  capabilities allow (``ModelTerms``);
- names and strings: adapter names, request ids, and strings that become paths, names or log lines;
- the acceleration a model is loaded with (``AccelerationPlan``: the worker's flags for it, the
  ``Acceleration`` message's mapping and its rules).

A rule says why a value is refused, or None when it is not; the caller names the field, so that a
service answers INVALID_ARGUMENT naming each bad one. A NUL cannot be in a path (the OS refuses
it, Python raises ValueError), and a control character in a name or a log line forges lines or
corrupts what shows it: such strings are refused before anything uses them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from diffusion.v1 import common_pb2
from serving_common.config_flags import option
from serving_common.errors import invalid_argument
from serving_common.protocol import SEED_MODULUS

Violation = tuple[str, str]  # (field, why)

# -- strings and names -----------------------------------------------------------------------------

MAX_PATH_CHARS = 4096
# LoRA adapter names. peft keeps an adapter's layers in a torch ModuleDict under its name, where
# "." is refused (a KeyError at load, "module name can't contain '.'"); "-" and "_" load and run.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ADAPTER_NAME_RULE = "must be 1 to 64 letters, digits, '-' or '_'"
# The names of Acceleration's methods (a cache, a quantization, an attention backend).
_ACCELERATION_NAME = re.compile(r"[A-Za-z0-9_.-]{0,64}")
# The step caches and weight quantizations a runner can offer (AccelerationOffer), on any platform;
# which of them one model takes here is the runner's to say. Attention backends are diffusers' own.
FIRST_BLOCK_CACHE = "first_block_cache"
# cache-dit's DBCache on a transformer: the First Block Cache with front blocks that decide and back
# blocks that always run (the runner's ``row_cache.DualBlockCache``); its threshold is the same kind.
DUAL_BLOCK_CACHE = "dual_block_cache"
# DeepCache on a UNet: its "threshold" is an interval, a whole number of steps (a full step every
# that many; the steps between reuse the deep features).
DEEP_CACHE = "deep_cache"
# TaylorSeer on a transformer: its threshold is an interval too (a computed step every that many; the
# steps between predict the denoiser's output from the computed ones).
TAYLORSEER = "taylorseer"
INTERVAL_CACHES = frozenset({DEEP_CACHE, TAYLORSEER})
INT8_WEIGHT_ONLY, FLOAT8_WEIGHT_ONLY = "int8-weight-only", "float8-weight-only"


@dataclass(frozen=True)
class CacheDefault:
    """A step cache's setting where Acceleration leaves its threshold 0."""

    threshold: float
    warmup_steps: int  # taken only where cache_warmup_steps is 0 too

    def describe(self) -> str:
        return f"threshold {self.threshold:g} with {self.warmup_steps} warmup steps"


def describe_cache(message: common_pb2.Acceleration) -> str:
    """The step cache a model was loaded with and its setting, as a person reads it (``cache`` set)."""
    return f"{message.cache} (threshold {message.cache_threshold:g}, warmup {message.cache_warmup_steps})"


# Each step cache's default, measured as the fastest setting at >= 35 dB PSNR against plain at every
# size measured (docs/acceleration.md#default-thresholds).
CACHE_DEFAULTS = {FIRST_BLOCK_CACHE: CacheDefault(threshold=0.1, warmup_steps=4),
                  DEEP_CACHE: CacheDefault(threshold=5, warmup_steps=2),
                  TAYLORSEER: CacheDefault(threshold=3, warmup_steps=4),
                  DUAL_BLOCK_CACHE: CacheDefault(threshold=0.1, warmup_steps=4)}
CACHE_METHODS = tuple(CACHE_DEFAULTS)
QUANTIZATIONS = (INT8_WEIGHT_ONLY, FLOAT8_WEIGHT_ONLY)
# Request ids name requests in logs and gRPC metadata: printable ASCII without spaces.
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")

# C0 controls (NUL, newline, escape...), DEL, C1 controls and the Unicode line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def text_problem(value: str, max_chars: int = MAX_PATH_CHARS) -> str | None:
    """Why ``value`` cannot be a path, name or log line (too long, or a control character in it);
    None when it can."""
    if len(value) > max_chars:
        return f"must be at most {max_chars} characters, got {len(value)}"
    found = _CONTROL.search(value)
    if found is not None:
        return f"must not contain control characters ({found.group()!r} at {found.start()})"
    return None


def text_violations(fields: Iterable[tuple[str, str]], max_chars: int = MAX_PATH_CHARS) -> list[Violation]:
    """One (field, why) per ``(field, value)`` that ``text_problem`` refuses."""
    return [(field, why) for field, value in fields if (why := text_problem(value, max_chars)) is not None]


def check_text(fields: Iterable[tuple[str, str]], max_chars: int = MAX_PATH_CHARS) -> None:
    """INVALID_ARGUMENT naming each field whose value ``text_problem`` refuses."""
    violations = text_violations(fields, max_chars)
    if violations:
        raise invalid_argument(violations)


def adapter_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter; None when it can."""
    return None if ADAPTER_NAME.fullmatch(name) else ADAPTER_NAME_RULE


def request_id_problem(request_id: str, max_chars: int) -> str | None:
    """Why ``request_id`` cannot name a request (each side has its own ``max_chars``); None when it can."""
    if len(request_id) > max_chars:
        return f"must be at most {max_chars} characters, got {len(request_id)}"
    if not _REQUEST_ID.fullmatch(request_id):
        return "must be printable ASCII without spaces"
    return None


# -- numbers ---------------------------------------------------------------------------------------

# Beyond this, classifier-free guidance only saturates the image (3e38 gave an all-black one).
MAX_GUIDANCE = 100.0
# The strength of image-to-image and inpainting when a request leaves it unset.
DEFAULT_STRENGTH = 0.8


def count_problem(value: int, largest: int) -> str | None:
    """A count (steps, images) from 1 to ``largest``."""
    return None if 1 <= value <= largest else f"must be 1 to {largest}, got {value}"


# What a GenerateRequest carries whatever the worker's flags and model: counts and sizes are uint32s,
# 0 meaning unset (the default), the seed a uint64 (image i takes seed + i, wrapping at 2^64), and
# scales float32s (a larger value arrives as inf).
MAX_UINT32 = 2**32 - 1
MAX_SEED = SEED_MODULUS - 1
MAX_FLOAT32 = (2 - 2**-23) * 2**127


def seed_problem(seed: int) -> str | None:
    """A seed: 0 to 2^64-1."""
    return None if 0 <= seed <= MAX_SEED else f"must be 0 to 2^64-1, got {seed}"


def set_count_problem(value: int) -> str | None:
    """A count or size that a caller sets (steps, images, width, frames...), before the bounds of the
    worker and the model: at least 1, since 0 is the unset field (a caller who means the default
    leaves it unset), and at most a uint32."""
    if value < 1:
        return f"must be at least 1 (leave it unset for the default), got {value}"
    return None if value <= MAX_UINT32 else f"must be at most {MAX_UINT32}, got {value}"


def steps_problem(steps: int, largest: int, model: ModelTerms | None) -> str | None:
    """num_inference_steps: from 1 to ``largest`` and to what the model's schedulers run."""
    if model is not None and 0 < model.max_steps < min(steps, largest + 1):
        most = model.max_steps
        return f"must be 1 to {most}: {model.name}'s scheduler runs at most {most} steps, got {steps}"
    return count_problem(steps, largest)


def guidance_problem(scale: float, largest: float) -> str | None:
    """A guidance scale (``guidance_scale``, ``true_cfg_scale``): finite, from 0 to ``largest``."""
    return None if math.isfinite(scale) and 0 <= scale <= largest else f"must be 0 to {largest:g}, got {scale:g}"


def adapter_scale_problem(scale: float, largest: float) -> str | None:
    """An adapter's scale: finite, at most ``largest`` either way (1e30 overflows its update)."""
    if math.isfinite(scale) and abs(scale) <= largest:
        return None
    return f"must be from -{largest:g} to {largest:g}, got {scale:g}"


@dataclass(frozen=True)
class SizeGrid:
    """The widths and heights a model takes: multiples of ``multiple`` from ``smallest`` to ``largest``."""

    multiple: int
    smallest: int
    largest: int

    @classmethod
    def of(cls, multiple: int, min_size: int, max_size: int, floor: int, ceiling: int) -> SizeGrid:
        """The grid a model reports (size_multiple, min_size, max_size; 0: none reported, as with no
        model), within a side's own bounds ``floor`` to ``ceiling``. The model's multiple is enforced
        as it is, no other grid (such as 8) laid over it; both ends are rounded onto it."""
        multiple = max(multiple, 1)
        largest = min(ceiling, max_size) if max_size else ceiling
        return cls(multiple, math.ceil(max(floor, min_size, 1) / multiple) * multiple, largest // multiple * multiple)

    def problem(self, size: int) -> str | None:
        if size % self.multiple == 0 and self.smallest <= size <= self.largest:
            return None
        return f"must be a multiple of {self.multiple} from {self.smallest} to {self.largest}, got {size}"

    def default(self, preferred: int) -> int:
        """``preferred`` rounded up onto the grid, and at least its smallest size."""
        return max(self.smallest, math.ceil(preferred / self.multiple) * self.multiple)


# -- what a model takes ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelTerms:
    """What a loaded model's capabilities allow a request, as far as the rules go."""

    name: str  # how refusals name the model: its pipeline class
    tasks: tuple[int, ...]  # the common_pb2.Task values it serves
    negative_prompt: bool  # with a separate true_cfg_scale: used only when that scale is above 1
    guidance: int  # common_pb2.GuidanceKind
    default_guidance: float
    true_cfg: bool  # its pipeline takes true_cfg_scale
    default_true_cfg: float
    cache: str = ""  # the step cache it was loaded with (Acceleration.cache); empty: none
    max_steps: int = 0  # the most steps its schedulers run (ModelCapabilities.max_steps); 0: not known
    samplers: tuple[str, ...] = ()  # the samplers a request may name (ModelCapabilities.samplers)

    @property
    def separate_true_cfg(self) -> bool:
        """Whether true_cfg_scale is a scale of its own (Flux), not where guidance_scale goes
        (Qwen-Image, GUIDANCE_KIND_TRUE_CFG)."""
        return self.true_cfg and self.guidance != common_pb2.GUIDANCE_KIND_TRUE_CFG

    @classmethod
    def from_model_info(cls, model: common_pb2.ModelInfo | None) -> ModelTerms | None:
        """The terms of the model a ModelInfo describes, as the runner reports it and both sides read
        it; None where it reports no capabilities (a runner that predates them: the worker's own
        bounds and defaults apply, and text-to-image only)."""
        if model is None or not model.HasField("capabilities"):
            return None
        capabilities = model.capabilities
        return cls(name=model.pipeline_class or "this model", tasks=tuple(capabilities.tasks),
                   negative_prompt=capabilities.negative_prompt, guidance=capabilities.guidance,
                   default_guidance=capabilities.default_guidance_scale, true_cfg=capabilities.true_cfg,
                   default_true_cfg=capabilities.default_true_cfg_scale, cache=model.acceleration.cache,
                   max_steps=capabilities.max_steps, samplers=tuple(capabilities.samplers))


# A sampler's name as a refusal quotes it.
_SHOWN_SAMPLER_CHARS = 64


def sampler_problem(sampler: str, model: ModelTerms | None) -> str | None:
    """A request's sampler: empty (the model's own scheduler) or one the model offers; where the model
    is not known (None), any name fit for a log line, which the runner then checks."""
    if not sampler:
        return None
    if model is None:
        return text_problem(sampler, _SHOWN_SAMPLER_CHARS)
    if sampler in model.samplers:
        return None
    if not model.samplers:
        return f"{model.name} offers no samplers: leave it empty for its own scheduler"
    return (f"unknown sampler {sampler[:_SHOWN_SAMPLER_CHARS]!r}: one of {', '.join(model.samplers)}, "
            "or empty for the model's own scheduler")


def true_cfg_problem(model: ModelTerms | None, scale: float, largest: float) -> str | None:
    """A true_cfg_scale of its own: only where the model takes one (None: not known), in the
    guidance bounds. On a GUIDANCE_KIND_TRUE_CFG model it is guidance_scale under another name,
    which only the worker's request maps."""
    if model is not None and not model.true_cfg:
        return f"{model.name} takes no true_cfg_scale"
    if model is not None and not model.separate_true_cfg:
        return f"is {model.name}'s guidance_scale: send it as guidance_scale"
    return guidance_problem(scale, largest)


def acceleration_violations(message: common_pb2.Acceleration) -> list[Violation]:
    """An Acceleration's own consistency (what a model can take is the runner's to say): method names
    of at most 64 letters, digits, '_', '.' or '-', a cache and a quantization among those any runner
    offers; a cache's threshold finite and >= 0 (0: the method's default, ``with_cache_defaults``),
    a whole number for an interval cache (its interval), and a threshold or warmup steps only with a
    cache. A method's own violation comes before its
    threshold's. Init, LoadModel and the worker's flags."""
    violations = [(f"acceleration.{name}", problem) for name, known in (
        ("cache", CACHE_METHODS), ("quantization", QUANTIZATIONS), ("attention_backend", None))
        if (problem := _method_problem(getattr(message, name), known))]
    if message.cache and not (math.isfinite(message.cache_threshold) and message.cache_threshold >= 0):
        violations.append(("acceleration.cache_threshold",
                           f"must be finite and >= 0 with a cache (0: the method's default), "
                           f"got {message.cache_threshold:g}"))
    elif (problem := _interval_problem(message.cache_threshold, message.cache)) is not None:
        violations.append(("acceleration.cache_threshold", problem))
    if not message.cache and (message.cache_threshold or message.cache_warmup_steps):
        violations.append(("acceleration.cache", "a cache_threshold or cache_warmup_steps needs a cache method"))
    return violations


def with_cache_defaults(message: common_pb2.Acceleration) -> common_pb2.Acceleration:
    """``message`` with its cache's default (``CACHE_DEFAULTS``) where its threshold is 0: the
    threshold, and the warmup steps where those are 0 too; an explicit threshold is kept as it is,
    its warmup steps with it. A message without a known cache is returned as it is."""
    default = CACHE_DEFAULTS.get(message.cache)
    if default is None or message.cache_threshold:
        return message
    filled = common_pb2.Acceleration()
    filled.CopyFrom(message)
    filled.cache_threshold = default.threshold
    filled.cache_warmup_steps = message.cache_warmup_steps or default.warmup_steps
    return filled


@dataclass(frozen=True)
class AccelerationPlan:
    """What a model is loaded with, declared once: each field is the ``Acceleration`` message's
    field of its name (``from_proto``, ``to_proto``) and, in the worker's config, a flag for
    --model (``serving_common.config_flags``). Every field unset (the default) is plain diffusers;
    docs/acceleration.md says which method suits which family, and what a model and the platform
    can take is checked by ``runner_service.acceleration.apply``."""

    cache: str = option("", f"step cache: {', '.join(CACHE_METHODS)}; empty: none")
    cache_threshold: float = option(0.0, "the step cache's threshold; 0: the method's default (" + "; ".join(
        f"{name}: {default.describe()}" for name, default in CACHE_DEFAULTS.items()) + "); a request may set its own",
                                    at_least=0)
    cache_warmup_steps: int = option(0, "steps at the start of every image that run the whole denoiser; with "
                                        "--cache-threshold 0, 0 takes the method's default", at_least=0)
    compile: bool = option(False, "compile the denoiser's repeated blocks (torch.compile) before the model serves")
    quantization: str = option("", f"weight quantization of the denoiser: {', '.join(QUANTIZATIONS)}; empty: none")
    attention_backend: str = option("", "attention backend of diffusers' dispatcher (native, ...); empty: the "
                                         "model's own")

    @classmethod
    def from_proto(cls, message: common_pb2.Acceleration) -> AccelerationPlan:
        """The message's plan, a cache's threshold of 0 taking the method's default
        (``with_cache_defaults``); INVALID_ARGUMENT naming the field where it contradicts itself
        (``acceleration_violations``)."""
        violations = acceleration_violations(message)
        if violations:
            raise invalid_argument(violations)
        message = with_cache_defaults(message)
        return cls(**{field.name: getattr(message, field.name) for field in dataclasses.fields(cls)})

    def to_proto(self) -> common_pb2.Acceleration:
        return common_pb2.Acceleration(**dataclasses.asdict(self))

    @property
    def plain(self) -> bool:
        return self == AccelerationPlan()


def _method_problem(name: str, known: tuple[str, ...] | None) -> str | None:
    if not _ACCELERATION_NAME.fullmatch(name):
        return "must be at most 64 letters, digits, '_', '.' or '-'"
    if name and known is not None and name not in known:
        return f"unknown {name!r}: one of {', '.join(known)}, or empty for none"
    return None


def cache_threshold_problem(threshold: float, cache: str | None, model: str = "this model") -> str | None:
    """A request's step cache threshold: finite and >= 0, and above 0 only on a model loaded with a
    cache (``cache``: its Acceleration.cache, empty for none; None: not known), a whole number (the
    interval) on an interval cache's; 0 turns caching off, on any model."""
    if not (math.isfinite(threshold) and threshold >= 0):
        return f"must be finite and >= 0, got {threshold:g}"
    if threshold > 0 and cache == "":
        return f"{model} was loaded without a step cache (Init with acceleration.cache); 0 or unset only"
    return _interval_problem(threshold, cache)


def cache_threshold_model_problem(threshold: float, model: common_pb2.ModelInfo | None) -> str | None:
    """``cache_threshold_problem`` on the model ``model`` describes (None: not known), whose
    acceleration is known also where its runner reports no capabilities."""
    if model is None:
        return cache_threshold_problem(threshold, None)
    return cache_threshold_problem(threshold, model.acceleration.cache, model.pipeline_class or "this model")


def _interval_problem(threshold: float, cache: str | None) -> str | None:
    """An interval cache's threshold is its interval: a whole number of steps."""
    if cache in INTERVAL_CACHES and threshold != int(threshold):
        return f"{cache}'s threshold is its interval, a whole number of steps, got {threshold:g}"
    return None


def negative_prompt_problem(model: ModelTerms | None, true_cfg: float | None) -> str | None:
    """A negative prompt only where the model uses it: with a separate true CFG, only when the
    request's true_cfg_scale (None: the model's default) is above 1."""
    if model is None:
        return None
    if not model.negative_prompt:
        return f"{model.name} takes no negative prompt"
    if model.separate_true_cfg and (model.default_true_cfg if true_cfg is None else true_cfg) <= 1:
        return f"{model.name} uses a negative prompt only with a true_cfg_scale above 1"
    return None


# -- tasks and their inputs ------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskInputs:
    """What a task takes besides the prompt."""

    image: bool
    mask: bool
    strength: bool


TASK_INPUTS: dict[int, TaskInputs] = {
    common_pb2.TASK_TEXT_TO_IMAGE: TaskInputs(image=False, mask=False, strength=False),
    common_pb2.TASK_IMAGE_TO_IMAGE: TaskInputs(image=True, mask=False, strength=True),
    common_pb2.TASK_INPAINT: TaskInputs(image=True, mask=True, strength=True),
    common_pb2.TASK_EDIT: TaskInputs(image=True, mask=False, strength=False),
    common_pb2.TASK_TEXT_TO_VIDEO: TaskInputs(image=False, mask=False, strength=False),
    common_pb2.TASK_IMAGE_TO_VIDEO: TaskInputs(image=True, mask=False, strength=False),
}
VIDEO_TASKS = frozenset({common_pb2.TASK_TEXT_TO_VIDEO, common_pb2.TASK_IMAGE_TO_VIDEO})


def task_inputs(task: int) -> TaskInputs:
    """What ``task`` takes; an unknown task takes nothing (it is refused as such)."""
    return TASK_INPUTS.get(task, TASK_INPUTS[common_pb2.TASK_TEXT_TO_IMAGE])


def task_label(task: int) -> str:
    return common_pb2.Task.Name(task) if task in common_pb2.Task.values() else str(task)


def chosen_task(asked: int, image: bool, mask: bool, served: Sequence[int]) -> int:
    """The task asked for or, unset, the one the inputs call for: a mask inpaints, an image is
    edited by a model that edits, animated by a video model and transformed otherwise, no image
    is text-to-image, or text-to-video on a video model."""
    if asked:
        return asked
    if mask:
        return common_pb2.TASK_INPAINT
    if image:
        for task in (common_pb2.TASK_EDIT, common_pb2.TASK_IMAGE_TO_VIDEO):
            if task in served:
                return task
        return common_pb2.TASK_IMAGE_TO_IMAGE
    if common_pb2.TASK_TEXT_TO_IMAGE not in served and common_pb2.TASK_TEXT_TO_VIDEO in served:
        return common_pb2.TASK_TEXT_TO_VIDEO
    return common_pb2.TASK_TEXT_TO_IMAGE


def task_violations(task: int, served: Sequence[int] | None, name: str, image: bool, mask: bool,
                    asked: bool = True) -> list[Violation]:
    """The task is known, one the model serves (``served`` None: not known), and has the image and
    mask it needs. A task not ``asked`` for, but chosen from the inputs, is refused naming them."""
    if task not in TASK_INPUTS:
        return [("task", f"unknown task {task}")]
    if served is not None and task not in served:
        listed = ", ".join(map(task_label, served))
        if asked:
            return [("task", f"{name} serves {listed}, not {task_label(task)}")]
        if image:
            return [("mask_image" if mask and common_pb2.TASK_IMAGE_TO_IMAGE in served else "image",
                     f"{name} cannot take {'a mask' if mask else 'an image'} (it serves {listed})")]
        return [("image", f"{name} is an edit model: it needs an image to edit")]
    needs = TASK_INPUTS[task]
    violations = []
    if needs.image != image:
        violations.append(("image", f"{task_label(task)} {'needs an image' if needs.image else 'takes no image'}"))
    if needs.mask != mask:
        violations.append(("mask_image", f"{task_label(task)} {'needs a mask' if needs.mask else 'takes no mask'}"))
    return violations


def strength_problem(task: int, strength: float | None, steps: int) -> str | None:
    """Image-to-image and inpainting take a strength (None: none sent) in (0, 1], at least one of
    ``steps``' worth (the pipeline runs steps x strength of them); other tasks take none."""
    if not task_inputs(task).strength:
        return None if strength is None else f"{task_label(task)} takes no strength"
    if strength is None or not math.isfinite(strength) or not 0 < strength <= 1:
        return f"must be in (0, 1], got {'none' if strength is None else format(strength, 'g')}"
    if int(steps * strength) < 1:
        return f"{strength:g} of {steps} steps runs none; raise it or num_inference_steps"
    return None


# -- videos ----------------------------------------------------------------------------------------

def num_frames_problem(task: int, num_frames: int, video: common_pb2.VideoCapabilities | None) -> str | None:
    """A video task takes ``num_frames`` (already defaulted: 0 only where the model is unknown) on
    the model's grid, frame_step x k + 1 within [min_frames, max_frames] (``video`` None: the model
    is not known yet); other tasks take none."""
    if task not in VIDEO_TASKS:
        return None if not num_frames else f"{task_label(task)} takes no num_frames (video tasks only)"
    if video is None:
        return None
    step = video.frame_step or 1
    if (num_frames - 1) % step or not video.min_frames <= num_frames <= video.max_frames:
        return (f"must be {step}k+1 frames within [{video.min_frames}, {video.max_frames}], got {num_frames}"
                if step > 1 else f"must be within [{video.min_frames}, {video.max_frames}], got {num_frames}")
    return None


def fps_problem(task: int, fps: int, video: common_pb2.VideoCapabilities | None) -> str | None:
    """A video task's ``fps`` (already defaulted) within the model's range; other tasks take none."""
    if task not in VIDEO_TASKS:
        return None if not fps else f"{task_label(task)} takes no fps (video tasks only)"
    if video is not None and not video.min_fps <= fps <= video.max_fps:
        return f"must be within [{video.min_fps}, {video.max_fps}], got {fps}"
    return None


# -- previews --------------------------------------------------------------------------------------

# The most latent previews a request may ask of each image (OpenAI's partial_images: 0 to 3).
MAX_PARTIAL_IMAGES = 3


def partial_images_problem(task: int, count: int) -> str | None:
    """``partial_images``: 0 to MAX_PARTIAL_IMAGES previews of each image, for image tasks only."""
    if count > MAX_PARTIAL_IMAGES:
        return f"must be 0 to {MAX_PARTIAL_IMAGES}, got {count}"
    if count and task in VIDEO_TASKS:
        return f"{task_label(task)} takes no partial_images (image tasks only)"
    return None
