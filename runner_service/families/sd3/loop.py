"""Stable Diffusion 3: a flow-matching transformer over three text encoders.

Image-to-image follows ``StableDiffusion3Img2ImgPipeline.__call__``: the image preprocessed to the
size, the size's shift, ``retrieve_timesteps`` then ``get_timesteps`` for the strength and
``prepare_latents`` (the image encoded with the sequence's generator, ``scale_noise`` to the first
timestep). Inpainting is left request-level: the tiny build's transformer has too few channels to
inpaint (the canary drops it), so no model here would test it.

ControlNets (``SD3ControlNetModel``) follow ``StableDiffusion3ControlNetPipeline.__call__``: each
control image normalized, once per row, encoded by the VAE (whose noise that pipeline draws from
torch's global generator: here from the image's control-noise generator, ``control_noise_seed``),
shifted (not where the ControlNet takes zero pooled projections, InstantX's) and scaled; the
ControlNet reads every row's input, prompt and pooled projections (zeros, InstantX's) and its
block residuals go to the transformer's ``block_controlnet_hidden_states``. The pipeline takes no
input image: image-to-image requests take no ControlNets here (``controlnets.py`` refuses them).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from runner_service.denoising.controls import ResidualLists, Residuals, control_noise_seed
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
        return self._predict_controlled(inputs, times, conditioning, None)

    def _predict_controlled(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings,
                            residuals: Residuals | None) -> torch.Tensor:
        controlled = {} if residuals is None else {"block_controlnet_hidden_states": residuals.lists[0]}
        predicted: torch.Tensor = self.pipeline.transformer(hidden_states=inputs, timestep=times, return_dict=False,
                                                            **conditioning, **controlled)[0]
        return predicted

    def _control_inputs(self, spec: SequenceSpec, conditioning: Embeddings, guided: bool,
                        generator: torch.Generator) -> tuple[dict[str, torch.Tensor], ...]:
        pipeline, vae = self.pipeline, self.pipeline.vae
        rows = len(self.guided_rows) if guided else 1
        first: Any = spec.controls[0].net  # an SD3ControlNetModel
        zero_pooled = first.config.force_zeros_for_pooled_projection  # the first's, for all, as the pipeline reads it
        shift = 0 if zero_pooled else vae.config.shift_factor
        pooled = conditioning["pooled_projections"]
        pooled = torch.zeros_like(pooled) if zero_pooled else pooled
        noise = torch.Generator("cpu").manual_seed(control_noise_seed(spec.seed))
        inputs = []
        for control in spec.controls:
            pixels = (control.image * 2.0 - 1.0).to(dtype=pipeline.transformer.dtype).repeat(rows, 1, 1, 1)
            latents = vae.encode(pixels).latent_dist.sample(noise)
            inputs.append({"controlnet_cond": (latents - shift) * vae.config.scaling_factor,
                           "pooled_projections": pooled})
        return tuple(inputs)

    def _run_controlnet(self, net: torch.nn.Module, rows: torch.Tensor, arguments: dict[str, torch.Tensor],
                        inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> ResidualLists:
        samples = net(hidden_states=inputs[rows], timestep=times[rows],
                      encoder_hidden_states=conditioning["encoder_hidden_states"][rows],
                      pooled_projections=arguments["pooled_projections"], controlnet_cond=arguments["controlnet_cond"],
                      conditioning_scale=1.0, return_dict=False)[0]
        return [list(samples)]

    def _spread_residuals(self, position: int, residuals: list[torch.Tensor]) -> list[torch.Tensor]:
        # The transformer adds residual int(i / (blocks / len)) to block i.
        blocks = len(self.pipeline.transformer.transformer_blocks)
        interval = blocks / len(residuals)
        return [residuals[int(index / interval)] for index in range(blocks)]

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        pipeline = self.pipeline
        config = pipeline.vae.config
        latents = torch.cat([s.latents for s in sequences]) / config.scaling_factor + config.shift_factor
        image = pipeline.vae.decode(latents, return_dict=False)[0]
        return channels_last(pipeline.image_processor.postprocess(image, output_type="pt"))
