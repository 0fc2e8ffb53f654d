"""A model's own generation defaults: ``generation_config.json`` beside its ``model_index.json``.

Distilled models (Turbo, Lightning, LCM, Hyper-SD, schnell) need 1 to 4 steps and no guidance; a
model directory says so once, in the same way transformers models keep theirs::

    {"num_inference_steps": 4, "guidance_scale": 0.0, "width": 512, "height": 512}

Every field is optional and other fields are ignored. The runner reports what it read in
``ModelInfo.defaults``; the worker gives a request that leaves a field unset the model's default,
else its own flag's (``--default-steps``, ``--default-guidance``, ``--default-size``). A file that
cannot be read as that is refused at load (INVALID_ARGUMENT naming ``source``), as a malformed
``model_index.json`` is, rather than ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from diffusion.v1 import common_pb2
from runner_service.model_roots import ModelRoots
from serving_common.errors import invalid_argument
from serving_common.input_rules import MAX_GUIDANCE

FILE_NAME = "generation_config.json"
MAX_FILE_BYTES = 64 * 1024  # a handful of numbers; the read stops past this
MAX_STEPS = 10_000
MAX_SIDE = 16_384


@dataclass(frozen=True)
class GenerationDefaults:
    """0 or None: the model has no default of its own for that field."""

    num_inference_steps: int = 0
    guidance_scale: float | None = None
    width: int = 0
    height: int = 0

    def to_proto(self) -> common_pb2.GenerationDefaults:
        return common_pb2.GenerationDefaults(num_inference_steps=self.num_inference_steps,
                                             guidance_scale=self.guidance_scale, width=self.width,
                                             height=self.height)


def read_generation_defaults(directory: Path, roots: ModelRoots) -> GenerationDefaults:
    """The defaults in ``directory``'s generation_config.json (none without one), read inside ``roots``."""
    path = directory / FILE_NAME
    if not path.exists():
        return GenerationDefaults()
    raw = roots.read(roots.regular_file(path, "source"), "source", MAX_FILE_BYTES)
    try:
        fields = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise invalid_argument({"source": f"{path} is not JSON: {error}"}) from None
    if not isinstance(fields, dict):
        raise invalid_argument({"source": f"{path} must hold a JSON object, got {type(fields).__name__}"})
    problems = [f"{name} {why}" for name, why in (
        ("num_inference_steps", _whole_problem(fields.get("num_inference_steps"), MAX_STEPS)),
        ("guidance_scale", _guidance_problem(fields.get("guidance_scale"))),
        ("width", _whole_problem(fields.get("width"), MAX_SIDE)),
        ("height", _whole_problem(fields.get("height"), MAX_SIDE))) if why is not None]
    if problems:
        raise invalid_argument({"source": f"{path}: {'; '.join(problems)}"})
    guidance = fields.get("guidance_scale")
    return GenerationDefaults(num_inference_steps=fields.get("num_inference_steps") or 0,
                              guidance_scale=None if guidance is None else float(guidance),
                              width=fields.get("width") or 0, height=fields.get("height") or 0)


def _whole_problem(value: object, largest: int) -> str | None:
    """A whole number from 1 to ``largest``, or absent (null)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= largest:
        return f"must be a whole number from 1 to {largest}, got {json.dumps(value)[:40]}"
    return None


def _guidance_problem(value: object) -> str | None:
    """A number from 0 to MAX_GUIDANCE, or absent (null)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and 0 <= value <= MAX_GUIDANCE):
        return f"must be a number from 0 to {MAX_GUIDANCE:g}, got {json.dumps(value)[:40]}"
    return None
