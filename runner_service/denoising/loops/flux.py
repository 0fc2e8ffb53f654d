"""Flux: packed latents with token positions, distilled guidance per row, true CFG as a negative row."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from runner_service.denoising.loops.base import Sequence, SequenceSpec
from runner_service.denoising.loops.sd3 import StableDiffusion3Loop
from runner_service.denoising.prompt_cache import Embeddings, PromptCache


class FluxLoop(StableDiffusion3Loop):
    """Flux: CLIP's pooled and T5's per-token embeddings, latents packed 2x2 into tokens with their
    positions, a flow-matching transformer; SD3's decoding (scaling and shift factors). With a
    guidance embedding (FLUX.1-dev, ``tiny-flux``) the request's guidance_scale is each row's
    ``guidance`` input and true CFG (a second, negative row) is the separate ``true_cfg_scale``;
    without one (the ``shapes`` model) the guidance_scale is ``true_cfg_scale``, as the adapter
    passes it. ``__call__`` runs the negative prompt as a second transformer call: here it is one
    more row of the same call.

    The latents are kept unpacked (1 x C x h x w, as prepare_latents draws them before packing) and
    packed for the transformer only, so its positions follow from their size; the guidance and
    the Euler step are elementwise, the same on either layout.
    """

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device) -> None:
        super().__init__(pipeline, device)
        self._distilled = bool(pipeline.transformer.config.guidance_embeds)

    def start(self, spec: SequenceSpec, cache: PromptCache, version: str) -> Sequence:
        sequence = super().start(spec, cache, version)
        if self._distilled:  # every row's guidance embedding, beside the cached prompts
            rows = 2 if sequence.guided else 1
            guidance = torch.full([rows], spec.guidance, device=self.device, dtype=torch.float32)
            sequence.conditioning = {**sequence.conditioning, "guidance": guidance}
        return sequence

    def _cfg_scale(self, spec: SequenceSpec) -> float:
        return spec.true_cfg if self._distilled else spec.guidance

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        prompts = [spec.negative_prompt, spec.prompt] if guided else [spec.prompt]
        encoded = [self.pipeline.encode_prompt(prompt=[prompt], prompt_2=None, device=self.device,
                                               num_images_per_prompt=1, **self._encoding)
                   for prompt in prompts]
        return {"encoder_hidden_states": torch.cat([embeds for embeds, _, _ in encoded]),
                "pooled_projections": torch.cat([pooled for _, pooled, _ in encoded])}

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pipeline = self.pipeline
        packed, _ = pipeline.prepare_latents(1, pipeline.transformer.config.in_channels // 4, spec.height,
                                             spec.width, dtype, self.device, generator)
        config = scheduler.config
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / spec.steps, spec.steps).tolist()
        # Flux's calculate_shift is SD3's with another default max_shift: each is passed.
        mu = calculate_shift(packed.shape[1], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        latents = pipeline._unpack_latents(packed, spec.height, spec.width, pipeline.vae_scale_factor)
        return timesteps, latents

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        pipeline = self.pipeline
        rows, channels, height, width = inputs.shape
        hidden = conditioning["encoder_hidden_states"]
        # encode_prompt's text ids (zeros, one per token) and prepare_latents' image ids (each token's
        # position): every row has the same, the batch sharing one size.
        text_ids = torch.zeros(hidden.shape[1], 3, device=self.device, dtype=hidden.dtype)
        image_ids = pipeline._prepare_latent_image_ids(rows, height // 2, width // 2, self.device, inputs.dtype)
        predicted = pipeline.transformer(
            hidden_states=pipeline._pack_latents(inputs, rows, channels, height, width),
            timestep=times.to(inputs.dtype) / 1000, guidance=conditioning.get("guidance"),
            pooled_projections=conditioning["pooled_projections"], encoder_hidden_states=hidden,
            # {} as __call__ passes it: compiled blocks then serve both paths with the same kernels.
            txt_ids=text_ids, img_ids=image_ids, joint_attention_kwargs={}, return_dict=False)[0]
        factor = pipeline.vae_scale_factor
        unpacked: torch.Tensor = pipeline._unpack_latents(predicted, height * factor, width * factor, factor)
        return unpacked
