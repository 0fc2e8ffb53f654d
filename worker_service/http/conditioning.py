"""The Images API's ``controls`` and ``ip_adapter`` (sent by the SDK through ``extra_body``) as
GenerateRequest's ControlInputs and ImagePrompt (docs/conditioning.md):

- ``controls``: an array of at most 3 objects ``{"name", "image", "conditioning_scale",
  "guidance_start", "guidance_end"}`` (name and image required);
- ``ip_adapter``: an object ``{"name", "images", "scale"}``, 1 to 4 images.

Each image is base64 (standard alphabet, padded) or a ``data:`` URL holding base64, decoded here
only after the counts are checked; the body that holds them is bounded before it is parsed
(``body``, ``edits``), and the decoded images take a gRPC Generate's path from there
(``--max-input-bytes``, headers checked before any pixel is decoded). In a multipart edit each is a
text field holding that JSON. Everything else (bounds of the scales, names registered, the model's
family) is ``validation.normalize``'s, whose violations name the same fields.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from typing import Any

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.conditioning_rules import MAX_CONTROLS, MAX_PROMPT_IMAGES
from worker_service.http.values import json_number, shown, shown_name

Bad = Callable[[tuple[str, str]], None]
CONDITIONING_FIELDS = frozenset({"controls", "ip_adapter"})
CONTROL_NUMBERS = ("conditioning_scale", "guidance_start", "guidance_end")
DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,")


def parse_conditioning(fields: dict[str, Any], request: worker_pb2.GenerateRequest, bad: Bad) -> None:
    """``controls`` and ``ip_adapter`` of a body's ``fields`` (null: absent) into ``request``."""
    if "controls" in fields:
        request.controls.extend(_controls(fields["controls"], bad))
    if "ip_adapter" in fields:
        prompt = _image_prompt(fields["ip_adapter"], bad)
        if prompt is not None:
            request.ip_adapter.CopyFrom(prompt)


def form_json(name: str, text: str, bad: Bad) -> object:
    """A multipart text field that holds ``controls`` or ``ip_adapter`` as JSON; None (and named in
    ``bad``) when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        bad((name, "must be JSON: the same value as in a JSON body"))
        return None


def _image(value: object, field: str, bad: Bad) -> bytes:
    """An image given as base64 or a base64 ``data:`` URL, decoded; b"" (and named) when it is neither."""
    if not isinstance(value, str) or not value:
        bad((field, "is required: the image as base64 or a data: URL"))
        return b""
    encoded = value[match.end():] if (match := DATA_URL.match(value)) else value
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        bad((field, "must be base64 (or a data:image/...;base64, URL)"))
        return b""


def _controls(value: object, bad: Bad) -> list[common_pb2.ControlInput]:
    if not isinstance(value, list):
        bad(("controls", f"must be an array of objects, got {shown(value)}"))
        return []
    if len(value) > MAX_CONTROLS:
        bad(("controls", f"at most {MAX_CONTROLS} controls, got {len(value)}"))
        return []
    controls = []
    for index, given in enumerate(value):
        at = f"controls[{index}]"
        if not isinstance(given, dict):
            bad((at, f"must be an object with name and image, got {shown(given)}"))
            continue
        for key in sorted(set(given) - {"name", "image", *CONTROL_NUMBERS}):
            bad((f"{at}.{shown_name(key)}", "unknown or unsupported parameter"))
        control = common_pb2.ControlInput(name=_name(given.get("name"), f"{at}.name", bad),
                                          image=_image(given.get("image"), f"{at}.image", bad))
        for key in CONTROL_NUMBERS:
            if given.get(key) is not None:
                number = json_number(given[key])
                if number is None:
                    bad((f"{at}.{key}", f"must be a finite number, got {shown(given[key])}"))
                else:
                    setattr(control, key, number)  # its bounds are normalize's
        controls.append(control)
    return controls


def _image_prompt(value: object, bad: Bad) -> common_pb2.ImagePrompt | None:
    if not isinstance(value, dict):
        bad(("ip_adapter", f"must be an object with name and images, got {shown(value)}"))
        return None
    for key in sorted(set(value) - {"name", "images", "scale"}):
        bad((f"ip_adapter.{shown_name(key)}", "unknown or unsupported parameter"))
    images = value.get("images")
    if not isinstance(images, list) or not 1 <= len(images) <= MAX_PROMPT_IMAGES:
        bad(("ip_adapter.images", f"must be an array of 1 to {MAX_PROMPT_IMAGES} images (base64), got "
                                  f"{len(images) if isinstance(images, list) else shown(images)}"))
        images = []
    prompt = common_pb2.ImagePrompt(name=_name(value.get("name"), "ip_adapter.name", bad),
                                    images=[_image(image, f"ip_adapter.images[{i}]", bad)
                                            for i, image in enumerate(images)])
    if value.get("scale") is not None:
        scale = json_number(value["scale"])
        if scale is None:
            bad(("ip_adapter.scale", f"must be a finite number, got {shown(value['scale'])}"))
        else:
            prompt.scale = scale
    return prompt


def _name(value: object, field: str, bad: Bad) -> str:
    if not isinstance(value, str) or not value:
        bad((field, "is required: the name it was registered under"))
        return ""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        bad((field, "must be valid Unicode"))
        return ""
    return value
