"""Kandinsky 3's tiny random build, with a four-block MoVQ as the real one."""

from __future__ import annotations

from diffusers.models.autoencoders.vq_model import VQModel
from diffusers.models.unets.unet_kandinsky3 import Kandinsky3UNet
from diffusers.pipelines.kandinsky3.pipeline_kandinsky3 import Kandinsky3Pipeline
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler

from runner_service.families.seeded import seeded
from runner_service.families.text_models import t5_encoder, t5_tokenizer


def build_kandinsky3() -> Kandinsky3Pipeline:
    tokenizer = t5_tokenizer()
    unet = seeded(
        lambda: Kandinsky3UNet(
            in_channels=4,
            time_embedding_dim=4,
            groups=2,
            attention_head_dim=4,
            layers_per_block=3,
            block_out_channels=(32, 64),
            cross_attention_dim=4,
            encoder_hid_dim=32,
        )
    )
    # Four blocks (x8), as the real MoVQ: the pipeline makes latents of size / 8 whatever the MoVQ.
    movq = seeded(
        lambda: VQModel(
            block_out_channels=(32, 32, 32, 32),
            down_block_types=("DownEncoderBlock2D",) * 3 + ("AttnDownEncoderBlock2D",),
            up_block_types=("AttnUpDecoderBlock2D",) + ("UpDecoderBlock2D",) * 3,
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=8,
            norm_type="spatial",
            num_vq_embeddings=12,
            vq_embed_dim=4,
        )
    )
    scheduler = DDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
        beta_schedule="squaredcos_cap_v2",
        clip_sample=True,
        thresholding=False,
    )
    return Kandinsky3Pipeline(
        tokenizer=tokenizer,
        text_encoder=seeded(lambda: t5_encoder(tokenizer)),
        unet=unet,
        scheduler=scheduler,
        movq=movq,
    )
