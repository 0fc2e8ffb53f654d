"""How an image was made, as the worker writes it into the image (issue 36 item 3): A1111's
"parameters" text, which A1111, ComfyUI and InvokeAI read back ("PNG Info"), and the same values as
the JSON object of ``Image.parameters``.

The text, as A1111 writes it::

    a red fox <lora:style:0.8>
    Negative prompt: blurry
    Steps: 20, Sampler: Euler, CFG scale: 7.5, Seed: 1234, Size: 512x512, Model: tiny, Denoising strength: 0.8

The first line(s) are the prompt, with each adapter as A1111's ``<lora:NAME:SCALE>`` tag after it
(A1111 takes its LoRAs from such tags); ``Negative prompt:`` is left out when there is none; the
last line lists the settings, a value holding a comma, a colon or a newline in JSON quotes (A1111's
``quote``). ``Denoising strength`` is written for image-to-image and inpainting, ``True CFG scale``
where the model takes a separate one (Flux), ``Sampler``: the request's sampler where it names
one, else the model's scheduler where the runner reports it. Numbers have at most 6 significant
digits (the request's scales are float32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from diffusion.v1 import common_pb2
from serving_common.input_rules import task_inputs
from worker_service.validation import NormalizedRequest

# A1111's sampler names of the diffusers schedulers that have an obvious one; other schedulers are
# written by class name.
A1111_SAMPLERS = {
    "EulerDiscreteScheduler": "Euler",
    "EulerAncestralDiscreteScheduler": "Euler a",
    "FlowMatchEulerDiscreteScheduler": "Euler",
    "HeunDiscreteScheduler": "Heun",
    "LMSDiscreteScheduler": "LMS",
    "KDPM2DiscreteScheduler": "DPM2",
    "KDPM2AncestralDiscreteScheduler": "DPM2 a",
    "DPMSolverMultistepScheduler": "DPM++ 2M",
    "DPMSolverSDEScheduler": "DPM++ SDE",
    "DDIMScheduler": "DDIM",
    "PNDMScheduler": "PLMS",
    "UniPCMultistepScheduler": "UniPC",
    "LCMScheduler": "LCM",
}


# A1111's names of the samplers a request may name (GenerateRequest.sampler).
A1111_REQUEST_SAMPLERS = {
    "euler": "Euler",
    "euler_a": "Euler a",
    "heun": "Heun",
    "lms": "LMS",
    "ddim": "DDIM",
    "pndm": "PLMS",
    "unipc": "UniPC",
    "dpmpp_2m": "DPM++ 2M",
    "dpmpp_2m_karras": "DPM++ 2M Karras",
    "dpmpp_2m_sde_karras": "DPM++ 2M SDE Karras",
    "dpm2": "DPM2",
    "dpm2_a": "DPM2 a",
    "lcm": "LCM",
}


def sampler_name(model: common_pb2.ModelInfo | None, sampler: str = "") -> str:
    """A1111's name of the request's ``sampler`` where it names one, else of the model's scheduler
    (its class name where A1111 has none); empty when neither is known."""
    if sampler:
        return A1111_REQUEST_SAMPLERS.get(sampler, sampler)
    scheduler = model.scheduler if model else ""
    return A1111_SAMPLERS.get(scheduler, scheduler)


@dataclass(frozen=True)
class ImageParameters:
    """The parameters of one image of a request (each image has its own seed)."""

    prompt: str
    negative_prompt: str
    steps: int
    sampler: str  # empty: unknown
    cfg_scale: float
    seed: int
    width: int
    height: int
    model: str
    adapters: tuple[tuple[str, float], ...] = ()  # (name, scale) in the request's order
    strength: float | None = None  # image-to-image and inpainting only
    true_cfg_scale: float | None = None  # where the model takes one besides cfg_scale

    @classmethod
    def of(cls, request: NormalizedRequest, model: common_pb2.ModelInfo | None, seed: int) -> ImageParameters:
        """Those of the image seeded ``seed`` of ``request``, made by ``model`` (the loaded one)."""
        return cls(prompt=request.prompt, negative_prompt=request.negative_prompt, steps=request.num_inference_steps,
                   sampler=sampler_name(model, request.sampler), cfg_scale=request.guidance_scale, seed=seed,
                   width=request.width, height=request.height, model=model.source if model else "",
                   adapters=request.adapters,
                   strength=request.strength if task_inputs(request.task).strength else None,
                   true_cfg_scale=request.true_cfg_scale)

    def as_text(self) -> str:
        """A1111's "parameters" text (the module's docstring shows one)."""
        tags = " ".join(f"<lora:{name}:{_number(scale):g}>" for name, scale in self.adapters)
        prompt = f"{self.prompt} {tags}" if self.prompt and tags else self.prompt or tags
        settings: list[tuple[str, object]] = [("Steps", self.steps)]
        if self.sampler:
            settings.append(("Sampler", self.sampler))
        settings += [("CFG scale", f"{_number(self.cfg_scale):g}"), ("Seed", self.seed),
                     ("Size", f"{self.width}x{self.height}"), ("Model", self.model)]
        if self.strength is not None:
            settings.append(("Denoising strength", f"{_number(self.strength):g}"))
        if self.true_cfg_scale is not None:
            settings.append(("True CFG scale", f"{_number(self.true_cfg_scale):g}"))
        lines = [prompt] if prompt else []
        if self.negative_prompt:
            lines.append(f"Negative prompt: {self.negative_prompt}")
        lines.append(", ".join(f"{key}: {_quote(str(value))}" for key, value in settings))
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        """The JSON object of ``Image.parameters``. ``seed`` is a decimal string, as proto3's JSON
        writes 64-bit integers: a Struct's numbers are doubles, exact only to 2^53."""
        parameters: dict[str, Any] = {
            "prompt": self.prompt, "negative_prompt": self.negative_prompt, "steps": self.steps,
            "cfg_scale": _number(self.cfg_scale), "seed": str(self.seed), "width": self.width,
            "height": self.height, "model": self.model}
        if self.sampler:
            parameters["sampler"] = self.sampler
        if self.adapters:
            parameters["adapters"] = [{"name": name, "scale": _number(scale)} for name, scale in self.adapters]
        if self.strength is not None:
            parameters["strength"] = _number(self.strength)
        if self.true_cfg_scale is not None:
            parameters["true_cfg_scale"] = _number(self.true_cfg_scale)
        return parameters


def _number(value: float) -> float:
    """``value`` to 6 significant digits: a float32 scale as it was sent (0.8, not 0.800000011920929)."""
    return float(f"{value:.6g}")


def _quote(value: str) -> str:
    """A1111's quoting of a setting's value: JSON quotes around one holding a comma, colon or newline."""
    return json.dumps(value, ensure_ascii=False) if any(c in value for c in ",:\n") else value
