"""What one request asks of the model, declared once: ``GenerationParams`` (vLLM's SamplingParams).

The worker fills one in from a GenerateRequest with every default applied and every rule checked
(``worker_service.validation.normalize``) and hands it to the runner as an ``ExecuteItem``
(``to_item``); the runner reads it back typed (``from_item``) and runs it. Each field's metadata
says how it travels and whether the requests of one batch must share it (one pipeline call, or one
row group of a step batch, takes one value): the worker's batch key and the runner's check of a
batch are both read off it, so a new per-request field is one declaration here plus the code that
uses it.

``Surface`` says how a caller sets a field outside protobuf (the Python clients' keyword, the CLI's
flag, the OpenAI Images API's JSON or form field) and the kind of value it takes: the HTTP API's
parser, the CLI's flags and the clients' own checks are read off these declarations.

Proto presence: a field declared ``optional`` is None when the message leaves it unset (the
model's or the pipeline's default applies), and is set in the message only when not None.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from diffusion.v1 import common_pb2, runner_pb2
from serving_common.input_rules import Violation, cache_threshold_model_problem

Adapters = tuple[tuple[str, float], ...]  # (name, scale) of each adapter, in the request's order


@dataclass(frozen=True)
class Control:
    """One ControlNet of a request, its defaults applied; its conditioning image travels beside the
    parameters (``ExecuteControl.image``)."""

    name: str
    conditioning_scale: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0


@dataclass(frozen=True)
class ImagePrompt:
    """A request's IP-Adapter and scale; its reference images travel beside the parameters
    (``ExecuteImagePrompt.images``)."""

    name: str
    scale: float = 1.0
    # How many reference images: the adapter attends over all of them at once, so one pipeline call
    # takes one count (part of the batch key through ``ip_adapter``).
    images: int = 1


class Kind(enum.Enum):
    """What a caller's value of a field must be before any bound of the worker or the model."""

    TEXT = "text"
    COUNT = "count"  # a whole number, at least 1 (0 is the unset field)
    SEED = "seed"  # a whole number, 0 to 2^64-1
    SCALE = "scale"  # a finite number >= 0


@dataclass(frozen=True)
class Surface:
    """How a caller sets one field: the Python clients' ``keyword``, the CLI's ``flag`` (on
    ``generate``, and on ``generate-video`` where ``video``), and its name in the OpenAI Images API's
    body (``openai``; None: not offered there)."""

    keyword: str
    flag: str
    kind: Kind
    help: str
    openai: str | None = None
    video: bool = False


# A rule a request's value of a field is held to on the model a ModelInfo describes (None: not known,
# only what every model refuses): why the value is refused, or None.
ModelRule = Callable[[Any, common_pb2.ModelInfo | None], str | None]


def _param(default: Any, shared: bool = False, optional: bool = False, surface: Surface | None = None,
           model_rule: ModelRule | None = None) -> Any:
    """A field of GenerationParams: ``shared`` by every request of a batch; ``optional`` in the proto
    (unset there is None here); ``surface``: how callers set it, where they set it directly;
    ``model_rule``: the whole check of a field the request's value passes through as given (an
    optional one), applied by the worker, the runner and the clients alike (``model_violations``)."""
    return field(default=default, metadata={"shared": shared, "optional": optional, "surface": surface,
                                            "model_rule": model_rule})


