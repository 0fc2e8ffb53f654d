"""HunyuanDiT: a diffusion transformer over two text encoders (a BERT-like CLIP stand-in and T5),
each with its attention mask, with a DDPM-style scheduler and Stable Diffusion's decoding.

How it maps onto ``__call__``: ``encode_prompt`` runs once per encoder (77 tokens for the first,
256 for T5), padded to that length, so rows of any prompts stack as they are. Each row also
carries its ``image_meta_size`` (the call's ``original_size``, the image's own size as
``target_size``, and the call's ``crops_coords_top_left``) and its ``style`` (0). The rotary
embedding ``__call__`` makes once for its size is made in ``_predict`` for each size group,
from the group's size, with the same rules (the pipeline's ``height // 8 // patch`` whatever the
VAE, and its 512-pixel base grid); the transformer's learned variance (the second half of its
output channels) is dropped as ``__call__`` drops it. The scheduler's ``scale_model_input``, its
step arguments (eta 0 and the image's generator) and the decoding (the safety checker where the
pipeline has one) are SD's. ``guidance_rescale`` is the call's default, 0 as the runner calls it:
plain CFG, the base loop's.
"""

from __future__ import annotations

import inspect

import torch
from diffusers.models.embeddings import get_2d_rotary_pos_embed
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.denoising.loop import SequenceSpec
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.families.sd.loop import StableDiffusionLoop


class HunyuanDiTLoop(StableDiffusionLoop):
    """HunyuanDiT: two masked text encodings, size and style embeddings per row, rotary
    embeddings per size; SD's scheduler handling and decoding."""

    denoiser = "transformer"
    # Text to image only: diffusers has no image-to-image or inpainting pipeline of this family
    # (SD's image tasks are not inherited).
    tasks = frozenset({"TEXT_TO_IMAGE"})

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device) -> None:
        super().__init__(pipeline, device)
        parameters = inspect.signature(pipeline.__call__).parameters
        self._original_size = tuple(parameters["original_size"].default)
        self._crops_coords_top_left = tuple(parameters["crops_coords_top_left"].default)

    @classmethod
    def serves(cls, pipeline: DiffusionPipeline) -> bool:
        return super(StableDiffusionLoop, cls).serves(pipeline)  # DenoisingLoop's: SD's asks for a UNet

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        pipeline = self.pipeline
        encoded = [pipeline.encode_prompt(prompt=[spec.prompt], device=self.device, dtype=pipeline.transformer.dtype,
                                          num_images_per_prompt=1, do_classifier_free_guidance=guided,
                                          negative_prompt=[spec.negative_prompt], max_sequence_length=length,
                                          text_encoder_index=index)
                   for index, length in enumerate((77, 256))]
        (positive, negative, mask, negative_mask), (positive_t5, negative_t5, mask_t5, negative_mask_t5) = encoded
        size = torch.tensor([self._original_size + (spec.height, spec.width) + self._crops_coords_top_left],
                            dtype=positive.dtype, device=self.device)
        style = torch.tensor([0], device=self.device)
        if not guided:
            return {"encoder_hidden_states": positive, "text_embedding_mask": mask,
                    "encoder_hidden_states_t5": positive_t5, "text_embedding_mask_t5": mask_t5,
                    "image_meta_size": size, "style": style}
        return {"encoder_hidden_states": torch.cat([negative, positive]),
                "text_embedding_mask": torch.cat([negative_mask, mask]),
                "encoder_hidden_states_t5": torch.cat([negative_t5, positive_t5]),
                "text_embedding_mask_t5": torch.cat([negative_mask_t5, mask_t5]),
                "image_meta_size": torch.cat([size, size]), "style": torch.cat([style, style])}

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        pipeline = self.pipeline
        transformer = pipeline.transformer
        patch = transformer.config.patch_size
        height, width = inputs.shape[2] * pipeline.vae_scale_factor, inputs.shape[3] * pipeline.vae_scale_factor
        grid = (height // 8 // patch, width // 8 // patch)
        crops = get_resize_crop_region_for_grid(grid, 512 // 8 // patch)  # type: ignore[no-untyped-call]  # diffusers leaves it untyped
        rotary = get_2d_rotary_pos_embed(transformer.inner_dim // transformer.num_heads, crops, grid,
                                         device=self.device, output_type="pt")
        predicted: torch.Tensor = transformer(inputs, times.to(inputs.dtype), image_rotary_emb=rotary,
                                              return_dict=False, **conditioning)[0]
        noise, _ = predicted.chunk(2, dim=1)
        return noise
