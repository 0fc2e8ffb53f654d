"""HunyuanDiT's tiny random build, with a four-block VAE (its rotary embedding assumes x8)."""

from __future__ import annotations

from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiT2DModel
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import HunyuanDiTPipeline
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from transformers import BertConfig, BertModel

from runner_service.families.seeded import seeded
from runner_service.families.text_models import bert_tokenizer, t5_encoder, t5_tokenizer


def build_hunyuan_dit() -> HunyuanDiTPipeline:
    tokenizer = bert_tokenizer()
    t5 = t5_tokenizer()
    transformer = seeded(
        lambda: HunyuanDiT2DModel(
            sample_size=16,
            num_layers=2,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=3,
            in_channels=4,
            cross_attention_dim=32,
            cross_attention_dim_t5=32,
            pooled_projection_dim=16,
            hidden_size=24,
            activation_fn="gelu-approximate",
        ).eval()
    )
    # Shaped like hf-internal-testing/tiny-random-BertModel.
    bert_config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=512,
        type_vocab_size=16,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Four blocks (x8): the pipeline sizes its rotary embedding for latents of size / 8 whatever the VAE.
    vae = seeded(
        lambda: AutoencoderKL(
            block_out_channels=(16, 16, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=8,
        ).eval()
    )
    return HunyuanDiTPipeline(
        vae=vae,
        text_encoder=seeded(lambda: BertModel(bert_config).eval()),
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=DDPMScheduler(),
        safety_checker=None,  # type: ignore[arg-type]
        feature_extractor=None,
        requires_safety_checker=False,
        text_encoder_2=seeded(lambda: t5_encoder(t5)),
        tokenizer_2=t5,
    )
