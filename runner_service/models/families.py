"""The family registry: every diffusers family the runner knows by name, each declared once.

A ``Family`` record says what is particular to one family: the diffusers pipeline class a
checkpoint of it loads as, its tiny random build (``tiny_builds``), the smallest size that build
generates, its call quirks, its step-level denoising loop (or none: request-level batching), and
where it overrides what the pipeline adapter derives from the call signature. The pipeline
adapter, the denoising loops, the built-in catalog, the families table of ``docs/families.md``
(``table``) and the tests all read it; a real checkpoint is matched to its record by the exact
class name of its pipeline, so its quirks apply to it as to the tiny build.

Sizes are width = height in pixels; "grid" is the multiple the requested size must be of (VAE
scale factor times transformer patch size, or the pipeline's own rule; non-square sizes on the
grid work too). ``Family.smallest_size`` is the smallest size, found by trying, at which one step
of the tiny build through ``DiffusionPipeline.from_pretrained`` gives an image of exactly that
size, with and without classifier-free guidance. (The worker refuses sizes under its
``--min-size``, 8 by default.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.denoising.loops import DenoisingLoop
from runner_service.denoising.loops.cogview4 import CogView4Loop
from runner_service.denoising.loops.flux import FluxLoop
from runner_service.denoising.loops.hunyuan_dit import HunyuanDiTLoop
from runner_service.denoising.loops.instruct_pix2pix import InstructPix2PixLoop
from runner_service.denoising.loops.kandinsky3 import Kandinsky3Loop
from runner_service.denoising.loops.lumina2 import Lumina2Loop
from runner_service.denoising.loops.pixart import PixArtAlphaLoop, PixArtSigmaLoop
from runner_service.denoising.loops.qwen_image import QwenImageLoop
from runner_service.denoising.loops.sana import SanaLoop
from runner_service.denoising.loops.sd3 import StableDiffusion3Loop
from runner_service.denoising.loops.stable_diffusion import StableDiffusionLoop, StableDiffusionXLLoop
from runner_service.denoising.loops.wuerstchen import WuerstchenLoop
from runner_service.models import tiny_builds
from runner_service.models.builtin import build_pipeline, save_pipeline_atomically
from runner_service.previews import LatentPreview


@dataclass(frozen=True)
class VideoGrid:
    """The frame counts and sizes a video pipeline takes, as its components' configs give them."""

    frame_step: int  # frame counts are frame_step * k + 1 (the VAE's temporal compression)
    max_frames: int  # the most its transformer's position embedding covers; 0: no limit of the model's own
    # What widths and heights must be multiples of: VAE scale times patch, or more where ``check_inputs``
    # demands it. Video pipelines name their VAE factors their own way (no ``vae_scale_factor``), so the
    # adapter cannot derive it as it does for images.
    size_multiple: int
    max_size: int  # likewise for width and height; 0: no limit of the model's own


@dataclass(frozen=True)
class Video:
    """What a video family's pipeline does not say in its call signature (its default frame count
    is the ``num_frames`` default of ``__call__``)."""

    default_fps: int  # the frame rate its checkpoints are trained for: the call makes frames, not a rate
    grid: Callable[[DiffusionPipeline], VideoGrid]  # read from the loaded pipeline, so a real checkpoint's own


def wan_grid(pipeline: DiffusionPipeline) -> VideoGrid:
    """Wan's grid: frames 4k+1 (``vae_scale_factor_temporal``), and at most ``rope_max_seq_len``
    latent positions along each axis, since its rotary embedding is a table of that many rows that
    it slices and fails beyond (the tiny build's 32: 125 frames, 512 pixels; Wan 2.1's 1024)."""
    step = pipeline.vae_scale_factor_temporal
    config = pipeline.transformer.config
    rope = config.rope_max_seq_len
    patch_t, patch_h, patch_w = config.patch_size
    spatial = min(patch_h, patch_w) * pipeline.vae_scale_factor_spatial
    return VideoGrid(
        frame_step=step,
        max_frames=step * (rope * patch_t - 1) + 1,
        size_multiple=spatial,  # what its check_inputs wants too (16)
        max_size=rope * spatial,
    )


# LTX-Video's check_inputs wants multiples of 32 whatever its VAE and patch sizes.
_LTX_CHECKED_MULTIPLE = 32


