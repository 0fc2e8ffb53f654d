"""CogView4: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.cogview4.loop import CogView4Loop
from runner_service.families.cogview4.tiny import build_cogview4
from runner_service.families.record import Family

FAMILY = Family(
    "cogview4", "CogView4Pipeline", build_cogview4, 16, loop=CogView4Loop,
    quirks="`callback_on_step_end`; `negative_prompt`; `guidance_scale`. VAE x2, patch 2, but `check_inputs` "
           "wants a multiple of 16. The real tokenizer is GLM-4's (remote code); this one is a byte-level BPE "
           "in `PreTrainedTokenizerFast` (saved and loaded back as transformers 5's `TokenizersBackend`) that, "
           "like GLM-4's, starts every text with `[gMASK]<sop>`; the text encoder is `GlmModel`, as annotated.",
)
