"""Tiny random text-to-image pipelines of many diffusers families, built offline.

Each builder makes a complete diffusers pipeline from configs with seeded random
weights: the tiny component configs of diffusers' own pipeline tests
(``tests/pipelines/<family>/test_*.py``, ``get_dummy_components()``), with
every tokenizer and text encoder those tests fetch from the hub
(``hf-internal-testing/...``) replaced by one built in memory: a byte-level CLIP
BPE, a T5 Unigram, a byte-fallback Gemma BPE, a byte-level Qwen2 or GLM BPE, or
a WordPiece BERT vocabulary, each with a text encoder of a tiny config. Nothing
is downloaded. The same name gives the same bytes on every build.

Where a test config would not give the requested image size, or would make a
saved model larger than a few MB, the config is changed and the change is noted
below. Sizes are width = height in pixels; "grid" is the multiple the requested
size must be of (VAE scale factor times transformer patch size, or the
pipeline's own rule; non-square sizes on the grid work too). ``SMALLEST_SIZE``
is the smallest size, found by trying, at which one step through
``DiffusionPipeline.from_pretrained`` gives an image of exactly that size, with
and without classifier-free guidance. (The worker refuses sizes under its
``--min-size``, 8 by default.)

Call quirks of each family (what its ``__call__`` takes):

sd (StableDiffusionPipeline; the built-in ``tiny`` model)
    ``callback_on_step_end``; ``negative_prompt``; ``guidance_scale``. VAE x8,
    grid 8. Smallest 24: at 16 a UNet GroupNorm gets one value per group when
    the batch is a single image (no CFG; with CFG 16 works).
sdxl (StableDiffusionXLPipeline)
    ``callback_on_step_end``; ``negative_prompt`` (and ``negative_prompt_2``);
    ``guidance_scale``. VAE x2 (two blocks); ``check_inputs`` wants a multiple
    of 8. Built with ``add_watermarker=False`` (no invisible-watermark package).
sd3 (StableDiffusion3Pipeline)
    ``callback_on_step_end``; ``negative_prompt`` (``_2``, ``_3``);
    ``guidance_scale``; ``max_sequence_length`` for T5. VAE x1 (one block),
    patch 1: grid 1, and a 1x1 image works.
flux (FluxPipeline, ``guidance_embeds=True``)
    ``callback_on_step_end``; ``negative_prompt`` only counts with
    ``true_cfg_scale > 1`` (real CFG, a second pass); ``guidance_scale`` is the
    distilled guidance fed to the transformer's guidance embedding, not CFG.
    VAE x1, latents packed 2x2: grid 2.
pixart-alpha (PixArtAlphaPipeline), pixart-sigma (PixArtSigmaPipeline)
    Legacy ``callback``/``callback_steps`` only: a ``callback_on_step_end`` is
    swallowed by ``**kwargs`` and never called, without an error;
    ``negative_prompt`` (default ``""``); ``guidance_scale``. Pass
    ``use_resolution_binning=False``: binning picks its aspect-ratio table from
    ``transformer.config.sample_size`` (128, 64 or 32 only) and raises for
    these tiny transformers. ``clean_caption=True`` by default wants bs4 and
    ftfy (without them it warns and goes on). VAE x1 (diffusers' default
    ``AutoencoderKL()``), patch 2, but ``check_inputs`` wants a multiple of 8.
sana (SanaPipeline)
    ``callback_on_step_end``; ``negative_prompt``; ``guidance_scale``; pass
    ``use_resolution_binning=False`` (else the size snaps to a 1024-pixel
    aspect-ratio bin and the image is resized back: slow).
    ``complex_human_instruction`` defaults to a long instruction put before
    the prompt; pass ``None`` to encode the prompt alone. DC-AE x2, patch 1,
    but ``check_inputs`` wants a multiple of 32.
lumina2 (Lumina2Pipeline)
    ``callback_on_step_end``; ``negative_prompt``; ``guidance_scale`` (with
    ``cfg_trunc_ratio``, ``cfg_normalization``); ``system_prompt``. The
    pipeline hard-codes ``vae_scale_factor = 8`` (with patch 2: grid 16), so
    the test's one-block VAE (x1) would give an image 8 times too small: this
    VAE has four blocks (x8).
cogview4 (CogView4Pipeline)
    ``callback_on_step_end``; ``negative_prompt``; ``guidance_scale``. VAE x2,
    patch 2, but ``check_inputs`` wants a multiple of 16. The real tokenizer is
    GLM-4's (remote code); this one is a byte-level BPE in
    ``PreTrainedTokenizerFast`` (saved and loaded back as transformers 5's
    ``TokenizersBackend``) that, like GLM-4's, starts every text with
    ``[gMASK]<sop>``; the text encoder is ``GlmModel``, as annotated.
qwen-image (QwenImagePipeline)
    ``callback_on_step_end``; ``negative_prompt`` only counts with
    ``true_cfg_scale > 1`` (default 4.0: real CFG, two passes, but only when a
    negative prompt is given); ``guidance_scale`` is only for
    guidance-distilled transformers (this one has ``guidance_embeds=False``:
    leave it ``None``). VAE x4 (2 ** ``len(temperal_downsample)``), latents
    packed 2x2: grid 8. The test's VAE (``base_dim=24``) would save 16 MB: this
    one has ``base_dim=8``. The text encoder's vocabulary is the tokenizer's
    (bytes plus Qwen's chat and vision tokens) instead of 152064 entries.
hunyuan-dit (HunyuanDiTPipeline)
    ``callback_on_step_end``; ``negative_prompt``; ``guidance_scale`` (and
    ``guidance_rescale``); pass ``use_resolution_binning=False`` (else sizes
    not in its table map to about 1024 pixels). The pipeline sizes its rotary
    embedding for latents of size / 8 / patch whatever the VAE, so with the
    test's x1 VAE (``AutoencoderKL()``) most sizes fail or come out wrong: this
    VAE has four blocks (x8). Patch 2: grid 16.
kandinsky3 (Kandinsky3Pipeline)
    ``callback_on_step_end`` (legacy ``callback`` through ``**kwargs``,
    deprecated); ``negative_prompt``; ``guidance_scale``. The pipeline rounds
    the size up to a multiple of 64 and makes latents of that size / 8 whatever
    the MoVQ, so the test's two-block MoVQ (x2) gives the right size at 16 only:
    this MoVQ has four blocks (x8), as the real one. Grid 64; other sizes come
    out rounded up to the next multiple of 64.
wuerstchen (WuerstchenCombinedPipeline: prior and decoder in one directory)
    ``callback_on_step_end`` for the decoder and ``prior_callback_on_step_end``
    for the prior; ``negative_prompt``; ``prior_guidance_scale`` and
    ``decoder_guidance_scale`` (no ``guidance_scale``); steps are
    ``prior_num_inference_steps`` (default 60) and ``num_inference_steps``
    (decoder). The image is int(ceil(size / 42.67) * 10.67) * 4 pixels (prior
    ``resolution_multiple``, decoder ``latent_dim_scale``, Paella VQ x4):
    exactly the size for multiples of 128 only (96 gives 128, 64 fails). The
    test's decoder (``c_hidden=[320]``) and VQ model (``embed_dim=384``) would
    save about 50 MB: these are 32 wide. Diffusers 0.42 saves the Wuerstchen
    models in ``model_index.json`` under a library it cannot load them from
    (see ``_declare_own_modules``): they are declared by module path instead.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import diffusers
import torch
from diffusers.models.autoencoders.autoencoder_dc import AutoencoderDC
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.autoencoders.vq_model import VQModel
from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiT2DModel
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
from diffusers.models.transformers.sana_transformer import SanaTransformer2DModel
from diffusers.models.transformers.transformer_cogview4 import CogView4Transformer2DModel
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from diffusers.models.transformers.transformer_lumina2 import Lumina2Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
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
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.schedulers.scheduling_ddpm_wuerstchen import DDPMWuerstchenScheduler
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import (
    BertConfig,
    BertModel,
    BertTokenizer,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Gemma2Config,
    Gemma2Model,
    GemmaTokenizer,
    GlmConfig,
    GlmModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from runner_service.models.builtin import build_pipeline as build_builtin_pipeline
from runner_service.models.builtin import save_pipeline_atomically

_Pipeline = TypeVar("_Pipeline", bound=DiffusionPipeline)

SEED = 0

# The characters every in-memory vocabulary has a token for (others become byte or unknown tokens).
_CHARS = string.ascii_letters + string.digits + string.punctuation


def _seeded(factory: Callable[[], Any]) -> Any:
    """Builds one component right after seeding torch, so its random weights never depend on the others."""
    torch.manual_seed(SEED)
    return factory()


# --- tokenizers ---------------------------------------------------------------------------------------------


def _clip_tokenizer() -> CLIPTokenizer:
    """A byte-level CLIP BPE with no merges: every byte, alone or ending a word, is one token."""
    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77, pad_token="<|endoftext|>")


def _t5_tokenizer() -> T5Tokenizer:
    """A T5 SentencePiece-style Unigram over single characters, with and without the word-start mark."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + c, -3.0) for c in _CHARS] + [(c, -4.0) for c in _CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def _gemma_tokenizer() -> GemmaTokenizer:
    """A Gemma BPE with byte fallback and no merges, starting texts with ``<bos>`` as Gemma's does."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + list(_CHARS)
    vocab = {token: index for index, token in enumerate(tokens)}
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True, model_max_length=8192)


def _byte_level_vocab(specials: list[str]) -> dict[str, int]:
    tokens = list(bytes_to_unicode().values()) + specials
    return {token: index for index, token in enumerate(tokens)}


_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def _qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level Qwen2 BPE with no merges, plus Qwen's chat and vision tokens."""
    tokenizer = Qwen2Tokenizer(vocab=_byte_level_vocab(_QWEN_SPECIALS), merges=[], model_max_length=32768)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in _QWEN_SPECIALS[1:]])
    return tokenizer


