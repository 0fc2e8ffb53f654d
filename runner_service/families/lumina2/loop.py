"""Lumina-Image 2.0: a flow-matching transformer over Gemma's per-token embeddings with their
attention masks, the prompt behind the pipeline's system prompt.

How it maps onto ``__call__``: ``encode_prompt`` pads every prompt to ``max_sequence_length``
tokens and returns its mask, so rows of any prompts stack as they are; the transformer joins each
row's effective caption to its image tokens and masks the rest where lengths differ in a batch.
``__call__`` runs the positive and negative prompts as two transformer calls: here they are two
rows of one call. It feeds the transformer ``1 - t / num_train_timesteps``, steps the scheduler
on the negated prediction (negated here right after the call: the guidance and its
normalisation are unchanged by the sign), and shifts the schedule by a ``mu`` it computes from
``latents.shape[1]`` (the channels, not the tokens: followed as written). Its guidance stops
once the step's share of the steps passes ``cfg_trunc_ratio`` (each sequence by its own step)
and is renormalised to the positive prediction's norm with ``cfg_normalization``; both as the
runner calls it, with the call's defaults. Decoding is SD3's (scaling and shift factors).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.lumina2.pipeline_lumina2 import calculate_shift, retrieve_timesteps
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.denoising.loop import Sequence, SequenceSpec, masked_prompts
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.families.sd3.loop import StableDiffusion3Loop


class Lumina2Loop(StableDiffusion3Loop):
    """Lumina 2: masked Gemma embeddings, CFG truncation and normalisation, SD3's decoding."""

    # Text to image only: diffusers has no image-to-image or inpainting pipeline of this family
    # (SD3's image tasks are not inherited).
    tasks = frozenset({"TEXT_TO_IMAGE"})

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device) -> None:
        super().__init__(pipeline, device)
        parameters = inspect.signature(pipeline.__call__).parameters
        self._truncation = float(parameters["cfg_trunc_ratio"].default)
        self._normalization = bool(parameters["cfg_normalization"].default)

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        return masked_prompts(self.pipeline, spec, guided, self.device, self._encoding)

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pipeline = self.pipeline
        latents = pipeline.prepare_latents(1, pipeline.transformer.config.in_channels, spec.height, spec.width,
                                           dtype, self.device, generator)
        config = scheduler.config
        sigmas = np.linspace(1.0, 1 / spec.steps, spec.steps).tolist()
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return timesteps, latents

    def _guided(self, sequence: Sequence, uncond: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """``__call__``'s guidance at the sequence's step: the positive prediction alone once
        truncated, else CFG, renormalised along the last axis to the positive prediction's norm."""
        if (sequence.done + 1) / sequence.total > self._truncation:
            return text
        guided = uncond + self._cfg_scale(sequence.spec) * (text - uncond)
        if self._normalization:
            guided = guided * (torch.norm(text, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True))
        return guided

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        pipeline = self.pipeline
        predicted: torch.Tensor = pipeline.transformer(
            hidden_states=inputs, timestep=1 - times / pipeline.scheduler.config.num_train_timesteps,
            return_dict=False, attention_kwargs=None, **conditioning)[0]
        return -predicted
