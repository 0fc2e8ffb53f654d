"""A request's ControlNets and IP-Adapter image prompt as the clients take them (``controls=``,
``ip_adapter=``), and the protobuf messages they become (docs/conditioning.md).

``Control`` and ``ImagePrompt`` are the typed forms; plain dicts with the same keys (or the proto's
names: ``conditioning_scale``, ``guidance_start``, ``guidance_end``) work too. Images are whatever
``clients.types.image_bytes`` takes: encoded bytes, a path, a PIL image or a numpy array. What the
worker refuses whatever its model (more than 3 controls, a scale outside [0, 2], start >= end, 0 or
more than 4 reference images) raises ``InvalidArgument`` here, naming the field as the worker would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from clients.errors import refusal
from diffusion.v1 import common_pb2
from serving_common import conditioning_rules
from serving_common.conditioning_rules import MAX_CONTROLS, MAX_PROMPT_IMAGES

# Turns an image given in any accepted form into the bytes a request carries.
ToBytes = Callable[[Any], bytes]


@dataclass(frozen=True)
class Control:
    """One ControlNet for one request: ``name`` (registered with ``load_adapter(..., kind="controlnet")``),
    the conditioning ``image`` (fitted to the request's size as its input image is), ``scale`` (the
    conditioning scale, 0 to 2; None: 1), and the fraction of the steps it steers, ``start`` to ``end``
    (None: 0 and 1)."""

    name: str
    image: Any
    scale: float | None = None
    start: float | None = None
    end: float | None = None


@dataclass(frozen=True)
class ImagePrompt:
    """An IP-Adapter image prompt: ``name`` (registered with ``load_adapter(..., kind="ip_adapter")``),
    1 to 4 reference ``images`` (or one image), and ``scale`` (0 to 2; None: 1)."""

    name: str
    images: Any
    scale: float | None = None


_CONTROL_KEYS = {"name": "name", "image": "image", "scale": "scale", "conditioning_scale": "scale",
                 "start": "start", "guidance_start": "start", "end": "end", "guidance_end": "end"}


def _control(given: Control | Mapping[str, Any]) -> Control:
    if isinstance(given, Control):
        return given
    unknown = sorted(set(given) - set(_CONTROL_KEYS))
    if unknown:
        raise ValueError(f"a control takes {', '.join(sorted(_CONTROL_KEYS))}; not {', '.join(unknown)}")
    return Control(**{_CONTROL_KEYS[key]: value for key, value in given.items()})


def _image_prompt(given: ImagePrompt | Mapping[str, Any]) -> ImagePrompt:
    if isinstance(given, ImagePrompt):
        return given
    unknown = sorted(set(given) - {"name", "images", "scale"})
    if unknown:
        raise ValueError(f"an image prompt takes images, name and scale; not {', '.join(unknown)}")
    return ImagePrompt(**given)


def _one_or_many(images: Any) -> list[Any]:
    """A single image (bytes, a path, a PIL image, an array) as a list of one; a list or tuple as it is."""
    return list(images) if isinstance(images, list | tuple) else [images]


def control_inputs(controls: Iterable[Control | Mapping[str, Any]], to_bytes: ToBytes) -> list[common_pb2.ControlInput]:
    """The ControlInputs of ``controls``; raises ``InvalidArgument`` naming what the worker would refuse."""
    built = [_control(given) for given in controls]
    violations = []
    problem = conditioning_rules.count_problem(len(built), MAX_CONTROLS, "controls")
    if problem is not None:
        violations.append(("controls", problem))
    messages = []
    for index, control in enumerate(built):
        message = common_pb2.ControlInput(name=control.name, image=to_bytes(control.image))
        if control.scale is not None:
            message.conditioning_scale = control.scale
            if (problem := conditioning_rules.scale_problem(control.scale)) is not None:
                violations.append((f"controls[{index}].conditioning_scale", problem))
        if control.start is not None:
            message.guidance_start = control.start
        if control.end is not None:
            message.guidance_end = control.end
        window = conditioning_rules.guidance_window_problems(0.0 if control.start is None else control.start,
                                                             1.0 if control.end is None else control.end)
        violations += [(f"controls[{index}].{field}", why) for field, why in window]
        messages.append(message)
    if violations:
        raise refusal(violations)
    return messages


def image_prompt(given: ImagePrompt | Mapping[str, Any], to_bytes: ToBytes) -> common_pb2.ImagePrompt:
    """The ImagePrompt message of ``given``; raises ``InvalidArgument`` naming what the worker would refuse."""
    prompt = _image_prompt(given)
    images = _one_or_many(prompt.images)
    violations = []
    if not images or len(images) > MAX_PROMPT_IMAGES:
        violations.append(("ip_adapter.images", f"1 to {MAX_PROMPT_IMAGES} reference images, got {len(images)}"))
    message = common_pb2.ImagePrompt(name=prompt.name, images=[to_bytes(image) for image in images])
    if prompt.scale is not None:
        message.scale = prompt.scale
        if (problem := conditioning_rules.scale_problem(prompt.scale)) is not None:
            violations.append(("ip_adapter.scale", problem))
    if violations:
        raise refusal(violations)
    return message
