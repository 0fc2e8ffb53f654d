"""The built-in tiny ControlNets: one for each built-in model whose family takes ControlNets, built
from diffusers' own ControlNet test configs (``get_dummy_components`` of
``tests/pipelines/controlnet/test_controlnet.py``, ``test_controlnet_sdxl.py``,
``controlnet_sd3/test_controlnet_sd3.py`` and ``controlnet_flux/test_controlnet_flux.py``) with
seeded random weights.

A UNet ControlNet's blocks must mirror its UNet's, so ``tiny-controlnet`` and ``tiny-sdxl-controlnet``
are ``ControlNetModel.from_unet`` of the built-in model's UNet (its weights not copied: seeded ones),
with the test config's conditioning embedding (16 then 32 channels) widened to as many levels as
the model's VAE halves the image (``tiny``'s VAE: 8 times, so four levels). The transformer ones
take the test configs' one layer (Flux: one double and one single block) with the built-in
transformer's widths, channels and (Flux) guidance embedding, as the test configs take their
transformer's: ``tiny-sd3-controlnet`` for ``tiny-sd3``, ``tiny-flux-controlnet`` for ``tiny-flux``.

The tests' ControlNets start with zero output layers, as a trained one does before training; like
diffusers' multi-ControlNet tests, those are drawn from a normal distribution here, so that a
ControlNet changes the image.

``diffusion-build-model tiny-controlnet OUTDIR`` writes one (``config.json`` and safetensors
weights), which LoadAdapter registers with ADAPTER_KIND_CONTROLNET.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers.models.controlnets.controlnet import ControlNetModel
from diffusers.models.controlnets.controlnet_flux import FluxControlNetModel
from diffusers.models.controlnets.controlnet_sd3 import SD3ControlNetModel
from diffusers.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

from runner_service.families.seeded import seeded
from runner_service.models.catalog import BUILT_MODELS, write_atomically

# Each built-in ControlNet, by name: the built-in model it steers.
BUILT_CONTROLNETS: dict[str, str] = {"tiny-controlnet": "tiny", "tiny-sdxl-controlnet": "tiny-sdxl",
                                     "tiny-sd3-controlnet": "tiny-sd3", "tiny-flux-controlnet": "tiny-flux"}
# diffusers' test config's conditioning embedding: 16, then 32 channels (then doubling per level).
_EMBEDDING_CHANNELS = (16, 32)
# The standard deviation of the transformer ControlNets' drawn output layers: their residuals are
# added to every token, so a smaller draw than the UNet's convolutions keeps the image finite.
_TRANSFORMER_STD = 0.1


def _normal(module: torch.nn.Module) -> None:
    if isinstance(module, torch.nn.Conv2d):
        torch.nn.init.normal_(module.weight)
        if module.bias is not None:
            module.bias.data.fill_(1.0)


def _drawn(*modules: torch.nn.Module) -> None:
    """The transformer ControlNets' zero-initialized layers, drawn."""
    for module in modules:
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=_TRANSFORMER_STD)


def _unet_controlnet(pipeline: Any) -> ControlNetModel:
    levels = pipeline.vae_scale_factor.bit_length()  # a factor of 2**(levels - 1)
    channels = tuple(_EMBEDDING_CHANNELS[min(level, 1)] * 2 ** max(level - 1, 0) for level in range(levels))
    controlnet: ControlNetModel = ControlNetModel.from_unet(
        pipeline.unet, conditioning_embedding_out_channels=channels, load_weights_from_unet=False)
    controlnet.controlnet_down_blocks.apply(_normal)
    controlnet.controlnet_mid_block.apply(_normal)
    return controlnet


def _sd3_controlnet(pipeline: Any) -> SD3ControlNetModel:
    config = {**pipeline.transformer.config, "num_layers": 1, "extra_conditioning_channels": 0}
    controlnet: SD3ControlNetModel = SD3ControlNetModel.from_config(config)
    _drawn(controlnet.controlnet_blocks, controlnet.pos_embed_input)
    return controlnet


def _flux_controlnet(pipeline: Any) -> FluxControlNetModel:
    config = pipeline.transformer.config
    controlnet: FluxControlNetModel = FluxControlNetModel.from_transformer(
        pipeline.transformer, num_layers=1, num_single_layers=1, attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads, load_weights_from_transformer=False)
    _drawn(controlnet.controlnet_blocks, controlnet.controlnet_single_blocks, controlnet.controlnet_x_embedder)
    return controlnet


_BUILDS: dict[str, Callable[[Any], torch.nn.Module]] = {"tiny": _unet_controlnet, "tiny-sdxl": _unet_controlnet,
                                                         "tiny-sd3": _sd3_controlnet, "tiny-flux": _flux_controlnet}


def build_controlnet(name: str) -> torch.nn.Module:
    """The named built-in ControlNet (a key of ``BUILT_CONTROLNETS``), in memory."""
    model = BUILT_CONTROLNETS[name]
    pipeline = BUILT_MODELS[model]()
    return seeded(lambda: _BUILDS[model](pipeline))


def save_controlnet(name: str, output_dir: Path) -> Path:
    """Writes the named built-in ControlNet to ``output_dir`` in diffusers format, atomically."""
    if name not in BUILT_CONTROLNETS:
        raise KeyError(f"unknown built-in ControlNet {name!r}; choose from {sorted(BUILT_CONTROLNETS)}")
    built = build_controlnet(name)
    return write_atomically(lambda staging: built.save_pretrained(staging, safe_serialization=True),  # type: ignore[operator]
                            output_dir, f"built-in ControlNet {name}", complete=(CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME))
