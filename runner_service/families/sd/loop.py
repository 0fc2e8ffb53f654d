"""Stable Diffusion 1.x/2.x: a UNet (epsilon or v prediction) and its scheduler; SDXL's loop
(``sdxl.loop``), InstructPix2Pix's and HunyuanDiT's build on it, PixArt's on ``ScaledInputLoop``.

Image-to-image and inpainting follow the derived pipelines' ``__call__`` (``StableDiffusion[XL]
Img2ImgPipeline``, ``...InpaintPipeline``, whose methods SD and SDXL name alike): the image
preprocessed, ``retrieve_timesteps`` then ``get_timesteps`` for the strength, ``prepare_latents``
(the image encoded with the sequence's generator, noised by the scheduler's ``add_noise``), and,
inpainting, ``prepare_mask_latents`` (which encodes the masked image with the generator too, so
the scheduler's later draws are ``__call__``'s). Only a UNet of the latents' channels inpaints
here: a 9-channel inpainting UNet cannot make an image from text (its text-to-image latents have
9 channels, which the VAE cannot decode), so no such model loads for text-to-image.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from runner_service.denoising.controls import ResidualLists, Residuals
from runner_service.denoising.loop import DenoisingLoop, ImageSource, Inpainting, Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.device_output import channels_last


class ScaledInputLoop(DenoisingLoop):
    """A loop whose ``__call__`` scales each step's model input by its scheduler
    (``scale_model_input``) and steps it with ``prepare_extra_step_kwargs`` (eta, the generator):
    the UNet families', PixArt's."""

    def _step_arguments(self, generator: torch.Generator) -> dict[str, Any]:
        # eta 0, __call__'s default; the method inspects the sequence's own scheduler (``start`` puts it in place).
        return dict(self.pipeline.prepare_extra_step_kwargs(generator, 0.0))

    def _scaled(self, sequence: Sequence, model_input: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = sequence.scheduler.scale_model_input(model_input, t)
        return scaled


class StableDiffusionLoop(ScaledInputLoop):
    """Stable Diffusion 1.x/2.x: one text encoder, a UNet without a guidance embedding (LCM) or
    image conditioning, the safety checker."""

    tasks = frozenset({"TEXT_TO_IMAGE", "IMAGE_TO_IMAGE", "INPAINT"})

    @classmethod
    def serves(cls, pipeline: DiffusionPipeline) -> bool:
        unet = getattr(pipeline, "unet", None)
        return (super().serves(pipeline) and unet is not None and unet.config.time_cond_proj_dim is None
                and getattr(unet.config, "encoder_hid_dim_type", None) is None)

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        positive, negative = self.pipeline.encode_prompt(
            [spec.prompt], self.device, 1, guided, [spec.negative_prompt])
        return {"encoder_hidden_states": torch.cat([negative, positive]) if guided else positive}

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pipeline = self.pipeline
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, self.device)
        self._prepare_scheduler(scheduler)
        # prepare_latents' own steps, with this sequence's scheduler (the pipeline's scales by its own).
        factor = pipeline.vae_scale_factor
        channels = getattr(pipeline, self.denoiser).config.in_channels
        shape = (1, channels, spec.height // factor, spec.width // factor)
        noise = randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        return timesteps, noise * scheduler.init_noise_sigma

    def _prepare_scheduler(self, scheduler: Any) -> None:
        """What ``__call__`` does to its scheduler after setting the timesteps (SD: nothing)."""

    def _image_schedule(self, spec: SequenceSpec, source: ImageSource, scheduler: Any, generator: torch.Generator,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Inpainting | None]:
        pipeline, device = source.pipeline, self.device
        timesteps, steps = retrieve_timesteps(scheduler, spec.steps, device)
        timesteps, steps = pipeline.get_timesteps(steps, source.strength, device)
        latent_timestep = timesteps[:1].repeat(1)
        if source.mask is None:
            image = pipeline.image_processor.preprocess(source.image)
            latents = pipeline.prepare_latents(image, latent_timestep, 1, 1, dtype, device, [generator])
            return timesteps, latents, None
        init_image = pipeline.image_processor.preprocess(source.image, height=spec.height, width=spec.width,
                                                         crops_coords=None, resize_mode="default")
        init_image = init_image.to(dtype=torch.float32)
        latents, noise, image_latents = pipeline.prepare_latents(
            1, pipeline.vae.config.latent_channels, spec.height, spec.width, dtype, device, [generator], None,
            image=init_image, timestep=latent_timestep, is_strength_max=source.strength == 1.0, return_noise=True,
            return_image_latents=True)
        mask_condition = pipeline.mask_processor.preprocess(source.mask, height=spec.height, width=spec.width,
                                                            resize_mode="default", crops_coords=None)
        masked_image = init_image * (mask_condition < 0.5)
        # Unguided: the mask once (``__call__`` stacks it twice when guided and blends with the first).
        mask, _ = pipeline.prepare_mask_latents(mask_condition, masked_image, 1, spec.height, spec.width, dtype,
                                                device, [generator], False)
        return timesteps, latents, Inpainting(image_latents, noise, mask)

    def _noised(self, scheduler: Any, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        noised: torch.Tensor = scheduler.add_noise(latents, noise, t)
        return noised

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        return self._predict_controlled(inputs, times, conditioning, None)

    def _control_inputs(self, spec: SequenceSpec, conditioning: Embeddings, guided: bool,
                        generator: torch.Generator) -> tuple[dict[str, torch.Tensor], ...]:
        # prepare_image: the pixels in the ControlNet's dtype, once per row (negative and positive alike).
        rows = len(self.guided_rows) if guided else 1
        return tuple({"controlnet_cond": control.image.to(dtype=control.dtype).expand(rows, -1, -1, -1)}
                     for control in spec.controls)

    def _run_controlnet(self, net: torch.nn.Module, rows: torch.Tensor, arguments: dict[str, torch.Tensor],
                        inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> ResidualLists:
        # It reads the UNet's scaled input, text and SDXL's added embeddings (an IP-Adapter's image
        # embeddings go to the UNet alone, as in diffusers' pipelines).
        added = {name: conditioning[name][rows] for name in ("text_embeds", "time_ids") if name in conditioning}
        down, mid = net(inputs[rows], times[rows], encoder_hidden_states=conditioning["encoder_hidden_states"][rows],
                        controlnet_cond=arguments["controlnet_cond"], conditioning_scale=1.0,
                        added_cond_kwargs=added or None, return_dict=False)
        return [list(down), [mid]]

    def _predict_controlled(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings,
                            residuals: Residuals | None) -> torch.Tensor:
        hidden = conditioning.pop("encoder_hidden_states")
        down, mid = (None, None) if residuals is None else residuals.lists
        added = {} if down is None or mid is None else {"down_block_additional_residuals": down,
                                                        "mid_block_additional_residual": mid[0]}
        predicted: torch.Tensor = self.pipeline.unet(inputs, times, encoder_hidden_states=hidden,
                                                     added_cond_kwargs=conditioning or None, return_dict=False,
                                                     **added)[0]
        return predicted

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        pipeline = self.pipeline
        latents = torch.cat([s.latents for s in sequences])
        image = pipeline.vae.decode(latents / pipeline.vae.config.scaling_factor, return_dict=False)[0]
        image, nsfw = pipeline.run_safety_checker(image, self.device, latents.dtype)
        denormalize = [True] * image.shape[0] if nsfw is None else [not flagged for flagged in nsfw]
        return channels_last(pipeline.image_processor.postprocess(image, output_type="pt", do_denormalize=denormalize))
