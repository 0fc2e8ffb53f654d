"""Qwen-Image: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.qwen_image.loop import QwenImageLoop
from runner_service.families.qwen_image.tiny import build_qwen_image
from runner_service.families.record import CfgBranches, CfgLayout, Family

FAMILY = Family(
    "qwen-image", "QwenImagePipeline", build_qwen_image, 8, loop=QwenImageLoop,
    quirks="`callback_on_step_end`; `negative_prompt` only counts with `true_cfg_scale > 1` (default 4.0: real "
           "CFG, two passes, but only when a negative prompt is given); `guidance_scale` is only for "
           "guidance-distilled transformers (this one has `guidance_embeds=False`: leave it `None`). VAE x4 "
           "(2 ** `len(temperal_downsample)`), latents packed 2x2: grid 8. The test's VAE (`base_dim=24`) "
           "would save 16 MB: this one has `base_dim=8`. The text encoder's vocabulary is the tokenizer's "
           "(bytes plus Qwen's chat and vision tokens) instead of 152064 entries.",
    # pipeline_qwenimage.py: the "cond" then the "uncond" call (true_cfg_scale > 1 and a negative prompt)
    cfg=CfgBranches(CfgLayout.CALLS, "true_cfg_scale"),
)
