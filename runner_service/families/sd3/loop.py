"""Stable Diffusion 3: a flow-matching transformer over three text encoders.

Image-to-image follows ``StableDiffusion3Img2ImgPipeline.__call__``: the image preprocessed to the
size, the size's shift, ``retrieve_timesteps`` then ``get_timesteps`` for the strength and
``prepare_latents`` (the image encoded with the sequence's generator, ``scale_noise`` to the first
timestep). Inpainting is left request-level: the tiny build's transformer has too few channels to
inpaint (the canary drops it), so no model here would test it.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from runner_service.denoising.loop import (
    DenoisingLoop,
    ImageSource,
    Inpainting,
    Sequence,
    SequenceSpec,
    max_sequence_length,
)
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.device_output import channels_last


class StableDiffusion3Loop(DenoisingLoop):
    """SD3: three text encoders, pooled projections, a flow-matching transformer whose scheduler
    may shift its sigmas by the image's size."""

    denoiser = "transformer"
    tasks = frozenset({"TEXT_TO_IMAGE", "IMAGE_TO_IMAGE"})

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device) -> None:
        super().__init__(pipeline, device)
        self._encoding = max_sequence_length(pipeline)  # the prompts' encoding argument, as __call__'s

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        positive, negative, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=[spec.prompt], prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=guided, negative_prompt=[spec.negative_prompt], **self._encoding)
        if not guided:
            return {"encoder_hidden_states": positive, "pooled_projections": pooled}
        return {"encoder_hidden_states": torch.cat([negative, positive]),
                "pooled_projections": torch.cat([negative_pooled, pooled])}

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pipeline = self.pipeline
        latents = pipeline.prepare_latents(1, pipeline.transformer.config.in_channels, spec.height, spec.width,
                                           dtype, self.device, generator)
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, self.device, **self._shift(spec, scheduler))
        return timesteps, latents

    def _shift(self, spec: SequenceSpec, scheduler: Any) -> dict[str, Any]:
        """``mu``, where the scheduler shifts its sigmas by the image's size (its latent tokens)."""
        if not scheduler.config.get("use_dynamic_shifting", None):
            return {}
        patch, factor = self.pipeline.transformer.config.patch_size, self.pipeline.vae_scale_factor
        config = scheduler.config
        return {"mu": calculate_shift((spec.height // factor // patch) * (spec.width // factor // patch),
                                      config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                                      config.get("base_shift", 0.5), config.get("max_shift", 1.16))}

    def _image_schedule(self, spec: SequenceSpec, source: ImageSource, scheduler: Any, generator: torch.Generator,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Inpainting | None]:
        pipeline, device = source.pipeline, self.device
        image = pipeline.image_processor.preprocess(source.image, height=spec.height, width=spec.width)
        timesteps, steps = retrieve_timesteps(scheduler, spec.steps, device, sigmas=None,
                                              **self._shift(spec, scheduler))
        timesteps, steps = pipeline.get_timesteps(steps, source.strength, device)
        latents = pipeline.prepare_latents(image, timesteps[:1].repeat(1), 1, 1, dtype, device, [generator])
        return timesteps, latents, None

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        predicted: torch.Tensor = self.pipeline.transformer(hidden_states=inputs, timestep=times, return_dict=False,
                                                            **conditioning)[0]
        return predicted

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        pipeline = self.pipeline
        config = pipeline.vae.config
        latents = torch.cat([s.latents for s in sequences]) / config.scaling_factor + config.shift_factor
        image = pipeline.vae.decode(latents, return_dict=False)[0]
        return channels_last(pipeline.image_processor.postprocess(image, output_type="pt"))
