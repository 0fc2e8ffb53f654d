"""Writes a Stable Diffusion 1.x or SDXL pipeline as one file in the original (A1111/ComfyUI,
"LDM") key layout, so tests can load it back through diffusers' ``from_single_file``.

diffusers ships only the other direction (``diffusers.loaders.single_file_utils``: original to
diffusers); this is its inverse, written from those converters and their
``DIFFUSERS_TO_LDM_MAPPING`` table, for any number of levels and layers per block (the tiny builds
have fewer than the real models).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING
from safetensors.torch import save_file

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
SD_CLIP_PREFIX = "cond_stage_model.transformer."
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer."
SDXL_OPEN_CLIP_PREFIX = "conditioner.embedders.1.model."

# Inside a UNet resnet: diffusers' name -> the original's.
UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
               "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
# Inside a VAE mid-block attention: diffusers' name -> the original's (1x1 convolutions there).
VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _renamed(state: dict[str, torch.Tensor], prefixes: dict[str, str],
             inner: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Each key under one of ``prefixes`` (diffusers' -> the original's) renamed, with the part
    after the prefix renamed by ``inner`` where its first segment(s) match; keys under none kept."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        new = key
        for old_prefix, new_prefix in prefixes.items():
            if key.startswith(old_prefix):
                rest = key[len(old_prefix):]
                for old_inner, new_inner in (inner or {}).items():
                    if rest.startswith(old_inner + "."):
                        rest = new_inner + rest[len(old_inner):]
                        break
                new = new_prefix + rest
                break
        out[new] = tensor
    return out


def unet_state(unet: Any) -> dict[str, torch.Tensor]:
    """A diffusers ``UNet2DConditionModel``'s weights under the original names."""
    config = unet.config
    per = config.layers_per_block + 1
    levels = len(config.block_out_channels)
    state = {key: tensor for key, tensor in unet.state_dict().items()}
    resnets: dict[str, str] = {}
    blocks: dict[str, str] = {}
    for level in range(levels):
        for layer in range(config.layers_per_block):
            index = 1 + level * per + layer
            resnets[f"down_blocks.{level}.resnets.{layer}."] = f"input_blocks.{index}.0."
            blocks[f"down_blocks.{level}.attentions.{layer}."] = f"input_blocks.{index}.1."
        blocks[f"down_blocks.{level}.downsamplers.0.conv."] = f"input_blocks.{(level + 1) * per}.0.op."
        has_attention = any(key.startswith(f"up_blocks.{level}.attentions.") for key in state)
        for layer in range(per):
            index = level * per + layer
            resnets[f"up_blocks.{level}.resnets.{layer}."] = f"output_blocks.{index}.0."
            blocks[f"up_blocks.{level}.attentions.{layer}."] = f"output_blocks.{index}.1."
        upsampler = f"output_blocks.{level * per + per - 1}.{2 if has_attention else 1}."
        blocks[f"up_blocks.{level}.upsamplers.0."] = upsampler
    resnets.update({"mid_block.resnets.0.": "middle_block.0.", "mid_block.resnets.1.": "middle_block.2."})
    blocks["mid_block.attentions.0."] = "middle_block.1."
    layers = dict(DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"])
    if config.addition_embed_type == "text_time":
        layers.update(DIFFUSERS_TO_LDM_MAPPING["unet"]["addition_embed_type"])
    state = {layers.get(key, key): tensor for key, tensor in state.items()}
    state = _renamed(_renamed(state, resnets, UNET_RESNET), blocks)
    return {UNET_PREFIX + key: tensor for key, tensor in state.items()}


def vae_state(vae: Any) -> dict[str, torch.Tensor]:
    """A diffusers ``AutoencoderKL``'s weights under the original names."""
    count = len(vae.config.block_out_channels)
    resnets: dict[str, str] = {}
    blocks: dict[str, str] = {}
    for level in range(count):
        resnets[f"encoder.down_blocks.{level}.resnets."] = f"encoder.down.{level}.block."
        blocks[f"encoder.down_blocks.{level}.downsamplers.0."] = f"encoder.down.{level}.downsample."
        resnets[f"decoder.up_blocks.{level}.resnets."] = f"decoder.up.{count - 1 - level}.block."
        blocks[f"decoder.up_blocks.{level}.upsamplers.0."] = f"decoder.up.{count - 1 - level}.upsample."
    for part in ("encoder", "decoder"):
        for index in (0, 1):
            resnets[f"{part}.mid_block.resnets.{index}."] = f"{part}.mid.block_{index + 1}."
        blocks[f"{part}.conv_norm_out."] = f"{part}.norm_out."
    state = {}
    for key, tensor in _renamed(vae.state_dict(), resnets).items():
        state[key.replace(".conv_shortcut.", ".nin_shortcut.")] = tensor
    state = _renamed(state, blocks)
    attention = {f"{part}.mid_block.attentions.0.": f"{part}.mid.attn_1." for part in ("encoder", "decoder")}
    original = {}
    for key, tensor in _renamed(state, attention, VAE_ATTENTION).items():
        if ".mid.attn_1." in key and key.endswith(".weight") and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]  # the original's 1x1 convolutions
        original[VAE_PREFIX + key] = tensor
    return original