@dataclass(frozen=True, kw_only=True)
class GenerationParams:
    """One request's generation parameters, valid, with its defaults applied."""

    prompt: str = _param("")
    negative_prompt: str = _param("", surface=Surface(
        "negative_prompt", "--negative-prompt", Kind.TEXT, "what to steer away from, on models that take one",
        openai="negative_prompt", video=True))
    width: int = _param(0, shared=True)
    height: int = _param(0, shared=True)
    num_inference_steps: int = _param(0, shared=True, surface=Surface(
        "steps", "--steps", Kind.COUNT, "denoising steps; default: the model's or the worker's",
        openai="num_inference_steps", video=True))
    guidance_scale: float = _param(0.0, shared=True, surface=Surface(
        "guidance_scale", "--guidance", Kind.SCALE, "guidance scale, >= 0; default: the model's",
        openai="guidance_scale", video=True))
    seed: int = _param(0, surface=Surface(
        "seed", "--seed", Kind.SEED, "0 to 2^64-1; default: a random seed, printed", openai="seed", video=True))
    num_images: int = _param(1, surface=Surface("num_images", "--num-images", Kind.COUNT, "images; default 1",
                                                openai="n"))
    adapters: Adapters = _param((), shared=True)
    task: common_pb2.Task = _param(common_pb2.TASK_TEXT_TO_IMAGE, shared=True)
    strength: float = _param(0.0, shared=True)  # image-to-image and inpainting only
    # The pipeline's true_cfg_scale where it is separate from guidance_scale (Flux); None: not sent.
    true_cfg_scale: float | None = _param(None, shared=True, optional=True, surface=Surface(
        "true_cfg_scale", "--true-cfg-scale", Kind.SCALE,
        "true classifier-free guidance, >= 0, for models that take it (Flux: above 1 uses the negative prompt); "
        "default: the model's", openai="true_cfg_scale"))
    # The step cache's threshold for this request's images (each row keeps its own); None: the model's.
    cache_threshold: float | None = _param(None, optional=True, model_rule=cache_threshold_model_problem,
                                           surface=Surface(
        "cache_threshold", "--cache-threshold", Kind.SCALE,
        "the step cache's threshold for this request, on a model loaded with a cache; 0: off",
        openai="cache_threshold"))
    # The sampler (a name of the model's ModelCapabilities.samplers); empty: the model's own scheduler.
    # One pipeline call takes one scheduler; a step batch's sequences each keep their own.
    sampler: str = _param("", shared=True, surface=Surface(
        "sampler", "--sampler", Kind.TEXT,
        "the sampler (euler, euler_a, dpmpp_2m_karras, ...: the model's capabilities list its own); "
        "default: the model's scheduler", openai="sampler"))
    num_frames: int = _param(0, shared=True)  # video tasks only
    partial_images: int = _param(0)  # previews streamed at evenly spaced steps
    # ControlNets and an IP-Adapter: one pipeline call takes one set of each (their images per
    # request); a step batch gives each row its own.
    controls: tuple[Control, ...] = _param((), shared=True)
    ip_adapter: ImagePrompt | None = _param(None, shared=True)

    @classmethod
    def declared(cls) -> Iterator[dataclasses.Field[Any]]:
        return iter(dataclasses.fields(GenerationParams))

    @classmethod
    def surfaces(cls) -> Iterator[tuple[str, Surface]]:
        """Each field callers set directly, by its proto name, with how they set it."""
        return ((f.name, f.metadata["surface"]) for f in cls.declared() if f.metadata["surface"] is not None)

    @classmethod
    def shared_names(cls) -> tuple[str, ...]:
        """The fields every request of one batch has the same value of."""
        return tuple(f.name for f in cls.declared() if f.metadata["shared"])

    @classmethod
    def ruled_in(cls, message: Message) -> dict[str, Any]:
        """The fields declared with a ``model_rule`` as ``message`` (a GenerateRequest or an
        ExecuteItem) sets them, by name; None: unset."""
        return {f.name: getattr(message, f.name) if message.HasField(f.name) else None
                for f in cls.declared() if f.metadata["model_rule"] is not None}

    @classmethod
    def model_violations(cls, given: Mapping[str, Any], model: common_pb2.ModelInfo | None) -> list[Violation]:
        """A violation for each value of ``given`` (by field name; None: unset) its field's
        ``model_rule`` refuses on ``model`` (None: not known)."""
        return [(f.name, problem) for f in cls.declared()
                if (rule := f.metadata["model_rule"]) is not None and given.get(f.name) is not None
                and (problem := rule(given[f.name], model)) is not None]

    def batch_key(self) -> tuple[object, ...]:
        """Requests with the same key can share one batch."""
        return tuple(getattr(self, name) for name in self.shared_names())

    def differences(self, other: GenerationParams) -> list[str]:
        """The shared fields whose values differ from ``other``'s: what keeps the two out of one batch."""
        return [name for name in self.shared_names() if getattr(self, name) != getattr(other, name)]

    def params(self) -> GenerationParams:
        """Only the generation parameters (of a subclass that carries more, such as the worker's request)."""
        return GenerationParams(**{f.name: getattr(self, f.name) for f in self.declared()})

    def to_item(self, request_id: str, image: runner_pb2.RawImage | None = None,
                mask_image: runner_pb2.RawImage | None = None,
                control_images: Sequence[runner_pb2.RawImage] = (),
                prompt_images: Sequence[runner_pb2.RawImage] = ()) -> runner_pb2.ExecuteItem:
        """The runner's ExecuteItem of one request; ``control_images`` are the conditioning images of
        ``controls`` in their order, ``prompt_images`` the IP-Adapter's reference images."""
        item = runner_pb2.ExecuteItem(request_id=request_id, image=image, mask_image=mask_image)
        for declared in self.declared():
            value = getattr(self, declared.name)
            if declared.name == "adapters":
                item.adapters.extend(common_pb2.AdapterRef(name=name, scale=scale) for name, scale in value)
            elif declared.name == "controls":
                item.controls.extend(
                    runner_pb2.ExecuteControl(name=control.name, image=control_image,
                                              conditioning_scale=control.conditioning_scale,
                                              guidance_start=control.guidance_start,
                                              guidance_end=control.guidance_end)
                    for control, control_image in zip(value, control_images, strict=True))
            elif declared.name == "ip_adapter":
                if value is not None:
                    item.ip_adapter.CopyFrom(runner_pb2.ExecuteImagePrompt(
                        name=value.name, images=prompt_images, scale=value.scale))
            elif value is not None:
                setattr(item, declared.name, value)
        return item

    @classmethod
    def from_item(cls, item: runner_pb2.ExecuteItem) -> GenerationParams:
        """An ExecuteItem's parameters (its image and mask stay in the item); an unset task is
        text-to-image and an unset adapter scale 1."""
        values: dict[str, Any] = {}
        for declared in cls.declared():
            name = declared.name
            if name == "adapters":
                values[name] = tuple((ref.name, ref.scale if ref.HasField("scale") else 1.0) for ref in item.adapters)
            elif name == "controls":
                values[name] = tuple(Control(control.name, control.conditioning_scale, control.guidance_start,
                                             control.guidance_end) for control in item.controls)
            elif name == "ip_adapter":
                values[name] = (ImagePrompt(item.ip_adapter.name, item.ip_adapter.scale, len(item.ip_adapter.images))
                                if item.HasField("ip_adapter") else None)
            elif declared.metadata["optional"]:
                values[name] = getattr(item, name) if item.HasField(name) else None
            else:
                values[name] = getattr(item, name)
        values["task"] = values["task"] or common_pb2.TASK_TEXT_TO_IMAGE
        return GenerationParams(**values)
