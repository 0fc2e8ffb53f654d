"""The body of ``POST /v1/images/generations`` as the GenerateRequest it stands for.

Only what a protobuf field cannot say is checked here: JSON types, the ``size`` syntax, the
OpenAI-only fields. Bounds (sizes, steps, images, prompt length, guidance) are
``validation.normalize``'s, reached through the servicer exactly as a gRPC Generate reaches them;
its violations name gRPC fields, which ``openai_param`` turns back into the OpenAI names.

Fields:

- ``prompt`` (required, non-empty), ``n`` (``num_images``), ``size`` (``"WIDTHxHEIGHT"``;
  ``"auto"`` or absent: the worker's default), ``response_format`` (``b64_json``, the default;
  ``url`` is refused: there is no object store to serve URLs from), ``output_format`` (``png``,
  the default, ``jpeg`` or ``webp``), ``model`` (checked by the route against the loaded model).
- Extensions, sent by the SDK through ``extra_body``: ``negative_prompt``, ``seed``,
  ``num_inference_steps``, ``guidance_scale``, as in GenerateRequest.
- Accepted and ignored, because OpenAI documents them and ignoring them cannot mislead the
  caller about what it gets: ``quality`` and ``style`` (hints on the look, which here follows the
  prompt and ``num_inference_steps``; their documented values only), ``user`` and
  ``safety_identifier`` (end-user ids for OpenAI's abuse monitoring: nothing is monitored or
  kept here), and ``stream`` when false (the default).
- Anything else (``background``, ``moderation``, ``output_compression``, ``partial_images``,
  ``stream: true``, unknown names) is refused with 400 naming it, never silently dropped.

``null`` is the same as absent for every field but ``prompt``, as in OpenAI's API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from diffusion.v1 import worker_pb2
from serving_common.errors import invalid_argument

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
SIZE = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")
OUTPUT_FORMATS = {"png": worker_pb2.OUTPUT_FORMAT_PNG, "jpeg": worker_pb2.OUTPUT_FORMAT_JPEG,
                  "webp": worker_pb2.OUTPUT_FORMAT_WEBP}
# The documented values of the ignored hints (openai-python's ImageGenerateParams).
QUALITIES = frozenset({"auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"})
STYLES = frozenset({"vivid", "natural"})
IGNORED = frozenset({"quality", "style", "user", "safety_identifier", "stream"})
EXTENSIONS = frozenset({"negative_prompt", "seed", "num_inference_steps", "guidance_scale"})
FIELDS = frozenset({"prompt", "n", "size", "response_format", "output_format", "model"}) | EXTENSIONS | IGNORED

# GenerateRequest field -> the OpenAI field a caller set it with.
OPENAI_NAMES = {"num_images": "n", "width": "size", "height": "size"}


@dataclass(frozen=True)
class ImagesRequest:
    """A parsed body: the GenerateRequest (no request id yet) and the ``model`` asked for, if any."""

    request: worker_pb2.GenerateRequest
    model: str | None


def openai_param(field: str) -> tuple[str, str]:
    """The OpenAI name of a GenerateRequest field, and the words that say which part of it is meant
    (``size`` holds width and height)."""
    name = OPENAI_NAMES.get(field, field)
    return name, (f"{field} " if name == "size" else "")


def parse_generation(body: object) -> ImagesRequest:
    """``body`` (parsed JSON) as a GenerateRequest; raises INVALID_ARGUMENT naming each bad field."""
    if not isinstance(body, dict):
        raise invalid_argument((), "the request body must be a JSON object")
    violations: list[tuple[str, str]] = []
    bad = violations.append
    unknown = sorted(str(name) for name in body if name not in FIELDS)
    for name in unknown:
        bad((name, "unknown or unsupported parameter"))
    fields: dict[str, Any] = {name: value for name, value in body.items() if value is not None}
    request = worker_pb2.GenerateRequest()

    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        bad(("prompt", "is required: a non-empty string"))
    else:
        request.prompt = prompt
    if "negative_prompt" in fields:
        if isinstance(fields["negative_prompt"], str):
            request.negative_prompt = fields["negative_prompt"]
        else:
            bad(("negative_prompt", "must be a string"))
    for name, target, lowest, highest in (("n", "num_images", 1, UINT32_MAX),
                                          ("num_inference_steps", "num_inference_steps", 1, UINT32_MAX),
                                          ("seed", "seed", 0, UINT64_MAX)):
        if name in fields:
            value = fields[name]
            if _is_int(value) and lowest <= value <= highest:
                setattr(request, target, value)
            else:
                bad((name, f"must be an integer from {lowest} to {highest}, got {value!r}"))
    if "guidance_scale" in fields:
        if isinstance(fields["guidance_scale"], int | float) and not isinstance(fields["guidance_scale"], bool):
            request.guidance_scale = float(fields["guidance_scale"])
        else:
            bad(("guidance_scale", "must be a number"))

    size = fields.get("size", "auto")
    match = SIZE.fullmatch(size) if isinstance(size, str) else None
    if match:
        request.width, request.height = int(match[1]), int(match[2])
    elif size != "auto":
        bad(("size", f"must be WIDTHxHEIGHT (for example 64x64) or auto, got {size!r}"))

    response_format = fields.get("response_format", "b64_json")
    if response_format == "url":
        bad(("response_format", "url is not supported: this worker keeps no object store to serve image URLs "
                                "from; use b64_json (the default)"))
    elif response_format != "b64_json":
        bad(("response_format", f"must be b64_json, got {response_format!r}"))
    output_format = fields.get("output_format", "png")
    if isinstance(output_format, str) and output_format in OUTPUT_FORMATS:
        request.output_format = OUTPUT_FORMATS[output_format]
    else:
        bad(("output_format", f"must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}"))

    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        bad(("model", "must be a string"))
    violations.extend(_ignored_violations(fields))
    if violations:
        raise invalid_argument(violations)
    return ImagesRequest(request, model)


def _ignored_violations(fields: dict[str, Any]) -> list[tuple[str, str]]:
    """Ignored fields still have to be what OpenAI documents, so a typo is not silently dropped."""
    found = []
    for name, allowed in (("quality", QUALITIES), ("style", STYLES)):
        if name in fields and not (isinstance(fields[name], str) and fields[name] in allowed):
            found.append((name, f"must be one of {', '.join(sorted(allowed))}, got {fields[name]!r}"))
    for name in ("user", "safety_identifier"):
        if name in fields and not isinstance(fields[name], str):
            found.append((name, "must be a string"))
    if fields.get("stream", False) is not False:
        found.append(("stream", "streaming is not supported here; GenerateStream (gRPC) streams progress"))
    return found


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