def ltx_grid(pipeline: DiffusionPipeline) -> VideoGrid:
    """LTX-Video's grid: frames ``vae_temporal_compression_ratio`` k + 1 (8k+1 for the real VAE, 4k+1
    for the tiny build's), sizes multiples of the VAE ratio times the patch and of 32; its rotary
    position embedding is computed for the latents' size, so no limit of the model's own."""
    spatial = pipeline.vae_spatial_compression_ratio * pipeline.transformer_spatial_patch_size
    return VideoGrid(
        frame_step=pipeline.vae_temporal_compression_ratio * pipeline.transformer_temporal_patch_size,
        max_frames=0,
        size_multiple=math.lcm(spatial, _LTX_CHECKED_MULTIPLE),
        max_size=0,
    )


@dataclass(frozen=True)
class Family:
    """One family: its pipeline, its tiny build, and what the runner does differently for it."""

    name: str
    pipeline_class: str  # the diffusers class its checkpoints load as, matched exactly (a subclass may differ)
    build: Callable[[], DiffusionPipeline]  # its tiny build, in memory, with seeded random weights
    smallest_size: int  # of the tiny build, found by trying
    quirks: str  # what its ``__call__`` takes, and why the tiny build differs from diffusers' test config
    loop: type[DenoisingLoop] | None = None  # its step-level loop; None: batched per request
    # The pipeline rounds sizes inside ``__call__`` instead of refusing one off its grid: the multiple
    # that comes out exactly, reported as its size grid instead of the one the adapter derives.
    rounds_to: int = 0
    builtin: str = ""  # the built-in model (``catalog``) that is this tiny build, beside ``tiny`` and ``small``
    edit: bool = False  # its call takes an image and an instruction: it serves TASK_EDIT only
    video: Video | None = None  # a video family (text- or image-to-video); None: it makes images
    # Its latents' preview map (``runner_service.previews``); None: its requests get no previews.
    preview: LatentPreview | None = None


# Latent previews (``runner_service.previews``): each VAE's latent-to-RGB factors, a row of
# (R, G, B) per latent channel, as ComfyUI fitted them (``comfy/latent_formats.py``'s
# ``latent_rgb_factors`` and ``latent_rgb_factors_bias``); a family names the one of the VAE its
# checkpoints use.
SD1_LATENTS = LatentPreview((
    (0.3512, 0.2297, 0.3227), (0.3250, 0.4974, 0.2350), (-0.2829, 0.1762, 0.2721), (-0.2120, -0.2616, -0.7177)))
SDXL_LATENTS = LatentPreview((
    (0.3651, 0.4232, 0.4341), (-0.2533, -0.0042, 0.1068), (0.1076, 0.1111, -0.0362), (-0.3165, -0.2492, -0.2188)),
    (0.1084, -0.0175, -0.0011))
SD3_LATENTS = LatentPreview((
    (-0.0922, -0.0175, 0.0749), (0.0311, 0.0633, 0.0954), (0.1994, 0.0927, 0.0458), (0.0856, 0.0339, 0.0902),
    (0.0587, 0.0272, -0.0496), (-0.0006, 0.1104, 0.0309), (0.0978, 0.0306, 0.0427), (-0.0042, 0.1038, 0.1358),
    (-0.0194, 0.0020, 0.0669), (-0.0488, 0.0130, -0.0268), (0.0922, 0.0988, 0.0951), (-0.0278, 0.0524, -0.0542),
    (0.0332, 0.0456, 0.0895), (-0.0069, -0.0030, -0.0810), (-0.0596, -0.0465, -0.0293), (-0.1448, -0.1463, -0.1189)),
    (0.2394, 0.2135, 0.1925))
FLUX_LATENTS = LatentPreview((
    (-0.0346, 0.0244, 0.0681), (0.0034, 0.0210, 0.0687), (0.0275, -0.0668, -0.0433), (-0.0174, 0.0160, 0.0617),
    (0.0859, 0.0721, 0.0329), (0.0004, 0.0383, 0.0115), (0.0405, 0.0861, 0.0915), (-0.0236, -0.0185, -0.0259),
    (-0.0245, 0.0250, 0.1180), (0.1008, 0.0755, -0.0421), (-0.0515, 0.0201, 0.0011), (0.0428, -0.0012, -0.0036),
    (0.0817, 0.0765, 0.0749), (-0.1264, -0.0522, -0.1103), (-0.0280, -0.0881, -0.0499), (-0.1262, -0.0982, -0.0778)),
    (-0.0329, -0.0718, -0.0851))


