"""Stable Diffusion XL's tiny random build, from diffusers' test config."""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from runner_service.families.seeded import seeded
from runner_service.families.text_models import clip_config, clip_tokenizer


def build_sdxl() -> StableDiffusionXLPipeline:
    tokenizer = clip_tokenizer()
    unet = seeded(
        lambda: UNet2DConditionModel(
            block_out_channels=(2, 4),
            layers_per_block=2,
            sample_size=32,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            transformer_layers_per_block=(1, 2),
            projection_class_embeddings_input_dim=80,  # 6 * 8 + 32
            cross_attention_dim=64,
            norm_num_groups=1,
        )
    )
    vae = seeded(
        lambda: AutoencoderKL(
            block_out_channels=(32, 64),
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            latent_channels=4,
            sample_size=128,
        )
    )
    text_encoder = seeded(lambda: CLIPTextModel(clip_config(tokenizer)))
    text_encoder_2 = seeded(lambda: CLIPTextModelWithProjection(clip_config(tokenizer)))
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
        beta_schedule="scaled_linear",
        timestep_spacing="leading",
    )
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
