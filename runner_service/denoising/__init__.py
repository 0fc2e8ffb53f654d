"""Step-level batching: the runner owns the denoising loop of families whose loop is standard.

``prompt_cache`` keeps encoded prompts, ``loop`` has what every family's loop shares (each
family's own pieces, encode, start, one step for many sequences, decode, are the ``loop.py`` of its
folder in ``runner_service.families``); ``runner_service.step_engine`` admits requests into the
running batch at step boundaries and hands each its images when its own steps are done.
"""
