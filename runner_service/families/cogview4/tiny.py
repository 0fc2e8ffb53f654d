"""CogView4's tiny random build, with a GLM encoder and a byte-level tokenizer built in memory."""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.transformer_cogview4 import CogView4Transformer2DModel
from diffusers.pipelines.cogview4.pipeline_cogview4 import CogView4Pipeline
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import GlmConfig, GlmModel

from runner_service.families.seeded import seeded
from runner_service.families.text_models import glm_tokenizer


def build_cogview4() -> CogView4Pipeline:
    tokenizer = glm_tokenizer()
    transformer = seeded(
        lambda: CogView4Transformer2DModel(
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=4,
            num_attention_heads=4,
            out_channels=4,
            text_embed_dim=32,
            time_embed_dim=8,
            condition_dim=4,
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
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25,
        max_shift=0.75,
        base_image_seq_len=256,
        use_dynamic_shifting=True,
        time_shift_type="linear",
    )
    text_config = GlmConfig(
        hidden_size=32,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=8,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # The tokenizer is annotated as AutoTokenizer, a factory rather than a class of tokenizers.
    return CogView4Pipeline(
        tokenizer=tokenizer,
        text_encoder=seeded(lambda: GlmModel(text_config)),
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )
