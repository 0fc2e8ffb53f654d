"""Wan 2.1 text-to-video's tiny random build, and the VAE, encoder and transformer the image-to-video one shares."""

from __future__ import annotations

from typing import Any

from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

from runner_service.families.seeded import seeded
from runner_service.families.text_models import t5_tokenizer, tiny_t5_sizes


def wan_vae() -> AutoencoderKLWan:
    """The tests' Wan 2.1 VAE: x8 in space, x4 in time (frames 4k+1), 16 latent channels."""
    vae: AutoencoderKLWan = seeded(
        lambda: AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ).eval()
    )
    return vae


def umt5_encoder(tokenizer: T5Tokenizer) -> UMT5EncoderModel:
    """A UMT5 encoder (Wan's text encoder class) shaped like ``t5_encoder``'s tiny T5 (d_model 32)."""
    encoder = UMT5EncoderModel(UMT5Config(**tiny_t5_sizes(tokenizer)))
    encoder.eval()
    return encoder


def wan_transformer(**overrides: Any) -> WanTransformer3DModel:
    """The tests' Wan transformer: patch (1, 2, 2), so with the x8 VAE the size grid is 16."""
    config: dict[str, Any] = {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 2,
        "attention_head_dim": 12,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 32,
        "freq_dim": 256,
        "ffn_dim": 32,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 32,
        **overrides,
    }
    transformer: WanTransformer3DModel = seeded(lambda: WanTransformer3DModel(**config))
    return transformer


def build_wan() -> WanPipeline:
    """Wan 2.1 text-to-video, from diffusers' test config with a UMT5 encoder and tokenizer built in memory."""
    tokenizer = t5_tokenizer()
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=seeded(lambda: umt5_encoder(tokenizer)),
        vae=wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=wan_transformer(),
    )
