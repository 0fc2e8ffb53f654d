"""Tiny IP-Adapters with seeded random weights for the built-in ``tiny`` and ``tiny-sdxl``:
``diffusion-build-model tiny-ip-adapter DIR`` and ``tiny-sdxl-ip-adapter``.

Built as diffusers' own tests build theirs (``create_ip_adapter_state_dict`` in
``tests/models/unets/test_models_unet_2d_condition.py``: an ``ImageProjection`` of four tokens and
the ``to_k_ip``/``to_v_ip`` of every cross-attention layer, numbered as the loader reads them), with
the small CLIP image encoder of diffusers' pipeline tests, and saved in the layout
``load_ip_adapter`` reads: ``ip_adapter.safetensors`` (``image_proj.*`` and ``ip_adapter.*``) beside
an ``image_encoder`` folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from diffusers.models.attention_processor import IPAdapterAttnProcessor
from diffusers.models.embeddings import ImageProjection
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from safetensors.torch import save_file
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from runner_service.families.sd.tiny import build_sd
from runner_service.families.sdxl.tiny import build_sdxl
from runner_service.families.seeded import seeded
from runner_service.ip_adapters import ENCODER_FOLDER, WEIGHTS_FILE
from runner_service.models.catalog import write_atomically

IMAGE_SIZE = 32  # the encoder's input side (its feature extractor resizes reference images to it)

# Each built-in IP-Adapter and the built-in model whose UNet it fits.
BUILT_IP_ADAPTERS: dict[str, tuple[str, Callable[[], UNet2DConditionModel]]] = {
    "tiny-ip-adapter": ("tiny", lambda: build_sd("tiny").unet),
    "tiny-sdxl-ip-adapter": ("tiny-sdxl", lambda: build_sdxl().unet),
}


def image_encoder() -> CLIPVisionModelWithProjection:
    """The CLIP image encoder of diffusers' pipeline tests (image size 32, patch 1, 32 wide)."""
    config = CLIPVisionConfig(hidden_size=32, projection_dim=32, num_hidden_layers=5, num_attention_heads=4,
                              image_size=IMAGE_SIZE, intermediate_size=37, patch_size=1)
    return seeded(lambda: CLIPVisionModelWithProjection(config))


def ip_adapter_tensors(unet: UNet2DConditionModel, image_embed_dim: int) -> dict[str, torch.Tensor]:
    """An IP-Adapter's tensors for ``unet`` with seeded random weights, under the names of the
    original checkpoints (``image_proj.proj``, ``ip_adapter.<n>.to_k_ip``) that ``load_ip_adapter`` reads."""
    cross = unet.config["cross_attention_dim"]
    channels = list(unet.config["block_out_channels"])
    torch.manual_seed(1)
    tensors: dict[str, torch.Tensor] = {}
    key_id = 1
    for name in unet.attn_processors:
        if name.endswith("attn1.processor"):
            continue
        if name.startswith("mid_block"):
            hidden = channels[-1]
        elif name.startswith("up_blocks"):
            hidden = list(reversed(channels))[int(name[len("up_blocks.")])]
        else:
            hidden = channels[int(name[len("down_blocks.")])]
        layer = IPAdapterAttnProcessor(hidden_size=hidden, cross_attention_dim=cross)  # type: ignore[no-untyped-call]
        state = layer.state_dict()
        tensors[f"ip_adapter.{key_id}.to_k_ip.weight"] = state["to_k_ip.0.weight"]
        tensors[f"ip_adapter.{key_id}.to_v_ip.weight"] = state["to_v_ip.0.weight"]
        key_id += 2
    projection = ImageProjection(cross_attention_dim=cross, image_embed_dim=image_embed_dim,
                                 num_image_text_embeds=4).state_dict()
    tensors.update({"image_proj.proj.weight": projection["image_embeds.weight"],
                    "image_proj.proj.bias": projection["image_embeds.bias"],
                    "image_proj.norm.weight": projection["norm.weight"],
                    "image_proj.norm.bias": projection["norm.bias"]})
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def save_ip_adapter(name: str, output_dir: Path) -> Path:
    """Writes built-in IP-Adapter ``name`` to ``output_dir``, atomically (``catalog.write_atomically``)."""
    if name not in BUILT_IP_ADAPTERS:
        raise KeyError(f"unknown built-in IP-Adapter {name!r}; choose from {sorted(BUILT_IP_ADAPTERS)}")
    _, unet = BUILT_IP_ADAPTERS[name]

    def write(staging: Path) -> None:
        encoder = image_encoder()
        encoder.save_pretrained(staging / ENCODER_FOLDER, safe_serialization=True)
        save_file(ip_adapter_tensors(unet(), encoder.config.projection_dim), staging / WEIGHTS_FILE)

    return write_atomically(write, Path(output_dir), f"built-in IP-Adapter {name}",
                            complete=(WEIGHTS_FILE, f"{ENCODER_FOLDER}/config.json"))
