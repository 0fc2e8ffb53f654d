"""Flux's tiny random build, from diffusers' test config (with a guidance embedding)."""

from __future__ import annotations

from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import CLIPTextModel

from runner_service.families.sd3.tiny import one_block_vae
from runner_service.families.seeded import seeded
from runner_service.families.text_models import clip_config, clip_tokenizer, t5_encoder, t5_tokenizer


def build_flux() -> FluxPipeline:
    tokenizer = clip_tokenizer()
    t5 = t5_tokenizer()
    transformer = seeded(
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),
        )
    )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=one_block_vae(latent_channels=1),
        text_encoder=seeded(lambda: CLIPTextModel(clip_config(tokenizer))),
        tokenizer=tokenizer,
        text_encoder_2=seeded(lambda: t5_encoder(t5)),
        tokenizer_2=t5,
        transformer=transformer,
    )
