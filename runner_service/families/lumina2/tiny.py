"""Lumina 2's tiny random build, with a four-block VAE (the pipeline assumes x8)."""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.transformer_lumina2 import Lumina2Transformer2DModel
from diffusers.pipelines.lumina2.pipeline_lumina2 import Lumina2Pipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import Gemma2Config, Gemma2Model

from runner_service.families.seeded import seeded
from runner_service.families.text_models import gemma_tokenizer


def build_lumina2() -> Lumina2Pipeline:
    tokenizer = gemma_tokenizer()
    transformer = seeded(
        lambda: Lumina2Transformer2DModel(
            sample_size=4,
            patch_size=2,
            in_channels=4,
            hidden_size=8,
            num_layers=2,
            num_attention_heads=1,
            num_kv_heads=1,
            multiple_of=16,
            ffn_dim_multiplier=None,
            norm_eps=1e-5,
            scaling_factor=1.0,
            axes_dim_rope=(4, 2, 2),
            cap_feat_dim=8,
        )
    )
    # Four blocks (x8): the pipeline assumes vae_scale_factor 8 whatever the VAE.
    vae = seeded(
        lambda: AutoencoderKL(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            block_out_channels=(4, 4, 4, 4),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=1,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        ).eval()
    )
    text_config = Gemma2Config(
        head_dim=4,
        hidden_size=8,
        intermediate_size=8,
        num_attention_heads=2,
        num_hidden_layers=2,
        num_key_value_heads=2,
        sliding_window=2,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Lumina2Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=seeded(lambda: Gemma2Model(text_config)),
        tokenizer=tokenizer,
    )
