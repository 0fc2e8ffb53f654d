"""Stable Diffusion 3's tiny random build, and the one-block VAE of the flow-matching transformer families' tests."""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import CLIPTextModelWithProjection

from runner_service.families.seeded import seeded
from runner_service.families.text_models import clip_config, clip_tokenizer, t5_encoder, t5_tokenizer


def one_block_vae(latent_channels: int) -> AutoencoderKL:
    """The tests' one-block (x1) VAE of the flow-matching transformer families."""
    vae: AutoencoderKL = seeded(
        lambda: AutoencoderKL(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            block_out_channels=(4,),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=1,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
    )
    return vae


def build_sd3() -> StableDiffusion3Pipeline:
    tokenizer = clip_tokenizer()
    t5 = t5_tokenizer()
    transformer = seeded(
        lambda: SD3Transformer2DModel(
            sample_size=32,
            patch_size=1,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=32,
            pooled_projection_dim=64,
            out_channels=4,
        )
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=one_block_vae(latent_channels=4),
        text_encoder=seeded(lambda: CLIPTextModelWithProjection(clip_config(tokenizer))),
        tokenizer=tokenizer,
        text_encoder_2=seeded(lambda: CLIPTextModelWithProjection(clip_config(tokenizer))),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=seeded(lambda: t5_encoder(t5)),
        tokenizer_3=t5,
    )
