"""LTX-Video's tiny random build, with a decoder that mirrors its encoder."""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl_ltx import AutoencoderKLLTXVideo
from diffusers.models.transformers.transformer_ltx import LTXVideoTransformer3DModel
from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from runner_service.families.seeded import seeded
from runner_service.families.text_models import t5_encoder, t5_tokenizer


def build_ltx() -> LTXPipeline:
    """LTX-Video text-to-video, from diffusers' test config. The test's VAE gives only its encoder
    small blocks and leaves the decoder at the real model's (about 900 MB saved, and a decoder that
    scales by more than the encoder compresses: videos twice the size, 2k - 1 frames); this decoder
    mirrors the encoder (8 wide, one layer per block, the same scaling)."""
    tokenizer = t5_tokenizer()
    transformer = seeded(
        lambda: LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=4,
            attention_head_dim=8,
            cross_attention_dim=32,
            num_layers=1,
            caption_channels=32,
        )
    )
    vae = seeded(
        lambda: AutoencoderKLLTXVideo(
            latent_channels=8,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            patch_size=1,
            patch_size_t=1,
            encoder_causal=True,
            decoder_causal=False,
        )
    )
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=seeded(lambda: t5_encoder(tokenizer)),
        tokenizer=tokenizer,
        transformer=transformer,
    )