def _glm_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE standing in for GLM-4's tokenizer: it prefixes every text with ``[gMASK]<sop>``."""
    specials = ["<|endoftext|>", "[gMASK]", "<sop>"]
    vocab = _byte_level_vocab(specials)
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    backend.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A",
        pair="[gMASK] <sop> $A $B",
        special_tokens=[("[gMASK]", vocab["[gMASK]"]), ("<sop>", vocab["<sop>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        padding_side="left",
        model_max_length=8192,
    )


def _bert_tokenizer() -> BertTokenizer:
    """A lower-casing WordPiece BERT vocabulary of single characters and their ``##`` continuations."""
    chars = string.ascii_lowercase + string.digits + string.punctuation
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(chars) + ["##" + c for c in chars]
    return BertTokenizer(vocab={token: index for index, token in enumerate(tokens)}, model_max_length=77)


# --- text encoders ------------------------------------------------------------------------------------------


def _clip_config(tokenizer: CLIPTokenizer, hidden_size: int = 32, projection_dim: int = 32) -> CLIPTextConfig:
    """The tests' tiny CLIP text config, sized to the in-memory tokenizer."""
    return CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden_size,
        intermediate_size=37,
        layer_norm_eps=1e-05,
        num_attention_heads=4,
        num_hidden_layers=5,
        vocab_size=len(tokenizer),
        max_position_embeddings=77,
        hidden_act="gelu",
        projection_dim=projection_dim,
    )


def _t5_encoder(tokenizer: T5Tokenizer) -> T5EncoderModel:
    """A T5 encoder shaped like ``hf-internal-testing/tiny-random-t5`` (d_model 32)."""
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_ff=37,
        d_kv=8,
        num_heads=4,
        num_layers=5,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return _seeded(lambda: T5EncoderModel(config).eval())


# --- families -----------------------------------------------------------------------------------------------


def build_sd() -> DiffusionPipeline:
    """SD 1.x: the built-in ``tiny`` model."""
    return build_builtin_pipeline("tiny")


def build_sdxl() -> StableDiffusionXLPipeline:
    tokenizer = _clip_tokenizer()
    unet = _seeded(
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
    vae = _seeded(
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
    text_encoder = _seeded(lambda: CLIPTextModel(_clip_config(tokenizer)))
    text_encoder_2 = _seeded(lambda: CLIPTextModelWithProjection(_clip_config(tokenizer)))
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
        tokenizer_2=_clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,  # type: ignore[arg-type]
        add_watermarker=False,
    )


def _one_block_vae(latent_channels: int) -> AutoencoderKL:
    """The tests' one-block (x1) VAE of the flow-matching transformer families."""
    return _seeded(
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


def build_sd3() -> StableDiffusion3Pipeline:
    tokenizer = _clip_tokenizer()
    t5_tokenizer = _t5_tokenizer()
    transformer = _seeded(
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
        text_encoder=_seeded(lambda: CLIPTextModelWithProjection(_clip_config(tokenizer))),
        tokenizer=tokenizer,
        text_encoder_2=_seeded(lambda: CLIPTextModelWithProjection(_clip_config(tokenizer))),
        tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5_encoder(t5_tokenizer),
        tokenizer_3=t5_tokenizer,
    )


def build_flux() -> FluxPipeline:
    tokenizer = _clip_tokenizer()
    t5_tokenizer = _t5_tokenizer()
    transformer = _seeded(
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
        text_encoder=_seeded(lambda: CLIPTextModel(_clip_config(tokenizer))),
        tokenizer=tokenizer,
        text_encoder_2=_t5_encoder(t5_tokenizer),
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def _pixart_components() -> dict[str, Any]:
    tokenizer = _t5_tokenizer()
    transformer = _seeded(
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
        "vae": _seeded(lambda: AutoencoderKL().eval()),
        "scheduler": DDIMScheduler(),
        "text_encoder": _t5_encoder(tokenizer),
        "tokenizer": tokenizer,
    }


def build_pixart_alpha() -> PixArtAlphaPipeline:
    return PixArtAlphaPipeline(**_pixart_components())


def build_pixart_sigma() -> PixArtSigmaPipeline:
    return PixArtSigmaPipeline(**_pixart_components())


def build_sana() -> SanaPipeline:
    tokenizer = _gemma_tokenizer()
    transformer = _seeded(
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
    vae = _seeded(
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
        text_encoder=_seeded(lambda: Gemma2Model(text_config)),
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),  # type: ignore[arg-type]
    )


def build_lumina2() -> Lumina2Pipeline:
    tokenizer = _gemma_tokenizer()
    transformer = _seeded(
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
    vae = _seeded(
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
        text_encoder=_seeded(lambda: Gemma2Model(text_config)),
        tokenizer=tokenizer,
    )


def build_cogview4() -> CogView4Pipeline:
    tokenizer = _glm_tokenizer()
    transformer = _seeded(
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
    vae = _seeded(
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
        text_encoder=_seeded(lambda: GlmModel(text_config)),
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )


def build_qwen_image() -> QwenImagePipeline:
    tokenizer = _qwen_tokenizer()
    transformer = _seeded(
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
    vae = _seeded(
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
        text_encoder=_seeded(lambda: Qwen2_5_VLForConditionalGeneration(config).eval()),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def build_hunyuan_dit() -> HunyuanDiTPipeline:
    tokenizer = _bert_tokenizer()
    t5_tokenizer = _t5_tokenizer()
    transformer = _seeded(
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
    vae = _seeded(
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
        text_encoder=_seeded(lambda: BertModel(bert_config).eval()),
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=DDPMScheduler(),
        safety_checker=None,  # type: ignore[arg-type]
        feature_extractor=None,  # type: ignore[arg-type]
        requires_safety_checker=False,
        text_encoder_2=_t5_encoder(t5_tokenizer),
        tokenizer_2=t5_tokenizer,
    )


def build_kandinsky3() -> Kandinsky3Pipeline:
    tokenizer = _t5_tokenizer()
    unet = _seeded(
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
    movq = _seeded(
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
        text_encoder=_t5_encoder(tokenizer),
        unet=unet,
        scheduler=scheduler,
        movq=movq,
    )


def build_wuerstchen() -> WuerstchenCombinedPipeline:
    tokenizer = _clip_tokenizer()
    prior = _seeded(lambda: WuerstchenPrior(c_in=2, c=8, depth=2, c_cond=32, c_r=8, nhead=2).eval())
    decoder = _seeded(
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
    vqgan = _seeded(lambda: PaellaVQModel(bottleneck_blocks=1, embed_dim=32, num_vq_embeddings=2).eval())
    pipeline = WuerstchenCombinedPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(lambda: CLIPTextModel(_clip_config(tokenizer)).eval()),
        decoder=decoder,
        scheduler=DDPMWuerstchenScheduler(),
        vqgan=vqgan,
        prior_tokenizer=_clip_tokenizer(),
        prior_text_encoder=_seeded(lambda: CLIPTextModel(_clip_config(tokenizer)).eval()),
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
            pipeline.register_to_config(**{name: (type(component).__module__, declared[1])})
    return pipeline


FAMILIES: dict[str, Callable[[], DiffusionPipeline]] = {
    "sd": build_sd,
    "sdxl": build_sdxl,
    "sd3": build_sd3,
    "flux": build_flux,
    "pixart-alpha": build_pixart_alpha,
    "pixart-sigma": build_pixart_sigma,
    "sana": build_sana,
    "lumina2": build_lumina2,
    "cogview4": build_cogview4,
    "qwen-image": build_qwen_image,
    "hunyuan-dit": build_hunyuan_dit,
    "kandinsky3": build_kandinsky3,
    "wuerstchen": build_wuerstchen,
}

def build_instruct_pix2pix() -> StableDiffusionInstructPix2PixPipeline:
    """InstructPix2Pix, an edit model: the ``tiny`` SD 1.x with a UNet that takes the image's
    latents beside the noisy ones (8 channels in), as in diffusers' own test."""
    base = build_sd()
    unet = _seeded(lambda: UNet2DConditionModel.from_config(base.unet.config, in_channels=8))
    return StableDiffusionInstructPix2PixPipeline(**{**base.components, "unet": unet}, requires_safety_checker=False)


# Edit families: their pipeline takes an image and an instruction (served as TASK_EDIT only).
EDIT_FAMILIES: dict[str, Callable[[], DiffusionPipeline]] = {
    "instruct-pix2pix": build_instruct_pix2pix,
}

# The smallest width = height at which one step gives an image of exactly that size (found by trying).
SMALLEST_SIZE: dict[str, int] = {
    "sd": 24,
    "sdxl": 8,
    "sd3": 1,
    "flux": 2,
    "pixart-alpha": 8,
    "pixart-sigma": 8,
    "sana": 32,
    "lumina2": 16,
    "cogview4": 16,
    "qwen-image": 8,
    "hunyuan-dit": 16,
    "kandinsky3": 64,
    "wuerstchen": 128,
}


def build_family(name: str, directory: Path) -> Path:
    """Builds the named family's tiny pipeline and saves it to ``directory`` in diffusers format, atomically."""
    builders = {**FAMILIES, **EDIT_FAMILIES}
    if name not in builders:
        raise KeyError(f"unknown model family {name!r}; choose from {sorted(builders)}")
    return save_pipeline_atomically(builders[name], directory, f"model family {name}")