def _text_model_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIP text model's keys under ``text_model.`` (newer transformers flatten CLIPTextModel)."""
    return {key if key.startswith(("text_model.", "text_projection")) else f"text_model.{key}": tensor
            for key, tensor in state.items() if not key.endswith("position_ids")}


def open_clip_state(text_encoder: Any) -> dict[str, torch.Tensor]:
    """A ``CLIPTextModelWithProjection``'s weights in OpenCLIP's layout (SDXL's second encoder)."""
    layers = {diffusers: original for diffusers, original in DIFFUSERS_TO_LDM_MAPPING["openclip"]["layers"].items()}
    inner = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
             "self_attn.out_proj": "attn.out_proj"}
    state = _text_model_keys(text_encoder.state_dict())
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key in layers:
            out[layers[key]] = tensor.T.contiguous() if key == "text_projection.weight" else tensor
            continue
        rest = key.removeprefix("text_model.encoder.layers.")
        index, _, name = rest.partition(".")
        if name.startswith(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")):
            continue  # joined below
        for old, new in inner.items():
            if name.startswith(old + "."):
                name = new + name[len(old):]
        out[f"transformer.resblocks.{index}.{name}"] = tensor
    layer_count = text_encoder.config.num_hidden_layers
    for index in range(layer_count):
        for kind in ("weight", "bias"):
            parts = [state[f"text_model.encoder.layers.{index}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"transformer.resblocks.{index}.attn.in_proj_{kind}"] = torch.cat(parts)
    return out


def original_state(pipeline: Any) -> dict[str, torch.Tensor]:
    """The whole pipeline's weights in the original single-file layout (SD 1.x or SDXL)."""
    state = {**unet_state(pipeline.unet), **vae_state(pipeline.vae)}
    clip = _text_model_keys(pipeline.text_encoder.state_dict())
    if getattr(pipeline, "text_encoder_2", None) is None:
        state.update({SD_CLIP_PREFIX + key: tensor for key, tensor in clip.items()})
    else:
        state.update({SDXL_CLIP_PREFIX + key: tensor for key, tensor in clip.items()})
        state.update({SDXL_OPEN_CLIP_PREFIX + key: t for key, t in open_clip_state(pipeline.text_encoder_2).items()})
    return state


def save_single_file(pipeline: Any, path: Path) -> Path:
    """Writes ``pipeline`` to ``path`` as one original-layout safetensors file."""
    save_file({key: tensor.detach().contiguous() for key, tensor in original_state(pipeline).items()}, str(path))
    return path
