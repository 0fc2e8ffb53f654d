"""Sana's tiny random build, from diffusers' test config with a Gemma 2 encoder and tokenizer built in memory."""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_dc import AutoencoderDC
from diffusers.models.transformers.sana_transformer import SanaTransformer2DModel
from diffusers.pipelines.sana.pipeline_sana import SanaPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import Gemma2Config, Gemma2Model

from runner_service.families.seeded import seeded
from runner_service.families.text_models import gemma_tokenizer


def build_sana() -> SanaPipeline:
    tokenizer = gemma_tokenizer()
    transformer = seeded(
        lambda: SanaTransformer2DModel(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_attention_heads=2,
            attention_head_dim=4,
            num_cross_attention_heads=2,
            cross_attention_head_dim=4,
            cross_attention_dim=8,
            caption_channels=8,
            sample_size=32,
        )
    )
    vae = seeded(
        lambda: AutoencoderDC(
            in_channels=3,
            latent_channels=4,
            attention_head_dim=2,
            encoder_block_types=("ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8),
            decoder_block_out_channels=(8, 8),
            encoder_qkv_multiscales=((), (5,)),
            decoder_qkv_multiscales=((), (5,)),
            encoder_layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1),
            downsample_block_type="conv",
            upsample_block_type="interpolate",
            decoder_norm_types="rms_norm",
            decoder_act_fns="silu",
            scaling_factor=0.41407,
        )
    )
    text_config = Gemma2Config(
        head_dim=16,
        hidden_size=8,
        initializer_range=0.02,
        intermediate_size=64,
        max_position_embeddings=8192,
        num_attention_heads=2,
        num_hidden_layers=1,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return SanaPipeline(
        tokenizer=tokenizer,
        text_encoder=seeded(lambda: Gemma2Model(text_config)),
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )
