"""The built-in tiny ControlNets: one for each built-in model whose family takes ControlNets, built
from diffusers' own ControlNet test config (``tests/pipelines/controlnet/test_controlnet.py`` and
``test_controlnet_sdxl.py``, ``get_dummy_components``) with seeded random weights.

A ControlNet's blocks must mirror its UNet's, so each is ``ControlNetModel.from_unet`` of the built-in
model's UNet (its weights not copied: seeded ones), with the test config's conditioning embedding
(16 then 32 channels) widened to as many levels as the model's VAE halves the image (``tiny``'s
VAE: 8 times, so four levels). The test's ControlNets start with zero output convolutions, as a
trained one does before training; like diffusers' multi-ControlNet tests, they are drawn from a
normal distribution here (biases 1), so that a ControlNet changes the image.

``diffusion-build-model tiny-controlnet OUTDIR`` writes one (``config.json`` and safetensors
weights), which LoadAdapter registers with ADAPTER_KIND_CONTROLNET.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers.models.controlnets.controlnet import ControlNetModel

from runner_service.families.seeded import seeded
from runner_service.models.catalog import BUILT_MODELS, write_atomically

# Each built-in ControlNet, by name: the built-in model it steers.
BUILT_CONTROLNETS: dict[str, str] = {"tiny-controlnet": "tiny", "tiny-sdxl-controlnet": "tiny-sdxl"}
# diffusers' test config's conditioning embedding: 16, then 32 channels (then doubling per level).
_EMBEDDING_CHANNELS = (16, 32)


def _normal(module: torch.nn.Module) -> None:
    if isinstance(module, torch.nn.Conv2d):
        torch.nn.init.normal_(module.weight)
        if module.bias is not None:
            module.bias.data.fill_(1.0)


def build_controlnet(name: str) -> ControlNetModel:
    """The named built-in ControlNet (a key of ``BUILT_CONTROLNETS``), in memory."""
    pipeline = BUILT_MODELS[BUILT_CONTROLNETS[name]]()
    levels = pipeline.vae_scale_factor.bit_length()  # a factor of 2**(levels - 1)
    channels = tuple(_EMBEDDING_CHANNELS[min(level, 1)] * 2 ** max(level - 1, 0) for level in range(levels))

    def build() -> ControlNetModel:
        controlnet: ControlNetModel = ControlNetModel.from_unet(
            pipeline.unet, conditioning_embedding_out_channels=channels, load_weights_from_unet=False)
        controlnet.controlnet_down_blocks.apply(_normal)
        controlnet.controlnet_mid_block.apply(_normal)
        return controlnet

    return seeded(build)


def save_controlnet(name: str, output_dir: Path) -> Path:
    """Writes the named built-in ControlNet to ``output_dir`` in diffusers format, atomically."""
    if name not in BUILT_CONTROLNETS:
        raise KeyError(f"unknown built-in ControlNet {name!r}; choose from {sorted(BUILT_CONTROLNETS)}")
    return write_atomically(lambda staging: build_controlnet(name).save_pretrained(staging, safe_serialization=True),
                            output_dir, f"built-in ControlNet {name}")
