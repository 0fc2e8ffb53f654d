"""Kandinsky 3: the family's record; its tiny build is ``tiny.py``, its step-level loop ``loop.py``."""

from __future__ import annotations

from runner_service.families.kandinsky3.loop import Kandinsky3Loop
from runner_service.families.kandinsky3.tiny import build_kandinsky3
from runner_service.families.record import Family

FAMILY = Family(
    "kandinsky3", "Kandinsky3Pipeline", build_kandinsky3, 64, rounds_to=64, loop=Kandinsky3Loop,
    quirks="`callback_on_step_end` (legacy `callback` through `**kwargs`, deprecated); `negative_prompt`; "
           "`guidance_scale`. The pipeline rounds the size up to a multiple of 64 and makes latents of that "
           "size / 8 whatever the MoVQ, so the test's two-block MoVQ (x2) gives the right size at 16 only: this "
           "MoVQ has four blocks (x8), as the real one. Grid 64 (MoVQ x8, then 8 again for its latents); other "
           "sizes come out rounded up to the next multiple of 64.",
    # Its call's "pt" output is the MoVQ's raw output in [-1, 1]: only "np" and "pil" are mapped to [0, 1]
    # (diffusers 0.42, ``Kandinsky3Pipeline.__call__``). Its image-to-image pipeline postprocesses as
    # the others do, but shares the record.
    tensor_output=False,
)
