"""Imported by the runner's zygote (``harness.processes.ZYGOTE_IMPORTS``), after the runner's own
modules: loads the built-in ``tiny`` once and reads its capabilities, so the process-wide caches a
runner's first load fills are filled before the zygote forks, not again in every runner it starts
(about 0.5 s of CPU each on the 2-core machine): transformers' checkpoint key conversions (about
1,100 regular expressions, compiled at its first model load), the runner's scheduler memo for the
Stable Diffusion scheduler config (``runner_service.scheduler_memo``: the two KDPM2 samplers'
builds, 0.15 s each, and the dry runs) and the pipeline classes' call sources.

What a load *checks* still runs in every runner: its canary and its own capabilities. Nothing
generates here: a pipeline call starts the tokenizer's threads, and a zygote must stay one thread
to fork (``harness.zygote``), so tqdm's monitor thread, which the load starts, is ended too.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from tqdm._monitor import TMonitor

from runner_service.models.catalog import ensure_builtin
from runner_service.pipeline_adapter import adapt


def warm_up() -> None:
    with contextlib.redirect_stdout(sys.stderr):  # the zygote's stdout says when it is ready
        pipeline: DiffusionPipeline = DiffusionPipeline.from_pretrained(ensure_builtin("tiny"))
        adapt(pipeline)
    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):  # the class whose bars started it makes a new one at need
            thread.exit()
            thread.tqdm_cls.monitor = None


warm_up()
