"""Flux: packed latents with token positions, distilled guidance per row, true CFG as a negative row."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from runner_service.denoising.controls import ResidualLists, Residuals
from runner_service.denoising.loop import ImageSource, Inpainting, Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import Embeddings, PromptCache
from runner_service.families.sd3.loop import StableDiffusion3Loop


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

    Image-to-image and inpainting follow ``FluxImg2ImgPipeline`` and ``FluxInpaintPipeline``'s
    ``__call__``: the sigmas and the size's shift, ``get_timesteps`` for the strength, their
    ``prepare_latents`` (the image encoded with the sequence's generator, ``scale_noise`` to the
    first timestep) and, inpainting, ``prepare_mask_latents``; what they pack is unpacked here, the
    blend after each step being elementwise too.

    ControlNets (``FluxControlNetModel``, InstantX's kind) follow ``FluxControlNetPipeline`` and its
    image-to-image sibling: each control image normalized, encoded by the VAE with the image's
    generator before its starting latents are drawn, shifted, scaled and packed; the ControlNet
    reads the positive row alone (its input, prompt, pooled projections and guidance) and its
    double- and single-block residuals go to both rows, as the pipeline adds them to its true-CFG
    negative pass too.
    """

    tasks = frozenset({"TEXT_TO_IMAGE", "IMAGE_TO_IMAGE", "INPAINT"})

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
        sigmas = None if scheduler.config.get("use_flow_sigmas", False) else _sigmas(spec.steps)
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, self.device, sigmas=sigmas,
                                          **self._shift(spec, scheduler))
        scheduler.set_begin_index(0)
        latents = pipeline._unpack_latents(packed, spec.height, spec.width, pipeline.vae_scale_factor)
        return timesteps, latents

    def _shift(self, spec: SequenceSpec, scheduler: Any) -> dict[str, Any]:
        factor, config = self.pipeline.vae_scale_factor, scheduler.config
        # Flux's calculate_shift is SD3's with another default max_shift: each is passed.
        return {"mu": calculate_shift((spec.height // factor // 2) * (spec.width // factor // 2),
                                      config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                                      config.get("base_shift", 0.5), config.get("max_shift", 1.15))}

    def _image_schedule(self, spec: SequenceSpec, source: ImageSource, scheduler: Any, generator: torch.Generator,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Inpainting | None]:
        pipeline, device = source.pipeline, self.device
        height, width, factor = spec.height, spec.width, pipeline.vae_scale_factor
        init_image = pipeline.image_processor.preprocess(source.image, height=height, width=width,
                                                         crops_coords=None, resize_mode="default")
        init_image = init_image.to(dtype=torch.float32)
        timesteps, steps = retrieve_timesteps(scheduler, spec.steps, device, sigmas=_sigmas(spec.steps),
                                              **self._shift(spec, scheduler))
        timesteps, steps = pipeline.get_timesteps(steps, source.strength, device)
        latent_timestep = timesteps[:1].repeat(1)
        channels = pipeline.transformer.config.in_channels // 4
        if source.mask is None:
            packed, _ = pipeline.prepare_latents(init_image, latent_timestep, 1, channels, height, width, dtype, device,
                                                 [generator], None)
            return timesteps, pipeline._unpack_latents(packed, height, width, factor), None
        packed, noise, image_latents, _ = pipeline.prepare_latents(
            init_image, latent_timestep, 1, channels, height, width, dtype, device, [generator], None)
        mask_condition = pipeline.mask_processor.preprocess(source.mask, height=height, width=width,
                                                            resize_mode="default", crops_coords=None)
        masked_image = init_image * (mask_condition < 0.5)
        mask, _ = pipeline.prepare_mask_latents(mask_condition, masked_image, 1, channels, 1, height, width, dtype,
                                                device, [generator])
        unpacked = [pipeline._unpack_latents(tensor, height, width, factor) for tensor in (image_latents, noise, mask)]
        return timesteps, pipeline._unpack_latents(packed, height, width, factor), Inpainting(*unpacked)

    def _noised(self, scheduler: Any, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        noised: torch.Tensor = scheduler.scale_noise(latents, t, noise)
        return noised

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        return self._predict_controlled(inputs, times, conditioning, None)

    def _positions(self, inputs: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """encode_prompt's text ids (zeros, one per token) and prepare_latents' image ids (each token's
        position): every row has the same, the batch sharing one size."""
        rows, _, height, width = inputs.shape
        text_ids = torch.zeros(hidden.shape[1], 3, device=self.device, dtype=hidden.dtype)
        image_ids = self.pipeline._prepare_latent_image_ids(rows, height // 2, width // 2, self.device, inputs.dtype)
        return text_ids, image_ids

    def _predict_controlled(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings,
                            residuals: Residuals | None) -> torch.Tensor:
        pipeline = self.pipeline
        rows, channels, height, width = inputs.shape
        hidden = conditioning["encoder_hidden_states"]
        text_ids, image_ids = self._positions(inputs, hidden)
        controlled = {} if residuals is None else {"controlnet_block_samples": residuals.lists[0],
                                                   "controlnet_single_block_samples": residuals.lists[1]}
        predicted = pipeline.transformer(
            hidden_states=pipeline._pack_latents(inputs, rows, channels, height, width),
            timestep=times.to(inputs.dtype) / 1000, guidance=conditioning.get("guidance"),
            pooled_projections=conditioning["pooled_projections"], encoder_hidden_states=hidden,
            # {} as __call__ passes it: compiled blocks then serve both paths with the same kernels.
            txt_ids=text_ids, img_ids=image_ids, joint_attention_kwargs={}, return_dict=False, **controlled)[0]
        factor = pipeline.vae_scale_factor
        unpacked: torch.Tensor = pipeline._unpack_latents(predicted, height * factor, width * factor, factor)
        return unpacked


    def _control_inputs(self, spec: SequenceSpec, conditioning: Embeddings, guided: bool,
                        generator: torch.Generator) -> tuple[dict[str, torch.Tensor], ...]:
        pipeline, vae = self.pipeline, self.pipeline.vae
        inputs = []
        for control in spec.controls:
            pixels = (control.image * 2.0 - 1.0).to(dtype=vae.dtype)
            latents = vae.encode(pixels).latent_dist.sample(generator)
            latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
            _, channels, height, width = latents.shape
            inputs.append({"controlnet_cond": pipeline._pack_latents(latents, 1, channels, height, width)})
        return tuple(inputs)

    def _control_sources(self, rows: int) -> tuple[int, ...]:
        return (rows - 1,) * rows  # the positive row, the last

    def _run_controlnet(self, net: torch.nn.Module, rows: torch.Tensor, arguments: dict[str, torch.Tensor],
                        inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> ResidualLists:
        picked = inputs[rows]
        count, channels, height, width = picked.shape
        hidden = conditioning["encoder_hidden_states"][rows]
        text_ids, image_ids = self._positions(picked, hidden)
        guidance = conditioning.get("guidance")  # where the transformer takes it, and so the ControlNet
        blocks, singles = net(
            hidden_states=self.pipeline._pack_latents(picked, count, channels, height, width),
            controlnet_cond=arguments["controlnet_cond"], controlnet_mode=None, conditioning_scale=1.0,
            timestep=times[rows].to(inputs.dtype) / 1000, guidance=None if guidance is None else guidance[rows],
            pooled_projections=conditioning["pooled_projections"][rows], encoder_hidden_states=hidden,
            txt_ids=text_ids, img_ids=image_ids, joint_attention_kwargs={}, return_dict=False)
        return [None if blocks is None else list(blocks), None if singles is None else list(singles)]

    def _spread_residuals(self, position: int, residuals: list[torch.Tensor]) -> list[torch.Tensor]:
        # The transformer adds residual i // ceil(blocks / len) to block i, double and single blocks alike.
        transformer = self.pipeline.transformer
        blocks = len(transformer.transformer_blocks if position == 0 else transformer.single_transformer_blocks)
        interval = math.ceil(blocks / len(residuals))
        return [residuals[index // interval] for index in range(blocks)]


def _sigmas(steps: int) -> list[float]:
    """Flux's sigmas for ``steps`` steps (its calls' default)."""
    return list(np.linspace(1.0, 1 / steps, steps).tolist())
