"""Wan 2.1 image-to-video's tiny random build."""

from __future__ import annotations

from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

from runner_service.families.seeded import seeded
from runner_service.families.text_models import t5_tokenizer
from runner_service.families.wan.tiny import umt5_encoder, wan_transformer, wan_vae


def build_wan_i2v() -> WanImageToVideoPipeline:
    """Wan 2.1 image-to-video: ``build_wan``'s components with a transformer that takes the image's
    latents and mask beside the noisy latents (16 + 20 channels in) and a CLIP image embedding
    (``image_dim`` 4), a tiny CLIP vision encoder and its image processor, as in diffusers' own test,
    plus what the test leaves out and Wan 2.1's image-to-video checkpoints have: key and value
    projections of the image tokens of their own (``added_kv_proj_dim``, the attention's width).
    The processor is the Pillow one by name: ``CLIPImageProcessor`` turns into it only where
    torchvision is missing, and would save under another class name where it is not."""
    tokenizer = t5_tokenizer()
    vision_config = CLIPVisionConfig(
        hidden_size=4,
        projection_dim=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        intermediate_size=16,
        patch_size=1,
    )
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=seeded(lambda: umt5_encoder(tokenizer)),
        vae=wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        image_processor=CLIPImageProcessorPil(crop_size=32, size=32),
        image_encoder=seeded(lambda: CLIPVisionModel(vision_config).eval()),
        transformer=wan_transformer(in_channels=36, image_dim=4, added_kv_proj_dim=24),
    )
