"""InstructPix2Pix, the edit model: Stable Diffusion whose UNet takes the input image's latents
beside the noisy ones (8 channels in), guided by the instruction and by the image.

How it maps onto ``StableDiffusionInstructPix2PixPipeline.__call__``:

- An edit sequence always has its input image (``SequenceSpec.source``, task ``EDIT``, whose
  strength is unused): there is no text-to-image, and the whole schedule runs from noise
  (``scheduler.set_timesteps``, no ``retrieve_timesteps`` nor strength).
- The request's guidance is ``guidance_scale``; ``image_guidance_scale`` is the call's default
  (1.5), as the pipeline adapter calls it, so ``do_classifier_free_guidance`` (``guidance_scale``
  above 1 and ``image_guidance_scale`` at least 1) is the base's ``guidance`` above 1. Guided, a
  sequence has three rows (``guided_rows``), in ``_encode_prompt``'s
  order: the instruction, then the negative prompt twice. ``prepare_image_latents`` gives the
  image's latents (the VAE's mode: no generator) for them as image, image, zeros: the rows are the
  text-and-image, the image-only and the unconditional predictions, combined as
  ``uncond + guidance * (text - image) + image_guidance * (image - uncond)``.
- The noisy latents are ``prepare_latents``' at the size of the image's latents (the size the image
  processor gives the image), scaled by the sequence's own scheduler; each row's input is its
  scaled latents concatenated with its image latents along the channels, after
  ``scale_model_input`` as ``__call__`` concatenates them. SD's step arguments (eta 0 and the
  generator) and decoding (the safety checker) stand.

Everything else (the UNet call over every sequence's rows at their own timesteps, each sequence's
own scheduler step) is Stable Diffusion's loop.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.denoising.loop import ImageSource, Inpainting, Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import Embeddings, PromptCache
from runner_service.families.sd.loop import StableDiffusionLoop


@dataclass(eq=False)
class EditSequence(Sequence):
    """An edit sequence: with its input image's latents, one per input row (image, image, zeros
    when guided)."""

    image_latents: torch.Tensor | None = None


class InstructPix2PixLoop(StableDiffusionLoop):
    """The edit model: three guided rows (text, image, unconditional), the image's latents beside
    the noisy ones in the UNet's input."""

    tasks = frozenset({"EDIT"})
    guided_rows = ("positive", "image", "negative")  # _encode_prompt's order: prompt, negative, negative

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device) -> None:
        super().__init__(pipeline, device)
        # The call's own: the pipeline adapter passes the request's guidance as guidance_scale only.
        self.image_guidance = float(inspect.signature(pipeline.__call__).parameters["image_guidance_scale"].default)

    def start(self, spec: SequenceSpec, cache: PromptCache, version: str) -> Sequence:
        source = _edited(spec)
        sequence = super().start(spec, cache, version)
        image = source.pipeline.image_processor.preprocess(source.image)
        image_latents = source.pipeline.prepare_image_latents(image, 1, 1, sequence.latents.dtype, self.device,
                                                            sequence.guided)
        return EditSequence(**{field.name: getattr(sequence, field.name) for field in fields(sequence)},
                            image_latents=image_latents)

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        embeddings = self.pipeline._encode_prompt([spec.prompt], self.device, 1, guided, [spec.negative_prompt])
        return {"encoder_hidden_states": embeddings}

    def _image_schedule(self, spec: SequenceSpec, source: ImageSource, scheduler: Any, generator: torch.Generator,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Inpainting | None]:
        pipeline = source.pipeline  # its scheduler is the sequence's meanwhile
        scheduler.set_timesteps(spec.steps, device=self.device)
        # The size the image processor gives the image, which its latents (and so these) have.
        height, width = pipeline.image_processor.get_default_height_width(source.image)
        latents = pipeline.prepare_latents(1, pipeline.vae.config.latent_channels, height, width, dtype, self.device,
                                           generator)
        return scheduler.timesteps, latents, None

    def _scaled(self, sequence: Sequence, model_input: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        assert isinstance(sequence, EditSequence) and sequence.image_latents is not None, "started by this loop"
        return torch.cat([super()._scaled(sequence, model_input, t), sequence.image_latents], dim=1)

    def _guided(self, sequence: Sequence, text: torch.Tensor, image: torch.Tensor,  # type: ignore[override]
                uncond: torch.Tensor) -> torch.Tensor:
        return uncond + self._cfg_scale(sequence.spec) * (text - image) + self.image_guidance * (image - uncond)


def _edited(spec: SequenceSpec) -> ImageSource:
    """The sequence's input image: an edit has one."""
    if spec.source is None:
        raise ValueError("an edit sequence starts from its input image")
    return spec.source
