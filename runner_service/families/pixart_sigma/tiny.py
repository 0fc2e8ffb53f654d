"""PixArt-Sigma's tiny random build, and the components it shares with PixArt-alpha's."""

from __future__ import annotations

from typing import Any

from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import PixArtSigmaPipeline
from diffusers.schedulers.scheduling_ddim import DDIMScheduler

from runner_service.families.seeded import seeded
from runner_service.families.text_models import t5_encoder, t5_tokenizer


def pixart_components() -> dict[str, Any]:
    tokenizer = t5_tokenizer()
    transformer = seeded(
        lambda: PixArtTransformer2DModel(
            sample_size=8,
            num_layers=2,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=3,
            caption_channels=32,
            in_channels=4,
            cross_attention_dim=24,
            out_channels=8,
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
        ).eval()
    )
    return {
        "transformer": transformer,
        "vae": seeded(lambda: AutoencoderKL().eval()),
        "scheduler": DDIMScheduler(),
        "text_encoder": seeded(lambda: t5_encoder(tokenizer)),
        "tokenizer": tokenizer,
    }


def build_pixart_sigma() -> PixArtSigmaPipeline:
    return PixArtSigmaPipeline(**pixart_components())
