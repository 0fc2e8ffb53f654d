"""Tiny LoRA adapter files for the ``tiny`` model and the video families' tiny builds, made with peft.

``make_lora`` injects a rank-4 LoRA into copies of the ``tiny`` UNet's attention projections (and the text
encoder's, when asked) with peft, gives its up-projections seeded random values (peft starts them
at zero, which would change nothing), and saves it with diffusers' LoRA saver (``diffusers``), as
kohya-ss names (``kohya``), or as peft's own state-dict names (``peft``). ``make_transformer_lora``
does the same for the attention projections of a family's tiny transformer (the video families),
saved with that pipeline's LoRA saver (``WanLoraLoaderMixin``, ``LTXVideoLoraLoaderMixin``).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, StableDiffusionPipeline
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from safetensors.torch import save_file

from runner_service.families import FAMILIES
from runner_service.families.sd.tiny import build_sd

RANK = 4
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # diffusers' attention: the UNet's and Wan's transformer's
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


@functools.cache
def _tiny() -> StableDiffusionPipeline:
    """The ``tiny`` model, built once per process: each LoRA is injected into copies of its modules."""
    return build_sd("tiny")


def _lora_state(module: torch.nn.Module, targets: list[str], generator: torch.Generator,
                strength: float) -> dict[str, torch.Tensor]:
    inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets,
                                       init_lora_weights="gaussian"), module)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * strength)
    return get_peft_model_state_dict(module)


def _kohya(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft names (``<layer>.lora_A.weight``) as kohya-ss names (``lora_unet_<layer_underscored>.lora_down.weight``)."""
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        layer, kind = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name).groups()
        key = f"{prefix}_{layer.replace('.', '_')}"
        converted[f"{key}.lora_{'down' if kind == 'A' else 'up'}.weight"] = tensor
        converted[f"{key}.alpha"] = torch.tensor(float(RANK))
    return converted


def make_lora(path: Path, seed: int, text_encoder: bool = True, layout: str = "diffusers",
              strength: float = 0.3) -> Path:
    """Writes a LoRA for the ``tiny`` model to ``path`` (a .safetensors file) and returns it."""
    tiny = _tiny()
    generator = torch.Generator().manual_seed(seed)
    unet = _lora_state(copy.deepcopy(tiny.unet), UNET_TARGETS, generator, strength)
    text = _lora_state(copy.deepcopy(tiny.text_encoder), TEXT_TARGETS, generator, strength) if text_encoder else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout == "diffusers":
        StableDiffusionPipeline.save_lora_weights(
            path.parent, weight_name=path.name, unet_lora_layers=convert_state_dict_to_diffusers(unet),
            text_encoder_lora_layers=convert_state_dict_to_diffusers(text) if text else None, safe_serialization=True)
    elif layout == "kohya":
        save_file({**_kohya("lora_unet", unet), **_kohya("lora_te", text)}, str(path))
    elif layout == "peft":
        save_file({**{f"unet.{k}": v for k, v in unet.items()},
                   **{f"text_encoder.{k}": v for k, v in text.items()}}, str(path))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return path


@functools.cache
def _family_build(name: str) -> DiffusionPipeline:
    """A family's tiny build, built once per process: each LoRA is injected into copies of its modules."""
    return FAMILIES[name].build()


# Wan image-to-video's attention projects the image tokens with projections of its own.
IMAGE_TARGETS = ["add_k_proj", "add_v_proj"]


def make_transformer_lora(path: Path, seed: int, family: str, strength: float = 0.3) -> Path:
    """Writes a LoRA for the transformer of a family's tiny build (the video families: ``wan``,
    ``wan-i2v``, ``ltx``) to ``path``: its attention projections (and image-to-video's image ones), in
    peft's names, saved with the family pipeline's own LoRA saver as diffusers' training scripts do."""
    pipeline = _family_build(family)
    transformer = copy.deepcopy(pipeline.transformer)
    names = {name.rsplit(".", 1)[-1] for name, _ in transformer.named_modules()}
    targets = UNET_TARGETS + [target for target in IMAGE_TARGETS if target in names]
    state = _lora_state(transformer, targets, torch.Generator().manual_seed(seed), strength)
    path.parent.mkdir(parents=True, exist_ok=True)
    type(pipeline).save_lora_weights(path.parent, weight_name=path.name, transformer_lora_layers=state,
                                     safe_serialization=True)
    return path
