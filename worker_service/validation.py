"""GenerateRequest checks: a normalized request with defaults filled in, or one violation per bad field."""

from __future__ import annotations

import math
import re
import secrets
import uuid
from collections.abc import Callable, Container
from dataclasses import dataclass

from diffusion.v1 import worker_pb2

from .config import Limits

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


class ValidationError(Exception):
    """The request has bad fields; ``violations`` names each one."""

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{f}: {d}" for f, d in violations))
        self.violations = violations


def normalize(request: worker_pb2.GenerateRequest, limits: Limits, active_ids: Container[str],
              field_prefix: str = "") -> NormalizedRequest:
    """Checks every field of ``request`` and fills in defaults; raises ValidationError.

    ``field_prefix`` is prepended to field names (``request.`` for GenerateStream).
    """
    violations: list[tuple[str, str]] = []

    def bad(name: str, description: str) -> None:
        violations.append((field_prefix + name, description))

    width = _size(request.width, "width", limits, bad)
    height = _size(request.height, "height", limits, bad)

    steps = request.num_inference_steps or limits.default_steps
    if steps > limits.max_steps:
        bad("num_inference_steps", f"must be 1 to {limits.max_steps}, got {steps}")

    guidance = request.guidance_scale if request.HasField("guidance_scale") else limits.default_guidance
    if not math.isfinite(guidance) or guidance < 0:
        bad("guidance_scale", f"must be finite and >= 0, got {guidance}")

    num_images = request.num_images or 1
    if num_images > limits.max_images:
        bad("num_images", f"must be 1 to {limits.max_images}, got {num_images}")

    for name in ("prompt", "negative_prompt"):
        length = len(getattr(request, name))
        if length > limits.max_prompt_chars:
            bad(name, f"must be at most {limits.max_prompt_chars} characters, got {length}")

    if request.output_format not in worker_pb2.OutputFormat.values():
        bad("output_format", f"unknown output format {request.output_format}")

    request_id = request.request_id or uuid.uuid4().hex
    if len(request_id) > limits.max_request_id_chars:
        bad("request_id", f"must be at most {limits.max_request_id_chars} characters, got {len(request_id)}")
    elif not _REQUEST_ID.fullmatch(request_id):
        bad("request_id", "must be printable ASCII without spaces")
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
    )


def _size(value: int, name: str, limits: Limits, bad: Callable[[str, str], None]) -> int:
    size = value or limits.default_size
    if size % 8 or not limits.min_size <= size <= limits.max_size:
        bad(name, f"must be a multiple of 8 from {limits.min_size} to {limits.max_size}, got {size}")
    return size
