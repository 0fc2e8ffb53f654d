"""Tiny random pipelines of many diffusers families, built offline (``families`` declares them).

Each builder makes a complete diffusers pipeline from configs with seeded random weights: the
tiny component configs of diffusers' own pipeline tests (``tests/pipelines/<family>/test_*.py``,
``get_dummy_components()``), with every tokenizer and text encoder those tests fetch from the hub
(``hf-internal-testing/...``) replaced by one built in memory (``text_models``). Nothing is
downloaded, and the same name gives the same bytes on every build. Where a test config would not
give the requested image size, or would make a saved model larger than a few MB, the config is
changed; the family's record in ``families`` says why.
"""

from __future__ import annotations

from typing import Any, TypeVar

import diffusers
from diffusers.models.autoencoders.autoencoder_dc import AutoencoderDC
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.autoencoder_kl_ltx import AutoencoderKLLTXVideo
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.models.autoencoders.vq_model import VQModel
from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiT2DModel
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
from diffusers.models.transformers.sana_transformer import SanaTransformer2DModel
from diffusers.models.transformers.transformer_cogview4 import CogView4Transformer2DModel
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.models.transformers.transformer_ltx import LTXVideoTransformer3DModel
from diffusers.models.transformers.transformer_lumina2 import Lumina2Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.models.unets.unet_kandinsky3 import Kandinsky3UNet
from diffusers.pipelines.cogview4.pipeline_cogview4 import CogView4Pipeline
from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel
from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_diffnext import WuerstchenDiffNeXt
from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior
from diffusers.pipelines.deprecated.wuerstchen.pipeline_wuerstchen_combined import WuerstchenCombinedPipeline
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import HunyuanDiTPipeline
from diffusers.pipelines.kandinsky3.pipeline_kandinsky3 import Kandinsky3Pipeline
from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline
from diffusers.pipelines.lumina2.pipeline_lumina2 import Lumina2Pipeline
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import PixArtAlphaPipeline
from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import PixArtSigmaPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from diffusers.pipelines.sana.pipeline_sana import SanaPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_instruct_pix2pix import (
    StableDiffusionInstructPix2PixPipeline,
)
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.schedulers.scheduling_ddpm_wuerstchen import DDPMWuerstchenScheduler
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from transformers import (
    BertConfig,
    BertModel,
    CLIPImageProcessorPil,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    CLIPVisionModel,
    Gemma2Config,
    Gemma2Model,
    GlmConfig,
    GlmModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

from runner_service.models.builtin import build_pipeline, seeded
from runner_service.models.text_models import (
    bert_tokenizer,
    clip_config,
    clip_tokenizer,
    gemma_tokenizer,
    glm_tokenizer,
    qwen_tokenizer,
    t5_encoder,
    t5_tokenizer,
    tiny_t5_sizes,
)

_Pipeline = TypeVar("_Pipeline", bound=DiffusionPipeline)


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


def _one_block_vae(latent_channels: int) -> AutoencoderKL:
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
        vae=_one_block_vae(latent_channels=4),
        text_encoder=seeded(lambda: CLIPTextModelWithProjection(clip_config(tokenizer))),
        tokenizer=tokenizer,
        text_encoder_2=seeded(lambda: CLIPTextModelWithProjection(clip_config(tokenizer))),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=seeded(lambda: t5_encoder(t5)),
        tokenizer_3=t5,
    )


def build_flux() -> FluxPipeline:
    tokenizer = clip_tokenizer()
    t5 = t5_tokenizer()
    transformer = seeded(
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),
        )
    )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_one_block_vae(latent_channels=1),
        text_encoder=seeded(lambda: CLIPTextModel(clip_config(tokenizer))),
        tokenizer=tokenizer,
        text_encoder_2=seeded(lambda: t5_encoder(t5)),
        tokenizer_2=t5,
        transformer=transformer,
    )


def _pixart_components() -> dict[str, Any]:
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


def build_pixart_alpha() -> PixArtAlphaPipeline:
    return PixArtAlphaPipeline(**_pixart_components())


def build_pixart_sigma() -> PixArtSigmaPipeline:
    return PixArtSigmaPipeline(**_pixart_components())


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
        tokenizer=tokenizer,  # type: ignore[arg-type]
        text_encoder=seeded(lambda: GlmModel(text_config)),
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )


def build_qwen_image() -> QwenImagePipeline:
    tokenizer = qwen_tokenizer()
    transformer = seeded(
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=3,
            joint_attention_dim=16,
            guidance_embeds=False,
            axes_dims_rope=(8, 4, 4),
        )
    )
    z_dim = 4
    vae = seeded(
        lambda: AutoencoderKLQwenImage(
            base_dim=z_dim * 2,
            z_dim=z_dim,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        )
    )
    ids = tokenizer.get_vocab()
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
            "vocab_size": len(tokenizer),
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
    )
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=seeded(lambda: Qwen2_5_VLForConditionalGeneration(config).eval()),  # type: ignore[no-untyped-call]  # transformers leaves it untyped
        tokenizer=tokenizer,
        transformer=transformer,
    )


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
        text_encoder=seeded(lambda: BertModel(bert_config).eval()),  # type: ignore[no-untyped-call]  # transformers leaves it untyped
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=DDPMScheduler(),
        safety_checker=None,  # type: ignore[arg-type]
        feature_extractor=None,  # type: ignore[arg-type]
        requires_safety_checker=False,
        text_encoder_2=seeded(lambda: t5_encoder(t5)),
        tokenizer_2=t5,
    )


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


