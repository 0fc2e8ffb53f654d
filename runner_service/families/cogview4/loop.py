"""CogView4: GLM prompts of their own lengths, one transformer call per prompt length.

``CogView4Pipeline._get_glm_embeds`` pads each prompt on the left with pad tokens to a multiple of
16 and runs the GLM encoder without an attention mask, so the pad tokens are part of the prompt's
embeddings: a prompt padded further would not be the prompt ``__call__`` encodes. Nor can a call
mask padded text out: the transformer's ``attention_mask`` becomes a 0/1 float added to the
attention scores (``CogView4AttnProcessor``), which weighs padded keys down instead of removing
them. So the rows of a step (each sequence's negative and positive, run by ``__call__`` as two
transformer calls) share a call where their latents' size and their prompts' length agree: one
call per length within each size group. Each row has ``__call__``'s micro-conditions
(``original_size`` and ``target_size`` the image's size, ``crop_coords`` zero); the schedule is
``__call__``'s (integer timesteps from ``num_train_timesteps`` down to 1 as sigmas, CogView4's
``calculate_shift`` of the image's latent tokens as ``mu``); the latents are float32 whatever the
model's dtype, as ``__call__`` draws them, and cast to the transformer's for its input. Decoding
divides by the VAE's scaling factor (no shift).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.cogview4.pipeline_cogview4 import calculate_shift, retrieve_timesteps
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.acceleration.step_cache import StepCache
from runner_service.denoising.loop import (
    DenoisingLoop,
    Failures,
    Sequence,
    SequenceSpec,
    cached_rows,
    failing_alone,
    max_sequence_length,
)
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.device_output import channels_last

BRANCHES = {True: ("negative", "positive"), False: ("positive",)}  # a sequence's rows, by whether it is guided


class CogView4Loop(DenoisingLoop):
    """CogView4: a sequence's conditioning is its ``negative`` and ``positive`` GLM embeddings, each
    of its own length; a step calls the transformer once per size and prompt length."""

    denoiser = "transformer"

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device) -> None:
        super().__init__(pipeline, device)
        self._encoding = max_sequence_length(pipeline)  # the prompts' encoding argument, as __call__'s

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        positive, negative = self.pipeline.encode_prompt(
            [spec.prompt], [spec.negative_prompt], guided, num_images_per_prompt=1, device=self.device,
            **self._encoding)
        return {"positive": positive, "negative": negative} if guided else {"positive": positive}

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pipeline, config = self.pipeline, scheduler.config
        latents = pipeline.prepare_latents(1, pipeline.transformer.config.in_channels, spec.height, spec.width,
                                           torch.float32, self.device, generator)
        factor = pipeline.vae_scale_factor
        image_seq_len = (spec.height // factor) * (spec.width // factor) // pipeline.transformer.config.patch_size ** 2
        timesteps = np.linspace(config.num_train_timesteps, 1.0, spec.steps).astype(np.int64).astype(np.float32)
        mu = calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("base_shift", 0.25),
                             config.get("max_shift", 0.75))
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, self.device, timesteps.tolist(),
                                          (timesteps / config.num_train_timesteps).tolist(), mu=mu)
        return timesteps, latents

    def _step_group(self, group: list[Sequence], cache: StepCache | None) -> Failures:
        calls: dict[int, list[tuple[Sequence, str]]] = {}
        for sequence in group:
            for branch in BRANCHES[sequence.guided]:
                calls.setdefault(sequence.conditioning[branch].shape[1], []).append((sequence, branch))
        predicted: dict[tuple[int, str], torch.Tensor] = {}
        for rows in calls.values():
            keys = [(sequence.key, branch) for sequence, branch in rows]
            with contextlib.nullcontext() if cache is None else cached_rows(cache, rows):
                predictions = self._predict(torch.cat([sequence.latents for sequence, _ in rows]),
                                            torch.stack([sequence.timesteps[sequence.done] for sequence, _ in rows]),
                                            self._row_conditioning(rows))
            predicted.update(zip(keys, predictions.chunk(len(rows)), strict=True))
        failures: Failures = {}
        for sequence in group:
            with failing_alone(sequence, failures):
                own = [predicted[sequence.key, branch] for branch in BRANCHES[sequence.guided]]
                prediction = self._guided(sequence, *own) if sequence.guided else own[0]
                t = sequence.timesteps[sequence.done]
                sequence.latents = sequence.scheduler.step(prediction, t, sequence.latents, return_dict=False)[0]
                sequence.done += 1
        return failures

    def _row_conditioning(self, rows: list[tuple[Sequence, str]]) -> Embeddings:
        """One call's text embeddings (of one length) and each row's micro-conditions, as ``__call__``'s."""
        embeds = torch.cat([sequence.conditioning[branch] for sequence, branch in rows])
        sizes = torch.tensor([[sequence.spec.height, sequence.spec.width] for sequence, _ in rows],
                             dtype=embeds.dtype, device=self.device)
        return {"encoder_hidden_states": embeds, "original_size": sizes, "target_size": sizes,
                "crop_coords": torch.zeros_like(sizes)}

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        transformer = self.pipeline.transformer
        predicted: torch.Tensor = transformer(hidden_states=inputs.to(transformer.dtype), timestep=times,
                                              attention_kwargs=None, return_dict=False, **conditioning)[0]
        return predicted

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        pipeline = self.pipeline
        latents = torch.cat([s.latents for s in sequences]).to(pipeline.vae.dtype) / pipeline.vae.config.scaling_factor
        image = pipeline.vae.decode(latents, return_dict=False)[0]
        return channels_last(pipeline.image_processor.postprocess(image, output_type="pt"))
