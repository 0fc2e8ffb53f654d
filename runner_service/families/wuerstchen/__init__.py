"""Wuerstchen: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.record import Family
from runner_service.families.wuerstchen.loop import WuerstchenLoop
from runner_service.families.wuerstchen.tiny import build_wuerstchen

FAMILY = Family(
    "wuerstchen", "WuerstchenCombinedPipeline", build_wuerstchen, 128, rounds_to=128,
    loop=WuerstchenLoop,
    quirks="Prior and decoder in one directory. `callback_on_step_end` for the decoder and "
           "`prior_callback_on_step_end` for the prior; `negative_prompt`; `prior_guidance_scale` and "
           "`decoder_guidance_scale` (no `guidance_scale`); steps are `prior_num_inference_steps` (default 60) "
           "and `num_inference_steps` (decoder). The image is int(ceil(size / 42.67) * 10.67) * 4 pixels "
           "(prior `resolution_multiple`, decoder `latent_dim_scale`, Paella VQ x4): exactly the size for "
           "multiples of 128 only (96 gives 128, 64 fails). The test's decoder (`c_hidden=[320]`) and VQ model "
           "(`embed_dim=384`) would save about 50 MB: these are 32 wide. Diffusers 0.42 saves the Wuerstchen "
           "models in `model_index.json` under a library it cannot load them from: they are declared by "
           "module path instead (`_declare_own_modules` in `families/wuerstchen/tiny.py`).",
)
