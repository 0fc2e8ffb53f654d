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
one, else the model's scheduler where the runner reports it. Each ControlNet of the request is a
``ControlNet N`` setting (N from 0, in the request's order: at most 3) in the form of A1111's
ControlNet extension, its IP-Adapter an ``IP-Adapter`` setting: names, scales and how many reference
images, never the images themselves. A request with a ControlNet and an IP-Adapter ends the line
with these two settings (each after a comma, as the others)::

    ControlNet 0: "Model: edges, Weight: 0.8, Guidance Start: 0, Guidance End: 0.5"
    IP-Adapter: "Model: look, Weight: 0.6, Images: 2"

Numbers have at most 6 significant digits (the request's scales are float32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from diffusion.v1 import common_pb2
from serving_common.generation_params import Control, ImagePrompt
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
    controls: tuple[Control, ...] = ()  # the request's ControlNets, in its order
    ip_adapter: ImagePrompt | None = None

    @classmethod
    def of(cls, request: NormalizedRequest, model: common_pb2.ModelInfo | None, seed: int) -> ImageParameters:
        """Those of the image seeded ``seed`` of ``request``, made by ``model`` (the loaded one)."""
        return cls(prompt=request.prompt, negative_prompt=request.negative_prompt, steps=request.num_inference_steps,
                   sampler=sampler_name(model, request.sampler), cfg_scale=request.guidance_scale, seed=seed,
                   width=request.width, height=request.height, model=model.source if model else "",
                   adapters=request.adapters,
                   strength=request.strength if task_inputs(request.task).strength else None,
                   true_cfg_scale=request.true_cfg_scale, controls=request.controls,
                   ip_adapter=request.ip_adapter)

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
        settings += [(f"ControlNet {index}", _described(("Model", control.name),
                                                         ("Weight", control.conditioning_scale),
                                                         ("Guidance Start", control.guidance_start),
                                                         ("Guidance End", control.guidance_end)))
                     for index, control in enumerate(self.controls)]
        if self.ip_adapter is not None:
            settings.append(("IP-Adapter", _described(("Model", self.ip_adapter.name),
                                                       ("Weight", self.ip_adapter.scale),
                                                       ("Images", self.ip_adapter.images))))
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
        if self.controls:
            parameters["controls"] = [
                {"name": control.name, "conditioning_scale": _number(control.conditioning_scale),
                 "guidance_start": _number(control.guidance_start), "guidance_end": _number(control.guidance_end)}
                for control in self.controls]
        if self.ip_adapter is not None:
            parameters["ip_adapter"] = {"name": self.ip_adapter.name, "scale": _number(self.ip_adapter.scale),
                                        "images": self.ip_adapter.images}
        return parameters


def _number(value: float) -> float:
    """``value`` to 6 significant digits: a float32 scale as it was sent (0.8, not 0.800000011920929)."""
    return float(f"{value:.6g}")


def _described(*fields: tuple[str, str | float]) -> str:
    """One setting made of several, as A1111's ControlNet extension writes a unit: ``Key: value``
    joined by commas (the whole then quoted by ``_quote``); an int as it is, a float to 6 digits."""
    return ", ".join(f"{key}: {value if isinstance(value, str | int) else f'{_number(value):g}'}"
                     for key, value in fields)


def _quote(value: str) -> str:
    """A1111's quoting of a setting's value: JSON quotes around one holding a comma, colon or newline."""
    return json.dumps(value, ensure_ascii=False) if any(c in value for c in ",:\n") else value
