"""Würstchen: a prior (text to image embeddings) then a decoder (embeddings to Paella VQ latents),
as two phases of one sequence.

``WuerstchenCombinedPipeline.__call__`` runs ``WuerstchenPriorPipeline.__call__`` (its
``prior_pipe``) for all its images, then ``WuerstchenDecoderPipeline.__call__`` (``decoder_pipe``)
on the image embeddings. Here a sequence runs its prior steps, then its decoder steps: its
timesteps are both phases' (``total`` is their sum, the step count ``on_step`` reports across the
stages), and in a step the sequences in their prior phase share the prior's calls, those in their
decoder phase the decoder's (``_step_group`` splits each size group by phase). As the pipeline
adapter calls it, the request's guidance is the prior's (``prior_guidance_scale``), both phases
run the request's steps (``prior_num_inference_steps = num_inference_steps``) and the decoder is
unguided (``decoder_guidance_scale`` at its default, 0).

How each phase maps onto its ``__call__``:

- The prior: ``encode_prompt`` (CLIP, every prompt padded to the tokenizer's length), latents of
  ``ceil(size / resolution_multiple)`` from ``prepare_latents``, ``DDPMWuerstchenScheduler`` steps
  over ``timesteps[:-1]``, each passed to the prior and the scheduler as ``ratio`` (one value per
  row, in the latents' dtype), guidance ``lerp(uncond, text, scale)`` (the base's formula; ``__call__``
  stacks the text row first, here the negative one is, as the base chunks them). After its last
  step the latents become the image embeddings (``* latent_mean - latent_std``).
- The decoder: ``encode_prompt`` of the prompt (its own CLIP), latents of the embeddings' size
  times ``latent_dim_scale`` from ``prepare_latents``, drawn by the image's generator after the
  prior's steps as ``__call__`` draws them, its own scheduler and ratios, the embeddings as
  ``effnet``; decoding ``vqgan.decode(scale_factor * latents)`` clamped.

The loop's ``pipeline`` is the prior's (the base's ``start`` encodes, schedules and draws with it);
the decoder's is ``decoder``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from math import ceil
from typing import Any

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.acceleration.step_cache import StepCache
from runner_service.denoising.loop import (
    DenoisingLoop,
    Failures,
    Sequence,
    SequencesFailed,
    SequenceSpec,
    failing_alone,
    group_failures,
)
from runner_service.denoising.prompt_cache import Embeddings, PromptCache
from runner_service.denoising.size_turns import SizeTurns
from runner_service.device_output import channels_last


@dataclass(eq=False)
class TwoPhaseSequence(Sequence):
    """A sequence whose timesteps are the prior's, then the decoder's; the decoder's scheduler and
    text embeddings wait for its phase."""

    decoder_scheduler: Any = None
    decoder_text: Embeddings = field(default_factory=dict)

    @property
    def in_prior(self) -> bool:
        return self.scheduler is not self.decoder_scheduler


class WuerstchenLoop(DenoisingLoop):
    """Würstchen: the prior's steps, then the decoder's, for each sequence; Paella VQ decoding."""

    denoiser = "prior_prior"  # the combined pipeline's name for the prior

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device) -> None:
        super().__init__(pipeline.prior_pipe, device)
        self.decoder = pipeline.decoder_pipe

    def start(self, spec: SequenceSpec, cache: PromptCache, version: str) -> Sequence:
        prior = super().start(spec, cache, version)
        decoder = self.decoder
        scheduler = type(decoder.scheduler).from_config(decoder.scheduler.config)
        scheduler.set_timesteps(spec.steps, device=self.device)
        text = cache.get(version, (spec.conditioning_key, "decoder", spec.prompt), lambda: self._decoder_text(spec))
        timesteps = torch.cat([prior.timesteps, _ratios(scheduler, decoder.decoder.dtype)])
        return TwoPhaseSequence(**{**vars(prior), "timesteps": timesteps}, decoder_scheduler=scheduler,
                                decoder_text=text)

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        positive, negative = self.pipeline.encode_prompt(
            device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=guided, prompt=[spec.prompt],
            negative_prompt=[spec.negative_prompt])
        return {"c": torch.cat([negative, positive]) if guided else positive}

    def _decoder_text(self, spec: SequenceSpec) -> Embeddings:
        """The decoder's text embeddings (unguided: the prompt's only)."""
        text, _ = self.decoder.encode_prompt([spec.prompt], self.device, 1, False)
        return {"clip": text}

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pipeline = self.pipeline
        scheduler.set_timesteps(spec.steps, device=self.device)
        multiple = pipeline.config["resolution_multiple"]
        shape = (1, pipeline.prior.config.c_in, ceil(spec.height / multiple), ceil(spec.width / multiple))
        latents: torch.Tensor = pipeline.prepare_latents(shape, dtype, self.device, generator, None, scheduler)
        return _ratios(scheduler, dtype), latents

    def _step_arguments(self, generator: torch.Generator) -> dict[str, Any]:
        return {"generator": generator}

    def step(self, sequences: list[Sequence], cache: StepCache | None = None, turns: SizeTurns | None = None) -> None:
        """One step of every sequence (the prior's and the decoder's calls apart); a sequence whose
        prior steps are done then starts its decoder phase."""
        failures: Failures = {}
        try:
            super().step(sequences, cache, turns)
        except SequencesFailed as failed:
            failures = failed.failures
        for sequence in map(_two_phase, sequences):
            if sequence.in_prior and sequence.done == sequence.spec.steps and sequence not in failures:
                with failing_alone(sequence, failures):
                    self._start_decoder(sequence)
        if failures:
            raise SequencesFailed(failures)

    def _step_group(self, group: list[Sequence], cache: StepCache | None) -> Failures:
        phases: dict[bool, list[Sequence]] = {}
        for sequence in group:
            phases.setdefault(_two_phase(sequence).in_prior, []).append(sequence)
        failures: Failures = {}
        for phase in phases.values():
            failures.update(group_failures(phase, functools.partial(super()._step_group, phase, cache)))
        return failures

    def _start_decoder(self, sequence: TwoPhaseSequence) -> None:
        """The decoder ``__call__``'s start, on the prior's image embeddings."""
        decoder = self.decoder
        config = self.pipeline.config
        embeddings = sequence.latents * config["latent_mean"] - config["latent_std"]
        scale = decoder.config["latent_dim_scale"]
        shape = (1, 4, int(embeddings.size(2) * scale), int(embeddings.size(3) * scale))
        sequence.latents = decoder.prepare_latents(shape, decoder.decoder.dtype, self.device,
                                                   sequence.step_arguments["generator"], None,
                                                   sequence.decoder_scheduler)
        sequence.scheduler = sequence.decoder_scheduler
        sequence.conditioning = {"effnet": embeddings, **sequence.decoder_text}
        sequence.guided = False
        sequence.key = next(self._keys)  # other rows, of another denoiser, in the step cache

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        # A call's sequences share a phase: the decoder's conditioning has the image embeddings.
        if "effnet" in conditioning:
            decoded: torch.Tensor = self.decoder.decoder(inputs, r=times, **conditioning)
            return decoded
        prior: torch.Tensor = self.pipeline.prior(inputs, r=times, **conditioning)
        return prior

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        vqgan = self.decoder.vqgan
        latents = vqgan.config.scale_factor * torch.cat([s.latents for s in sequences])
        images = vqgan.decode(latents).sample.clamp(0, 1)
        return channels_last(images)


def _ratios(scheduler: Any, dtype: torch.dtype) -> torch.Tensor:
    """A phase's timesteps as ``__call__`` passes them: all but the last, each one value (a row's
    ``ratio``) in the latents' dtype."""
    ratios: torch.Tensor = scheduler.timesteps[:-1].to(dtype).unsqueeze(1)
    return ratios


def _two_phase(sequence: Sequence) -> TwoPhaseSequence:
    assert isinstance(sequence, TwoPhaseSequence), "the Würstchen loop starts its own sequences"
    return sequence
