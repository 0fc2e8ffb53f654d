"""PixArt-Sigma: a DiT over T5's per-token embeddings with their attention mask,
predicting a learned sigma beside the noise.

How it maps onto ``PixArtSigmaPipeline.__call__`` (``PixArtSigmaLoop``):

- ``encode_prompt`` with the call's own ``clean_caption`` default (True: it cleans the caption
  where bs4 and ftfy are installed, else lower-cases it, as the call does) and the runner's
  ``max_sequence_length``; every prompt is padded to that length, so its embeddings and mask
  (``encoder_attention_mask``) stack across sequences as they are.
- ``retrieve_timesteps``, then ``prepare_latents`` (scaled by the sequence's own scheduler's
  ``init_noise_sigma``), ``scale_model_input``, the timestep expanded per row, the scheduler's step
  with ``prepare_extra_step_kwargs``' arguments (eta 0, the image's generator).
- The transformer's output has twice the latent channels (the learned sigma): its first half is the
  noise, taken right after the call (the guidance is per channel: the same before or after).
- Decoding: ``vae.decode(latents / scaling_factor)`` and the image processor's ``postprocess``.

PixArt-alpha's loop (``pixart_alpha.loop``) and Sana's build on this one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

from runner_service.denoising.loop import (
    Sequence,
    SequenceSpec,
    _scheduled_by,
    masked_prompts,
    max_sequence_length,
)
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.device_output import channels_last
from runner_service.families.sd.loop import ScaledInputLoop

# Arguments of ``encode_prompt`` that the runner leaves at ``__call__``'s defaults (which may differ
# from ``encode_prompt``'s own): they are read from the call's signature.
_CALL_DEFAULTS = ("clean_caption", "complex_human_instruction")


class PixArtSigmaLoop(ScaledInputLoop):
    """PixArt-Sigma: masked T5 embeddings, a learned-sigma DiT, any diffusers scheduler."""

    denoiser = "transformer"

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device) -> None:
        super().__init__(pipeline, device)
        parameters = inspect.signature(pipeline.__call__).parameters
        self._encoding: dict[str, Any] = {**max_sequence_length(pipeline),
                                          **{name: parameters[name].default
                                             for name in _CALL_DEFAULTS if name in parameters}}
        config = pipeline.transformer.config
        self._learned_sigma = config.out_channels // 2 == config.in_channels

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        return masked_prompts(self.pipeline, spec, guided, self.device, self._encoding)

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pipeline = self.pipeline
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, self.device)
        with _scheduled_by(pipeline, scheduler):
            latents = pipeline.prepare_latents(1, pipeline.transformer.config.in_channels, spec.height, spec.width,
                                               dtype, self.device, generator)
        return timesteps, latents

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        predicted = self._transformed(inputs, times, conditioning)
        return predicted.chunk(2, dim=1)[0] if self._learned_sigma else predicted

    def _transformed(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        """The transformer's output for one call's rows, as ``__call__`` calls it."""
        # Sigma has no micro-conditions; alpha's are rows beside the prompts' where its model takes them.
        micro = {name: conditioning.get(name) for name in ("resolution", "aspect_ratio")}
        predicted: torch.Tensor = self.pipeline.transformer(
            inputs, encoder_hidden_states=conditioning["encoder_hidden_states"],
            encoder_attention_mask=conditioning["encoder_attention_mask"], timestep=times,
            added_cond_kwargs=micro, return_dict=False)[0]
        return predicted

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        pipeline = self.pipeline
        latents = torch.cat([s.latents for s in sequences]).to(pipeline.vae.dtype)
        image = pipeline.vae.decode(latents / pipeline.vae.config.scaling_factor, return_dict=False)[0]
        return channels_last(pipeline.image_processor.postprocess(image, output_type="pt"))