def build_wuerstchen() -> WuerstchenCombinedPipeline:
    tokenizer = clip_tokenizer()
    prior = seeded(lambda: WuerstchenPrior(c_in=2, c=8, depth=2, c_cond=32, c_r=8, nhead=2).eval())
    decoder = seeded(
        lambda: WuerstchenDiffNeXt(
            c_cond=32,
            c_hidden=[32],
            nhead=[-1],
            blocks=[4],
            level_config=["CT"],
            clip_embd=32,
            inject_effnet=[False],
        ).eval()
    )
    vqgan = seeded(lambda: PaellaVQModel(bottleneck_blocks=1, embed_dim=32, num_vq_embeddings=2).eval())
    pipeline = WuerstchenCombinedPipeline(
        tokenizer=tokenizer,
        text_encoder=seeded(lambda: CLIPTextModel(clip_config(tokenizer)).eval()),  # type: ignore[no-untyped-call]  # transformers leaves it untyped
        decoder=decoder,
        scheduler=DDPMWuerstchenScheduler(),
        vqgan=vqgan,
        prior_tokenizer=clip_tokenizer(),
        prior_text_encoder=seeded(lambda: CLIPTextModel(clip_config(tokenizer)).eval()),  # type: ignore[no-untyped-call]  # transformers leaves it untyped
        prior_prior=prior,
        prior_scheduler=DDPMWuerstchenScheduler(),
    )
    return _declare_own_modules(pipeline)


def _declare_own_modules(pipeline: _Pipeline) -> _Pipeline:
    """Names each component diffusers does not export by its module, so ``from_pretrained`` finds it.

    Diffusers moved Wuerstchen to ``diffusers.pipelines.deprecated.wuerstchen`` and no longer
    exports its models (``WuerstchenPrior``, ``WuerstchenDiffNeXt``, ``PaellaVQModel``) from
    ``diffusers`` or ``diffusers.pipelines``, yet ``save_pretrained`` declares them as
    ``["diffusers", "WuerstchenPrior"]``, which ``from_pretrained`` cannot resolve (nor the
    ``["wuerstchen", ...]`` of the published models: huggingface/diffusers#14008). Declared by
    their full module path instead, they load: ``from_pretrained`` takes a library that is
    neither transformers nor diffusers from ``sys.modules``, and importing the pipeline class,
    which it does first, imports these modules.
    """
    for name, component in pipeline.components.items():
        declared = pipeline.config.get(name)
        if component is None or not isinstance(declared, (list, tuple)) or declared[0] != "diffusers":
            continue
        if not hasattr(diffusers, declared[1]):
            pipeline.register_to_config(**{name: (type(component).__module__, declared[1])})  # type: ignore[no-untyped-call]
    return pipeline


def build_instruct_pix2pix() -> StableDiffusionInstructPix2PixPipeline:
    """InstructPix2Pix, an edit model: the ``tiny`` SD 1.x with a UNet that takes the image's
    latents beside the noisy ones (8 channels in), as in diffusers' own test."""
    base = build_pipeline("tiny")
    unet = seeded(lambda: UNet2DConditionModel.from_config(base.unet.config, in_channels=8))
    return StableDiffusionInstructPix2PixPipeline(**{**base.components, "unet": unet}, requires_safety_checker=False)


def _wan_vae() -> AutoencoderKLWan:
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


def _umt5_encoder(tokenizer: T5Tokenizer) -> UMT5EncoderModel:
    """A UMT5 encoder (Wan's text encoder class) shaped like ``t5_encoder``'s tiny T5 (d_model 32)."""
    encoder = UMT5EncoderModel(UMT5Config(**tiny_t5_sizes(tokenizer)))
    encoder.eval()  # type: ignore[no-untyped-call]  # transformers leaves it untyped
    return encoder


def _wan_transformer(**overrides: Any) -> WanTransformer3DModel:
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
        tokenizer=tokenizer,  # type: ignore[arg-type]  # annotated as AutoTokenizer, a factory rather than a class
        text_encoder=seeded(lambda: _umt5_encoder(tokenizer)),
        vae=_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=_wan_transformer(),
    )


def build_wan_i2v() -> WanImageToVideoPipeline:
    """Wan 2.1 image-to-video: ``build_wan``'s components with a transformer that takes the image's
    latents and mask beside the noisy latents (16 + 20 channels in) and a CLIP image embedding
    (``image_dim`` 4), a tiny CLIP vision encoder and its image processor, as in diffusers' own test,
    plus what the test leaves out and Wan 2.1's image-to-video checkpoints have: key and value
    projections of the image tokens of their own (``added_kv_proj_dim``, the attention's width).
    The processor is the Pillow one by name: ``CLIPImageProcessor`` turns into it only where
    torchvision is missing, and would save under another class name where it is not."""
    tokenizer = t5_tokenizer()
    vision_config = CLIPVisionConfig(
        hidden_size=4,
        projection_dim=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        intermediate_size=16,
        patch_size=1,
    )
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,  # type: ignore[arg-type]  # annotated as AutoTokenizer, a factory rather than a class
        text_encoder=seeded(lambda: _umt5_encoder(tokenizer)),
        vae=_wan_vae(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        image_processor=CLIPImageProcessorPil(crop_size=32, size=32),  # type: ignore[arg-type]  # the Pillow twin of the annotated class
        image_encoder=seeded(lambda: CLIPVisionModel(vision_config).eval()),  # type: ignore[no-untyped-call]  # transformers leaves it untyped
        transformer=_wan_transformer(in_channels=36, image_dim=4, added_kv_proj_dim=24),
    )


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
