"""Qwen-Image: Flux's packed flow matching with Qwen2.5-VL prompts of their own lengths, and true
CFG with its norm rescaling.

``QwenImagePipeline.__call__`` encodes each prompt to as many tokens as it has (after the chat
template's dropped prefix), with a mask only where a batch pads prompts of different lengths; here
every call pads its rows' prompts (the negative and positive of a sequence, and the sequences of a
size group) to the longest, masked out (``encoder_hidden_states_mask``): the transformer masks
padded text keys out of the joint attention and places the text's rotary positions from the first
token, so a padded row equals the row alone. Its classifier-free guidance is ``true_cfg_scale``
(the request's guidance, as the adapter passes it; the adapter always gives a negative prompt),
run by ``__call__`` as a second transformer call and here as a negative row of the same call; the
combined prediction is rescaled to the positive one's norm over each packed token's channels, as
``__call__`` does. The sigmas, the size's shift and the begin index are Flux's; the latents are
kept unpacked (1 x C x h x w, the frame axis of ``prepare_latents``' 1 x 1 x C x h x w dropped)
and packed for the transformer and the norm only; the Euler step is elementwise. Decoding
unnormalises with the VAE's latents mean and std and takes the video VAE's one frame.

A guidance-distilled transformer (``guidance_embeds``) is not served: ``__call__`` then wants a
``guidance_scale`` the adapter, which gives the request's guidance to ``true_cfg_scale``, never
passes.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

from runner_service.denoising.loop import Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import Embeddings
from runner_service.device_output import channels_last
from runner_service.families.flux.loop import FluxLoop, _sigmas

EMBEDS, MASK = "encoder_hidden_states", "encoder_hidden_states_mask"


class QwenImageLoop(FluxLoop):
    """Qwen-Image: masked prompts of different lengths in one call, true CFG with norm rescaling."""

    tasks = frozenset({"TEXT_TO_IMAGE"})

    @classmethod
    def serves(cls, pipeline: DiffusionPipeline) -> bool:
        return super().serves(pipeline) and not pipeline.transformer.config.guidance_embeds

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        prompts = [spec.negative_prompt, spec.prompt] if guided else [spec.prompt]
        encoded = []
        for prompt in prompts:
            embeds, mask = self.pipeline.encode_prompt(prompt=[prompt], device=self.device, num_images_per_prompt=1,
                                                       **self._encoding)
            if mask is None:  # encode_prompt drops a mask without padding
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            encoded.append({EMBEDS: embeds, MASK: mask})
        return self._merged(encoded)

    def _merged(self, conditionings: list[Embeddings]) -> Embeddings:
        """Rows padded with zeros to the longest prompt, masked out, as ``_get_qwen_prompt_embeds``
        pads a batch."""
        length = max(conditioning[EMBEDS].shape[1] for conditioning in conditionings)
        embeds = [torch.nn.functional.pad(c[EMBEDS], (0, 0, 0, length - c[EMBEDS].shape[1])) for c in conditionings]
        masks = [torch.nn.functional.pad(c[MASK], (0, length - c[MASK].shape[1])) for c in conditionings]
        return {EMBEDS: torch.cat(embeds), MASK: torch.cat(masks)}

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pipeline = self.pipeline
        packed = pipeline.prepare_latents(1, pipeline.transformer.config.in_channels // 4, spec.height, spec.width,
                                          dtype, self.device, generator)
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, self.device, sigmas=_sigmas(spec.steps),
                                          **self._shift(spec, scheduler))
        scheduler.set_begin_index(0)
        return timesteps, self._unpacked(packed, spec.height, spec.width)

    def _unpacked(self, packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed tokens of an image of ``height`` x ``width`` pixels as rows x C x h x w."""
        unpacked: torch.Tensor = self.pipeline._unpack_latents(packed, height, width, self.pipeline.vae_scale_factor)
        return unpacked.squeeze(2)

    def _packed(self, latents: torch.Tensor) -> torch.Tensor:
        rows, channels, height, width = latents.shape
        packed: torch.Tensor = self.pipeline._pack_latents(latents, rows, channels, height, width)
        return packed

    def _guided(self, sequence: Sequence, uncond: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        combined = self._packed(super()._guided(sequence, uncond, text))
        rescaled = combined * (torch.norm(self._packed(text), dim=-1, keepdim=True)
                               / torch.norm(combined, dim=-1, keepdim=True))
        return self._unpacked(rescaled, sequence.spec.height, sequence.spec.width)

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        rows, _, height, width = inputs.shape
        mask = conditioning[MASK]
        predicted = self.pipeline.transformer(
            hidden_states=self._packed(inputs), timestep=times.to(inputs.dtype) / 1000, guidance=None,
            # No mask where no row is padded, as encode_prompt gives none for a prompt alone.
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            encoder_hidden_states=conditioning[EMBEDS], img_shapes=[[(1, height // 2, width // 2)]] * rows,
            attention_kwargs={}, return_dict=False)[0]
        factor = self.pipeline.vae_scale_factor
        return self._unpacked(predicted, height * factor, width * factor)

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        pipeline = self.pipeline
        vae = pipeline.vae
        latents = torch.cat([s.latents for s in sequences]).unsqueeze(2).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents / std + mean, return_dict=False)[0][:, :, 0]
        return channels_last(pipeline.image_processor.postprocess(image, output_type="pt"))
