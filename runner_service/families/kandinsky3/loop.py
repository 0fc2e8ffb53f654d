"""Kandinsky 3: a UNet over T5 embeddings with an encoder attention mask, a DDPM scheduler that
draws noise at every step, MoVQ decoding.

How it maps onto ``Kandinsky3Pipeline.__call__``:

- ``encode_prompt`` with ``_cut_context=True``, as ``__call__`` calls it: the prompt's embeddings
  are cut to its mask's length plus one token, the negative prompt's to the prompt's length, and
  both masks ride with them (``encoder_attention_mask``, as booleans: the UNet turns any mask into
  an additive one).
- The guidance is ``(scale + 1) * text - scale * uncond``: the base's ``uncond + s * (text -
  uncond)`` with ``s = scale + 1``; guided, as ``do_classifier_free_guidance``, when the scale is
  above 1 (``_cfg_scale``).
- ``scheduler.set_timesteps`` (no ``retrieve_timesteps``), no ``scale_model_input``; the latents are
  ``prepare_latents``' at ``downscale_height_and_width(height, width, 8)`` (the size rounded up to
  a multiple of 64, over 8), scaled by the sequence's own scheduler; the scheduler's step takes the
  image's generator (DDPM's variance noise), the one that drew its latents, as ``__call__`` passes it.
- Decoding: ``movq.decode(latents, force_not_quantize=True)``, then ``* 0.5 + 0.5`` clamped.

Image-to-image follows ``Kandinsky3Img2ImgPipeline.__call__`` with the derived pipeline's own
methods (its scheduler the sequence's meanwhile): its ``encode_prompt`` (the same cut context), the
image preprocessed at its own size (a multiple of the 64 grid, so its latents are the text
ones' size), ``set_timesteps`` then ``get_timesteps`` for the strength, the image's MoVQ latents
(``movq.encode(image)["latents"]``, no sampling) noised to the first timestep by ``prepare_latents``
with the image's generator, which then draws the DDPM steps' noise as in text-to-image. Its guidance,
steps and decoding (``image_processor.postprocess``: the same ``* 0.5 + 0.5`` clamped) are the text ones'.

Sequences whose prompts cut to different lengths share a denoiser call padded to the longest
(``_merged``): zero embeddings, masked out, exactly what ``__call__`` makes of a batch of such
prompts (it cuts them all to the longest mask). The masked tokens get no attention weight, but the
UNet's attention pooling (``add_time_condition``) averages its query over every token, padding
too: a padded sequence's prediction differs from its own call's by about 1e-6 in the tiny build
(its images within 1/255); grouping calls by prompt length instead would be exact but would batch
only prompts of one length.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.kandinsky3.pipeline_kandinsky3 import downscale_height_and_width

from runner_service.denoising.loop import DenoisingLoop, ImageSource, Inpainting, Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.device_output import channels_last


class Kandinsky3Loop(DenoisingLoop):
    """Kandinsky 3: T5 embeddings with their attention mask, guidance ``scale + 1``, DDPM, MoVQ."""

    tasks = frozenset({"TEXT_TO_IMAGE", "IMAGE_TO_IMAGE"})

    def _cfg_scale(self, spec: SequenceSpec) -> float:
        # Above 1 (guided) the pipeline's weight on the text prediction is scale + 1; at or below 1,
        # unguided, the scale itself (never applied) keeps the sequence unguided.
        return spec.guidance + 1.0 if spec.guidance > 1 else spec.guidance

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        pipeline = self.pipeline if spec.source is None else spec.source.pipeline
        positive, negative, mask, negative_mask = pipeline.encode_prompt(
            [spec.prompt], guided, num_images_per_prompt=1, device=self.device,
            negative_prompt=[spec.negative_prompt], _cut_context=True)
        if not guided:
            return {"encoder_hidden_states": positive, "encoder_attention_mask": mask.bool()}
        return {"encoder_hidden_states": torch.cat([negative, positive]),
                "encoder_attention_mask": torch.cat([negative_mask, mask]).bool()}

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        scheduler.set_timesteps(spec.steps, device=self.device)
        height, width = downscale_height_and_width(spec.height, spec.width, 8)  # type: ignore[no-untyped-call]
        latents: torch.Tensor = self.pipeline.prepare_latents((1, 4, height, width), dtype, self.device, generator,
                                                              None, scheduler)
        return scheduler.timesteps, latents

    def _image_schedule(self, spec: SequenceSpec, source: ImageSource, scheduler: Any, generator: torch.Generator,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Inpainting | None]:
        pipeline, device = source.pipeline, self.device
        image = pipeline.image_processor.preprocess(source.image).to(dtype=dtype, device=device)
        scheduler.set_timesteps(spec.steps, device=device)
        timesteps, _ = pipeline.get_timesteps(spec.steps, source.strength, device)
        latents = pipeline.movq.encode(image)["latents"]
        latents = pipeline.prepare_latents(latents, timesteps[:1].repeat(1), 1, 1, dtype, device, generator)
        return timesteps, latents, None

    def _step_arguments(self, generator: torch.Generator) -> dict[str, Any]:
        return {"generator": generator}

    def _merged(self, conditionings: list[Embeddings]) -> Embeddings:
        length = max(conditioning["encoder_hidden_states"].shape[1] for conditioning in conditionings)
        return {name: torch.cat([_padded(conditioning[name], length) for conditioning in conditionings])
                for name in conditionings[0]}

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        predicted: torch.Tensor = self.pipeline.unet(inputs, times, return_dict=False, **conditioning)[0]
        return predicted

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        latents = torch.cat([s.latents for s in sequences])
        image = self.pipeline.movq.decode(latents, force_not_quantize=True)["sample"]
        return channels_last((image * 0.5 + 0.5).clamp(0, 1))


def _padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of embeddings or of their mask padded with zeros (False) to ``length`` tokens."""
    padding = tensor.new_zeros((tensor.shape[0], length - tensor.shape[1], *tensor.shape[2:]))
    return torch.cat([tensor, padding], dim=1)