# PixArt-alpha and PixArt-Sigma share their call and the components of their tiny builds.
_PIXART_QUIRKS = (
    "Legacy `callback`/`callback_steps` only: a `callback_on_step_end` is swallowed by `**kwargs` and "
    "never called, without an error; `negative_prompt` (default `\"\"`); `guidance_scale`. Pass "
    "`use_resolution_binning=False`: binning picks its aspect-ratio table from "
    "`transformer.config.sample_size` (128, 64 or 32 only) and raises for these tiny transformers. "
    "`clean_caption=True` by default wants bs4 and ftfy (without them it warns and goes on). VAE x1 "
    "(diffusers' default `AutoencoderKL()`), patch 2, but `check_inputs` wants a multiple of 8."
)

_FAMILIES = (
    Family(
        "sd", "StableDiffusionPipeline", partial(build_pipeline, "tiny"), 24, loop=StableDiffusionLoop,
        preview=SD1_LATENTS,
        quirks="The built-in `tiny` model. `callback_on_step_end`; `negative_prompt`; `guidance_scale`. VAE x8, "
               "grid 8. Smallest 24: at 16 a UNet GroupNorm gets one value per group when the batch is a single "
               "image (no CFG; with CFG 16 works).",
    ),
    Family(
        "sdxl", "StableDiffusionXLPipeline", tiny_builds.build_sdxl, 8, loop=StableDiffusionXLLoop,
        builtin="tiny-sdxl", preview=SDXL_LATENTS,
        quirks="`callback_on_step_end`; `negative_prompt` (and `negative_prompt_2`); `guidance_scale`. VAE x2 "
               "(two blocks); `check_inputs` wants a multiple of 8. Built with `add_watermarker=False` (no "
               "invisible-watermark package).",
    ),
    Family(
        "sd3", "StableDiffusion3Pipeline", tiny_builds.build_sd3, 1, loop=StableDiffusion3Loop, builtin="tiny-sd3",
        preview=SD3_LATENTS,
        quirks="`callback_on_step_end`; `negative_prompt` (`_2`, `_3`); `guidance_scale`; `max_sequence_length` "
               "for T5. VAE x1 (one block), patch 1: grid 1, and a 1x1 image works.",
    ),
    Family(
        "flux", "FluxPipeline", tiny_builds.build_flux, 2, loop=FluxLoop, builtin="tiny-flux", preview=FLUX_LATENTS,
        quirks="Built with `guidance_embeds=True`. `callback_on_step_end`; `negative_prompt` only counts with "
               "`true_cfg_scale > 1` (real CFG, a second pass); `guidance_scale` is the distilled guidance fed to "
               "the transformer's guidance embedding, not CFG. VAE x1, latents packed 2x2: grid 2.",
    ),
    Family(
        "pixart-alpha", "PixArtAlphaPipeline", tiny_builds.build_pixart_alpha, 8, loop=PixArtAlphaLoop,
        preview=SD1_LATENTS,
        quirks=_PIXART_QUIRKS,
    ),
    Family(
        "pixart-sigma", "PixArtSigmaPipeline", tiny_builds.build_pixart_sigma, 8, loop=PixArtSigmaLoop,
        preview=SDXL_LATENTS,
        quirks=_PIXART_QUIRKS,
    ),
    Family(
        "sana", "SanaPipeline", tiny_builds.build_sana, 32, loop=SanaLoop,
        quirks="`callback_on_step_end`; `negative_prompt`; `guidance_scale`; pass `use_resolution_binning=False` "
               "(else the size snaps to a 1024-pixel aspect-ratio bin and the image is resized back: slow). "
               "`complex_human_instruction` defaults to a long instruction put before the prompt (kept, as `__call__` "
               "keeps it: the step loop reads the default from the call's signature). DC-AE x2, patch 1, but "
               "`check_inputs` wants a multiple of 32.",
    ),
    Family(
        "lumina2", "Lumina2Pipeline", tiny_builds.build_lumina2, 16, loop=Lumina2Loop, preview=FLUX_LATENTS,
        quirks="`callback_on_step_end`; `negative_prompt`; `guidance_scale` (with `cfg_trunc_ratio`, "
               "`cfg_normalization`); `system_prompt`. The pipeline hard-codes `vae_scale_factor = 8` (with patch "
               "2: grid 16), so the test's one-block VAE (x1) would give an image 8 times too small: this VAE has "
               "four blocks (x8).",
    ),
    Family(
        "cogview4", "CogView4Pipeline", tiny_builds.build_cogview4, 16, loop=CogView4Loop,
        quirks="`callback_on_step_end`; `negative_prompt`; `guidance_scale`. VAE x2, patch 2, but `check_inputs` "
               "wants a multiple of 16. The real tokenizer is GLM-4's (remote code); this one is a byte-level BPE "
               "in `PreTrainedTokenizerFast` (saved and loaded back as transformers 5's `TokenizersBackend`) that, "
               "like GLM-4's, starts every text with `[gMASK]<sop>`; the text encoder is `GlmModel`, as annotated.",
    ),
    Family(
        "qwen-image", "QwenImagePipeline", tiny_builds.build_qwen_image, 8, loop=QwenImageLoop,
        quirks="`callback_on_step_end`; `negative_prompt` only counts with `true_cfg_scale > 1` (default 4.0: real "
               "CFG, two passes, but only when a negative prompt is given); `guidance_scale` is only for "
               "guidance-distilled transformers (this one has `guidance_embeds=False`: leave it `None`). VAE x4 "
               "(2 ** `len(temperal_downsample)`), latents packed 2x2: grid 8. The test's VAE (`base_dim=24`) "
               "would save 16 MB: this one has `base_dim=8`. The text encoder's vocabulary is the tokenizer's "
               "(bytes plus Qwen's chat and vision tokens) instead of 152064 entries.",
    ),
    Family(
        "hunyuan-dit", "HunyuanDiTPipeline", tiny_builds.build_hunyuan_dit, 16, loop=HunyuanDiTLoop,
        preview=SDXL_LATENTS,
        quirks="`callback_on_step_end`; `negative_prompt`; `guidance_scale` (and `guidance_rescale`); pass "
               "`use_resolution_binning=False` (else sizes not in its table map to about 1024 pixels). The "
               "pipeline sizes its rotary embedding for latents of size / 8 / patch whatever the VAE, so with the "
               "test's x1 VAE (`AutoencoderKL()`) most sizes fail or come out wrong: this VAE has four blocks "
               "(x8). Patch 2: grid 16.",
    ),
    Family(
        "kandinsky3", "Kandinsky3Pipeline", tiny_builds.build_kandinsky3, 64, rounds_to=64, loop=Kandinsky3Loop,
        quirks="`callback_on_step_end` (legacy `callback` through `**kwargs`, deprecated); `negative_prompt`; "
               "`guidance_scale`. The pipeline rounds the size up to a multiple of 64 and makes latents of that "
               "size / 8 whatever the MoVQ, so the test's two-block MoVQ (x2) gives the right size at 16 only: this "
               "MoVQ has four blocks (x8), as the real one. Grid 64 (MoVQ x8, then 8 again for its latents); other "
               "sizes come out rounded up to the next multiple of 64.",
    ),
    Family(
        "wuerstchen", "WuerstchenCombinedPipeline", tiny_builds.build_wuerstchen, 128, rounds_to=128,
        loop=WuerstchenLoop,
        quirks="Prior and decoder in one directory. `callback_on_step_end` for the decoder and "
               "`prior_callback_on_step_end` for the prior; `negative_prompt`; `prior_guidance_scale` and "
               "`decoder_guidance_scale` (no `guidance_scale`); steps are `prior_num_inference_steps` (default 60) "
               "and `num_inference_steps` (decoder). The image is int(ceil(size / 42.67) * 10.67) * 4 pixels "
               "(prior `resolution_multiple`, decoder `latent_dim_scale`, Paella VQ x4): exactly the size for "
               "multiples of 128 only (96 gives 128, 64 fails). The test's decoder (`c_hidden=[320]`) and VQ model "
               "(`embed_dim=384`) would save about 50 MB: these are 32 wide. Diffusers 0.42 saves the Wuerstchen "
               "models in `model_index.json` under a library it cannot load them from: they are declared by "
               "module path instead (`tiny_builds._declare_own_modules`).",
    ),
    Family(
        "instruct-pix2pix", "StableDiffusionInstructPix2PixPipeline", tiny_builds.build_instruct_pix2pix, 24,
        edit=True, loop=InstructPix2PixLoop, preview=SD1_LATENTS,
        quirks="An edit model: `image` and the instruction as `prompt`; `image_guidance_scale` beside "
               "`guidance_scale`. The `tiny` SD 1.x with a UNet that takes the image's latents beside the noisy "
               "ones (8 channels in), as in diffusers' own test; its grid and smallest size are `tiny`'s.",
    ),
    Family(
        "wan", "WanPipeline", tiny_builds.build_wan, 16, builtin="tiny-wan", video=Video(16, wan_grid),
        quirks="Text-to-video (Wan 2.1). `callback_on_step_end`; `negative_prompt`; `guidance_scale` (and "
               "`guidance_scale_2` for Wan 2.2's second transformer); `num_frames` (default 81) is rounded "
               "to 4k+1 with only a warning (the worker refuses counts off the grid); "
               "`output_type=\"np\"` gives frames in [0, 1]. VAE x8 in space and x4 in time, patch (1, 2, 2): "
               "grid 16. The rotary table of `rope_max_seq_len` rows bounds latent frames and patches per side "
               "(the tiny build's 32: 125 frames, 512 pixels). The text encoder is a UMT5 of d_model 32 with the "
               "in-memory T5 tokenizer.",
    ),
    Family(
        "wan-i2v", "WanImageToVideoPipeline", tiny_builds.build_wan_i2v, 16, builtin="tiny-wan-i2v",
        video=Video(16, wan_grid),
        quirks="Image-to-video (Wan 2.1): `wan`'s call plus `image` (required; resized to the video's size, the "
               "first frame) and optional `last_image`. The image also goes through a CLIP vision encoder "
               "(`image_encoder`, `image_processor`) whose embedding the transformer takes (`image_dim`); its "
               "latents and mask join the noisy latents (36 channels in). Diffusers' test config gives the "
               "image tokens no key and value projections of their own; the tiny build has them "
               "(`added_kv_proj_dim`), as Wan 2.1's image-to-video checkpoints do. Its `prompt_clean` calls `ftfy` "
               "without checking it is installed (`wan`'s checks): the runner needs `ftfy`. The tiny build's "
               "image processor is `CLIPImageProcessorPil` by name (the one `CLIPImageProcessor` falls back "
               "to without torchvision), so it saves the same everywhere.",
    ),
    Family(
        "ltx", "LTXPipeline", tiny_builds.build_ltx, 32, video=Video(25, ltx_grid),
        quirks="Text-to-video (LTX-Video 0.9). `callback_on_step_end`; `negative_prompt`; `guidance_scale` (default "
               "3); `num_frames` (default 161) rounds down to 8k+1 with the real VAE (4k+1 with the tiny build's, "
               "whose VAE compresses time 4x); `frame_rate` (default 25) conditions the transformer's rotary "
               "embedding: the runner leaves it at 25, the fps its checkpoints are trained for. `check_inputs` "
               "wants multiples of 32 whatever the VAE (the tiny build's is x4, patch 1). Diffusers' test VAE has "
               "a decoder of the real model's width (about 900 MB saved, and videos twice the size asked for): "
               "this decoder mirrors the 8-wide encoder.",
    ),
)

FAMILIES: dict[str, Family] = {family.name: family for family in _FAMILIES}
# The families whose pipeline makes an image from text alone.
TEXT_TO_IMAGE: tuple[str, ...] = tuple(
    name for name, family in FAMILIES.items() if not family.edit and family.video is None
)
# The families whose pipeline makes videos.
VIDEO: tuple[str, ...] = tuple(name for name, family in FAMILIES.items() if family.video is not None)
_BY_PIPELINE_CLASS = {family.pipeline_class: family for family in _FAMILIES}


def family_of(pipeline: DiffusionPipeline) -> Family | None:
    """The family of a loaded pipeline, by the exact name of its class; None for one not declared here."""
    return _BY_PIPELINE_CLASS.get(type(pipeline).__name__)


def latent_preview(pipeline: DiffusionPipeline) -> LatentPreview | None:
    """The preview map of a loaded pipeline's family; None where it declares none."""
    family = family_of(pipeline)
    return family.preview if family is not None else None


def build_family(name: str, directory: Path) -> Path:
    """Builds the named family's tiny pipeline and saves it to ``directory`` in diffusers format, atomically."""
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; choose from {sorted(FAMILIES)}")
    return save_pipeline_atomically(FAMILIES[name].build, directory, f"model family {name}")
