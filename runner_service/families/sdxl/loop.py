"""SDXL: Stable Diffusion's loop (``sd.loop``) with two text encoders, pooled embeddings, size
micro-conditioning and its own VAE decoding; image-to-image and inpainting as SD's, through
``StableDiffusionXLImg2ImgPipeline`` and ``StableDiffusionXLInpaintPipeline``'s like-named methods."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from runner_service.denoising.loop import Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.device_output import channels_last
from runner_service.families.sd.loop import StableDiffusionLoop


class StableDiffusionXLLoop(StableDiffusionLoop):
    """SDXL: two text encoders, pooled embeddings and size micro-conditioning (the image
    pipelines': with aesthetic scores where the UNet was trained on them), and its own VAE decoding
    (fp16 upcasting, latents mean and std, the watermark)."""

    def _prepare_scheduler(self, scheduler: Any) -> None:
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        pipeline = self.pipeline
        positive, negative, pooled, negative_pooled = pipeline.encode_prompt(
            prompt=[spec.prompt], device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=guided, negative_prompt=[spec.negative_prompt])
        encoder_2 = pipeline.text_encoder_2
        projection = int(pooled.shape[-1]) if encoder_2 is None else encoder_2.config.projection_dim
        size = (spec.height, spec.width)
        if spec.source is None:
            time_ids = negative_time_ids = pipeline._get_add_time_ids(
                size, (0, 0), size, dtype=positive.dtype, text_encoder_projection_dim=projection)
        else:  # the image pipelines' own, with their aesthetic scores where their UNet takes them
            defaults = inspect.signature(spec.source.pipeline.__call__).parameters
            time_ids, negative_time_ids = spec.source.pipeline._get_add_time_ids(
                size, (0, 0), size, defaults["aesthetic_score"].default, defaults["negative_aesthetic_score"].default,
                size, (0, 0), size, dtype=positive.dtype, text_encoder_projection_dim=projection)
        time_ids, negative_time_ids = time_ids.to(self.device), negative_time_ids.to(self.device)
        if not guided:
            return {"encoder_hidden_states": positive, "text_embeds": pooled, "time_ids": time_ids}
        return {"encoder_hidden_states": torch.cat([negative, positive]),
                "text_embeds": torch.cat([negative_pooled, pooled]),
                "time_ids": torch.cat([negative_time_ids, time_ids])}

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        pipeline = self.pipeline
        vae = pipeline.vae
        latents = torch.cat([s.latents for s in sequences])
        upcast = vae.dtype == torch.float16 and vae.config.force_upcast
        if upcast:
            vae.to(dtype=torch.float32)
            latents = latents.to(torch.float32)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        try:
            image = vae.decode(latents, return_dict=False)[0]
        finally:
            if upcast:
                vae.to(dtype=torch.float16)
        if pipeline.watermark is not None:
            image = pipeline.watermark.apply_watermark(image)
        return channels_last(pipeline.image_processor.postprocess(image, output_type="pt"))
