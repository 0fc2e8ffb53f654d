"""The body of ``POST /v1/images/generations`` as the GenerateRequest it stands for.

Only what a protobuf field cannot say is checked here: JSON types, the ``size`` syntax, the
OpenAI-only fields. Bounds (sizes, steps, images, prompt length, guidance) are
``validation.normalize``'s, reached through the servicer exactly as a gRPC Generate reaches them;
its violations name gRPC fields, which ``openai_param`` turns back into the OpenAI names.

Fields:

- ``prompt`` (required, non-empty), ``n`` (``num_images``), ``size`` (``"WIDTHxHEIGHT"``;
  ``"auto"`` or absent: the worker's default), ``response_format`` (``b64_json``, the default,
  or ``url``: the images are kept in the worker's ``image_store`` and ``image_urls`` serves them),
  ``output_format`` (``png``, the default, ``jpeg`` or ``webp``), ``model`` (checked by the route
  against the loaded model).
- Extensions, sent by the SDK through ``extra_body``: every field ``GenerationParams`` declares an
  OpenAI name for (its ``Surface.openai``: ``negative_prompt``, ``seed``, ``num_inference_steps``, the
  scales, ...; ``n`` is OpenAI's own), read by its kind, as in GenerateRequest.
- Accepted and ignored, because OpenAI documents them and ignoring them cannot mislead the
  caller about what it gets: ``quality`` and ``style`` (hints on the look, which here follows the
  prompt and ``num_inference_steps``; their documented values only), ``user`` and
  ``safety_identifier`` (end-user ids for OpenAI's abuse monitoring: nothing is monitored or
  kept here).
- ControlNets and an IP-Adapter image prompt: ``controls`` and ``ip_adapter``, their images in
  base64 (``conditioning``).
- Streaming: ``stream`` (``true``: the images come as server-sent events, ``image_stream``) and
  ``partial_images`` (previews of each image before it, with ``stream: true`` only; its bounds,
  0 to 3, are ``normalize``'s).
- Anything else (``background``, ``moderation``, ``output_compression``, unknown names) is
  refused with 400 naming it, never silently dropped.

``null`` is the same as absent for every field but ``prompt``, as in OpenAI's API.

Whatever the body holds, a bad field is a 400 naming it, never a 500: strings must be valid
Unicode (a JSON ``"\\ud800"`` escape is a lone surrogate, which protobuf cannot encode), ``model``
follows ``serving_common.input_rules`` (no control characters), numbers must fit their field (a
JSON integer is unbounded), and errors quote a caller's value cut short (``shown``).

Numbers written as text (a multipart field, a query parameter, a header, a JSON string such as
the Videos API's ``seconds``) are read by ``decimal_int`` and ``decimal_number`` alone: ASCII
decimal only, where ``int()`` and ``float()`` also take other scripts' digits (``"٣"`` is 3),
underscores (``"1_0"`` is 10) and surrounding spaces, and ``int()`` raises past 4,300 digits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diffusion.v1 import worker_pb2
from serving_common.errors import invalid_argument
from serving_common.generation_params import GenerationParams, Kind
from serving_common.input_rules import text_problem
from serving_common.logs import REQUEST_ID_METADATA
from worker_service.http.conditioning import CONDITIONING_FIELDS, parse_conditioning
from worker_service.http.values import json_number, shown, shown_name

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
SIZE = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")
# Numbers as text, ASCII decimal only: [0-9], not \d (every script's digits).
DECIMAL_INT = re.compile(r"[+-]?[0-9]+")
DECIMAL_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# More digits than any integer a field, parameter or header takes (2**64 has 20).
MAX_DIGITS = 30
RESPONSE_FORMATS = ("b64_json", "url")  # a tuple: a caller's unhashable value is simply not in it
OUTPUT_FORMATS = {"png": worker_pb2.OUTPUT_FORMAT_PNG, "jpeg": worker_pb2.OUTPUT_FORMAT_JPEG,
                  "webp": worker_pb2.OUTPUT_FORMAT_WEBP}
# The documented values of the ignored hints (openai-python's ImageGenerateParams).
QUALITIES = frozenset({"auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"})
STYLES = frozenset({"vivid", "natural"})
IGNORED = frozenset({"quality", "style", "user", "safety_identifier"})
STREAMING = frozenset({"stream", "partial_images"})
# The body's names of the GenerateRequest fields GenerationParams declares for it: (field, kind).
DECLARED = {surface.openai: (name, surface.kind) for name, surface in GenerationParams.surfaces() if surface.openai}
FIELDS = (frozenset({"prompt", "size", "response_format", "output_format", "model"}) | DECLARED.keys() | IGNORED
          | STREAMING | CONDITIONING_FIELDS)

# GenerateRequest field -> the OpenAI field a caller set it with (the request id: its header).
OPENAI_NAMES = {"num_images": "n", "width": "size", "height": "size", "mask_image": "mask",
                "request_id": REQUEST_ID_METADATA}


@dataclass(frozen=True)
class ImagesRequest:
    """A parsed body: the GenerateRequest (no request id yet), the ``model`` asked for, if any, and
    how the images are answered (``b64_json`` or ``url``)."""

    request: worker_pb2.GenerateRequest
    model: str | None
    response_format: str = "b64_json"
    stream: bool = False  # server-sent events (``image_stream``)


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
    unknown = sorted(shown_name(name) for name in body if name not in FIELDS)
    for name in unknown:
        bad((name, "unknown or unsupported parameter"))
    fields: dict[str, Any] = {name: value for name, value in body.items() if value is not None}
    request = worker_pb2.GenerateRequest()

    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        bad(("prompt", "is required: a non-empty string"))
    elif _unicode(prompt, "prompt", bad):
        request.prompt = prompt
    for name, (target, kind) in DECLARED.items():
        if name in fields and (value := _declared(name, fields[name], kind, bad)) is not None:
            setattr(request, target, value)  # its bounds are normalize's

    size = fields.get("size", "auto")
    match = SIZE.fullmatch(size) if isinstance(size, str) else None
    if match:
        request.width, request.height = int(match[1]), int(match[2])
    elif size != "auto":
        bad(("size", f"must be WIDTHxHEIGHT (for example 64x64) or auto, got {shown(size)}"))

    response_format = fields.get("response_format", "b64_json")
    if response_format not in RESPONSE_FORMATS:
        bad(("response_format", f"must be one of {', '.join(RESPONSE_FORMATS)}, got {shown(response_format)}"))
    output_format = fields.get("output_format", "png")
    if isinstance(output_format, str) and output_format in OUTPUT_FORMATS:
        request.output_format = OUTPUT_FORMATS[output_format]
    else:
        bad(("output_format", f"must be one of {', '.join(OUTPUT_FORMATS)}, got {shown(output_format)}"))

    model = fields.get("model")
    if model is not None:
        problem = "must be a string" if not isinstance(model, str) else text_problem(model)
        if problem is not None:
            bad(("model", problem))
            model = None
    violations.extend(_ignored_violations(fields))
    parse_conditioning(fields, request, bad)
    stream = _streaming(fields, request, bad)
    if violations:
        raise invalid_argument(violations)
    return ImagesRequest(request, model, response_format, stream=stream)


def _ignored_violations(fields: dict[str, Any]) -> list[tuple[str, str]]:
    """Ignored fields still have to be what OpenAI documents, so a typo is not silently dropped."""
    found = []
    for name, allowed in (("quality", QUALITIES), ("style", STYLES)):
        if name in fields and not (isinstance(fields[name], str) and fields[name] in allowed):
            found.append((name, f"must be one of {', '.join(sorted(allowed))}, got {shown(fields[name])}"))
    for name in ("user", "safety_identifier"):
        if name in fields and not isinstance(fields[name], str):
            found.append((name, "must be a string"))
    return found


def _streaming(fields: dict[str, Any], request: worker_pb2.GenerateRequest,
               bad: Callable[[tuple[str, str]], None]) -> bool:
    """Whether the images are streamed; ``partial_images`` into ``request``, with ``stream`` only."""
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        bad(("stream", f"must be true or false, got {shown(stream)}"))
    if "partial_images" in fields:
        count = fields["partial_images"]
        if not (_is_int(count) and 0 <= count <= UINT32_MAX):
            bad(("partial_images", f"must be an integer from 0 to 3, got {shown(count)}"))
        elif count and stream is not True:
            bad(("partial_images", "previews come as server-sent events: set stream to true"))
        else:
            request.partial_images = count  # its bounds are normalize's
    if stream is True and fields.get("response_format") == "url":
        bad(("response_format", "a stream sends each image as b64_json"))
    return stream is True


def _declared(name: str, value: object, kind: Kind, bad: Callable[[tuple[str, str]], None]) -> object:
    """A declared field's JSON value as its kind takes it; None (and named in ``bad``) when it is not one."""
    if kind is Kind.TEXT:
        if not isinstance(value, str):
            bad((name, "must be a string"))
            return None
        return value if _unicode(value, name, bad) else None
    if kind is Kind.SCALE:
        number = json_number(value)
        if number is None:
            bad((name, f"must be a finite number, got {shown(value)}"))
        return number
    lowest, highest = (0, UINT64_MAX) if kind is Kind.SEED else (1, UINT32_MAX)
    if isinstance(value, int) and not isinstance(value, bool) and lowest <= value <= highest:
        return value
    bad((name, f"must be an integer from {lowest} to {highest}, got {shown(value)}"))
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decimal_int(text: str) -> int | None:
    """``text`` as an integer when it is one in ASCII decimal of at most MAX_DIGITS digits, else None."""
    if len(text) > MAX_DIGITS or DECIMAL_INT.fullmatch(text) is None:
        return None
    return int(text)


def decimal_number(text: str) -> float | None:
    """``text`` as a finite float when it is a number in ASCII decimal (an exponent allowed, as in
    JSON), else None (``inf``, ``nan`` and ``1e999`` too)."""
    if DECIMAL_NUMBER.fullmatch(text) is None:
        return None
    number = float(text)
    return number if math.isfinite(number) else None


def _unicode(text: str, name: str, bad: Callable[[tuple[str, str]], None]) -> bool:
    """Whether ``text`` can be sent on (protobuf strings are UTF-8); a JSON escape such as
    ``"\\ud800"`` gives a lone surrogate, which cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad((name, f"must be valid Unicode: a lone surrogate at {error.start}"))
        return False
    return True
