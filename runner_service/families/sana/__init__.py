"""Sana: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.record import Family
from runner_service.families.sana.loop import SanaLoop
from runner_service.families.sana.tiny import build_sana

FAMILY = Family(
    "sana", "SanaPipeline", build_sana, 32, loop=SanaLoop,
    quirks="`callback_on_step_end`; `negative_prompt`; `guidance_scale`; pass `use_resolution_binning=False` "
           "(else the size snaps to a 1024-pixel aspect-ratio bin and the image is resized back: slow). "
           "`complex_human_instruction` defaults to a long instruction put before the prompt (kept, as `__call__` "
           "keeps it: the step loop reads the default from the call's signature). DC-AE x2, patch 1, but "
           "`check_inputs` wants a multiple of 32.",
)
