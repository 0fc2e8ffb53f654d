"""PixArt-alpha: PixArt-Sigma's loop (``pixart_sigma.loop``) where ``PixArtAlphaPipeline.__call__``
differs in three ways: a 1024-pixel model (``sample_size`` 128) is conditioned on each image's
resolution and aspect ratio (kept with its prompt's embeddings: its cache key has the size); the
scheduler begins at index 0; and a single step returns the step's predicted original sample instead
of the previous sample."""

from __future__ import annotations

from typing import Any

import torch

from runner_service.denoising.loop import (
    Sequence,
    SequenceSpec,
)
from runner_service.denoising.prompt_cache import Embeddings, PromptCache
from runner_service.families.pixart_sigma.loop import PixArtSigmaLoop


class PixArtAlphaLoop(PixArtSigmaLoop):
    """PixArt-alpha: Sigma's loop with the resolution micro-conditions of a 1024-pixel model, the
    scheduler begun at index 0, and a single step's predicted original sample."""

    def start(self, spec: SequenceSpec, cache: PromptCache, version: str) -> Sequence:
        sequence = super().start(spec, cache, version)
        if sequence.total == 1:
            sequence.scheduler = _OriginalSample(sequence.scheduler)
        return sequence

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        conditioning = super()._conditioning(spec, guided)
        if self.pipeline.transformer.config.sample_size != 128:
            return conditioning
        rows, dtype = conditioning["encoder_hidden_states"].shape[0], conditioning["encoder_hidden_states"].dtype
        resolution = torch.tensor([spec.height, spec.width]).repeat(rows, 1)
        aspect_ratio = torch.tensor([float(spec.height / spec.width)]).repeat(rows, 1)
        return {**conditioning, "resolution": resolution.to(dtype=dtype, device=self.device),
                "aspect_ratio": aspect_ratio.to(dtype=dtype, device=self.device)}

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        schedule = super()._schedule(spec, scheduler, generator, dtype)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        return schedule


class _OriginalSample:
    """A one-step alpha sequence's scheduler: its step gives the predicted original sample (the
    step's second output, where it has one), as ``__call__`` takes it when ``num_inference_steps``
    is 1."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def __getattr__(self, name: str) -> Any:  # scale_model_input and the rest: the scheduler's own
        return getattr(self.scheduler, name)

    def step(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        output: tuple[torch.Tensor, ...] = self.scheduler.step(*args, **kwargs)
        # A step that gives no original sample (DPM-Solver's, the released checkpoints') fails in
        # __call__ at one step (an IndexError); here it is the step's sample, as at any other count,
        # so that the load's one-step canary keeps the loop for the model's other requests.
        return output[1:2] if len(output) > 1 else output
