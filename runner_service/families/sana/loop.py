"""Sana: a linear-attention DiT over Gemma's per-token embeddings with their attention mask, a
flow-matching scheduler, a DC-AE decoder; PixArt-Sigma's loop (``pixart``) where ``__call__`` is
the same.

How it maps onto ``SanaPipeline.__call__``:

- ``encode_prompt`` with the call's own ``clean_caption`` and ``complex_human_instruction``
  defaults (the runner passes neither: the long instruction goes before the prompt, which is then
  cut to its first and last ``max_sequence_length - 1`` tokens) and the runner's
  ``max_sequence_length``; the negative prompt is encoded without the instruction, to the same
  length, so every row stacks as it is, with its mask.
- ``retrieve_timesteps`` with no shift; the latents are ``prepare_latents``' in float32 whatever
  the model's dtype, and stay float32: the transformer gets them and the embeddings in its own
  dtype, and its prediction back in float32, at ``timestep * timestep_scale``; no
  ``scale_model_input``; the scheduler's step with ``prepare_extra_step_kwargs``' arguments.
- A learned sigma (twice the latent channels out) is cut to its first half, as PixArt's; the
  decoding is PixArt-Sigma's (``vae.decode(latents.to(vae.dtype) / scaling_factor)``).
"""

from __future__ import annotations

from typing import Any

import torch

from runner_service.denoising.loop import Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.families.pixart_sigma.loop import PixArtSigmaLoop


class SanaLoop(PixArtSigmaLoop):
    """Sana: PixArt-Sigma's loop with float32 latents, a scaled timestep and no input scaling."""

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return super()._schedule(spec, scheduler, generator, torch.float32)

    def _scaled(self, sequence: Sequence, model_input: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model_input  # Sana's __call__ never calls scale_model_input

    def _transformed(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        transformer = self.pipeline.transformer
        predicted: torch.Tensor = transformer(
            inputs.to(dtype=transformer.dtype),
            encoder_hidden_states=conditioning["encoder_hidden_states"].to(dtype=transformer.dtype),
            encoder_attention_mask=conditioning["encoder_attention_mask"],
            timestep=times * transformer.config.timestep_scale, return_dict=False, attention_kwargs=None)[0]
        return predicted.float()
