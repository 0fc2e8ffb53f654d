"""The denoising loops of pipelines whose loop is standard, one step at a time, over sequences
that each keep their own scheduler, timesteps, conditioning and guidance: Stable Diffusion
1.x/2.x and SDXL (a UNet, epsilon or v prediction), Stable Diffusion 3 and Flux (flow-matching
transformers). The family registry (``runner_service.models.families``) says which family runs
which loop.

Every piece is the pipeline's own: ``encode_prompt``, the noise ``prepare_latents`` draws, the
scheduler's class and config, the UNet or transformer, SDXL's ``_get_add_time_ids``, Flux's
latent packing and token positions, the VAE,
the safety checker or watermark and the image processor; a loop only does what ``__call__`` does
between them, for one timestep of many sequences at once. Diffusers' Modular blocks run one
timestep schedule for the whole batch, so they cannot let a request join at another's step.

One denoiser call takes every sequence's model input (two rows with classifier-free guidance,
one without), at each row's own timestep; the guidance and the scheduler step are then applied
per sequence, exactly as ``__call__`` applies them to its batch (Flux's true CFG: to its two calls).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from diffusers.utils.torch_utils import randn_tensor

from runner_service.acceleration.row_cache import RowCache
from runner_service.denoising.prompt_cache import Embeddings, PromptCache


@dataclass(frozen=True)
class SequenceSpec:
    """What one image needs to start: the request's parameters and this image's seed."""

    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    conditioning_key: Hashable  # the adapters the embeddings depend on, beside the weights version
    # true_cfg_scale where it is separate from guidance (Flux with a guidance embedding); 0: off.
    true_cfg: float = 0.0
    # The step cache's threshold for this image (None: the model's; 0: no caching).
    cache_threshold: float | None = None


def max_sequence_length(pipeline: DiffusionPipeline) -> dict[str, int]:
    """The ``max_sequence_length`` argument to call the pipeline and encode its prompts with: its
    long-text tokenizer's own length (the last tokenizer: T5, after CLIP in Flux and SD3) where the
    call takes one and that is shorter than the call's default; else none, the default stands. A
    model trained on short prompts (the shapes model's T5 reads 12 tokens) would otherwise get
    them padded to 512 tokens it never saw; a real Flux's T5 reads 512: no change."""
    parameter = inspect.signature(pipeline.__call__).parameters.get("max_sequence_length")
    names = sorted(name for name in pipeline.components if name.startswith("tokenizer"))
    tokenizer = pipeline.components[names[-1]] if names else None
    length = getattr(tokenizer, "model_max_length", None)
    if parameter is None or not isinstance(parameter.default, int) or not isinstance(length, int):
        return {}
    return {"max_sequence_length": length} if length < parameter.default else {}


@dataclass(eq=False)
class Sequence:
    """One image being denoised."""

    spec: SequenceSpec
    scheduler: Any  # a diffusers scheduler (SchedulerMixin declares none of scale_model_input, step)
    timesteps: torch.Tensor
    latents: torch.Tensor  # 1 x C x h x w
    conditioning: Embeddings  # the denoiser's arguments, one row per input row: [negative, positive] when guided
    guided: bool
    step_arguments: dict[str, Any]  # eta and the image's generator, where the scheduler takes them
    key: int  # distinct for every sequence a loop starts: its rows' names in the step cache
    done: int = 0

    @property
    def total(self) -> int:
        return len(self.timesteps)

    @property
    def finished(self) -> bool:
        return self.done >= self.total


class DenoisingLoop:
    """A family's loop: ``start`` a sequence, ``step`` many at once, ``decode`` the finished."""

    denoiser = "unet"

    def __init__(self, pipeline: DiffusionPipeline, device: torch.device) -> None:
        self.pipeline = pipeline
        self.device = device
        self._keys = itertools.count()

    @classmethod
    def serves(cls, pipeline: DiffusionPipeline) -> bool:
        """Whether a pipeline of a family this loop is declared for has what the loop drives."""
        return getattr(pipeline, cls.denoiser, None) is not None

    def start(self, spec: SequenceSpec, cache: PromptCache, version: str) -> Sequence:
        guided = self._cfg_scale(spec) > 1  # the pipelines' do_classifier_free_guidance
        key = (spec.conditioning_key, guided, spec.prompt, spec.negative_prompt, spec.width, spec.height)
        conditioning = cache.get(version, key, lambda: self._conditioning(spec, guided))
        scheduler = type(self.pipeline.scheduler).from_config(self.pipeline.scheduler.config)
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        dtype = next(iter(conditioning.values())).dtype
        timesteps, latents = self._schedule(spec, scheduler, generator, dtype)
        return Sequence(spec, scheduler, timesteps, latents, conditioning, guided,
                        self._step_arguments(generator), next(self._keys))

    def _cfg_scale(self, spec: SequenceSpec) -> float:
        """The classifier-free guidance scale: guided (a negative row) when above 1."""
        return spec.guidance

    def _conditioning(self, spec: SequenceSpec, guided: bool) -> Embeddings:
        """The denoiser's conditioning arguments for one image, one row per input row (negative first)."""
        raise NotImplementedError

    def _schedule(self, spec: SequenceSpec, scheduler: Any, generator: torch.Generator,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's timesteps and initial latents, as ``__call__`` makes them."""
        raise NotImplementedError

    def _step_arguments(self, generator: torch.Generator) -> dict[str, Any]:
        return {}

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        raise NotImplementedError

    def _scaled(self, sequence: Sequence, model_input: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model_input

    def step(self, sequences: list[Sequence], cache: RowCache | None = None) -> None:
        """Advances every unfinished sequence by one of its own timesteps, in one denoiser call;
        with the model's step cache, each sequence's rows keep their own cached state."""
        active = [s for s in sequences if not s.finished]
        if not active:
            return
        inputs, times = [], []
        for sequence in active:
            t = sequence.timesteps[sequence.done]
            model_input = torch.cat([sequence.latents] * 2) if sequence.guided else sequence.latents
            model_input = self._scaled(sequence, model_input, t)
            inputs.append(model_input)
            times.append(t.reshape(1).expand(model_input.shape[0]))
        conditioning = {name: torch.cat([s.conditioning[name] for s in active]) for name in active[0].conditioning}
        with contextlib.nullcontext() if cache is None else _cached_rows(cache, active):
            predictions = self._predict(torch.cat(inputs), torch.cat(times), conditioning)
        offset = 0
        for sequence, model_input in zip(active, inputs, strict=True):
            rows = predictions[offset:offset + model_input.shape[0]]
            offset += model_input.shape[0]
            if sequence.guided:
                uncond, text = rows.chunk(2)
                rows = uncond + self._cfg_scale(sequence.spec) * (text - uncond)
            t = sequence.timesteps[sequence.done]
            sequence.latents = sequence.scheduler.step(rows, t, sequence.latents, **sequence.step_arguments,
                                                       return_dict=False)[0]
            sequence.done += 1

    def decode(self, sequences: list[Sequence]) -> np.ndarray:
        """The images of finished sequences (n x height x width x 3 floats in [0, 1]), decoded together."""
        raise NotImplementedError


def _cached_rows(cache: RowCache, active: list[Sequence]) -> contextlib.AbstractContextManager[None]:
    """The step cache's rows of one denoiser call: each sequence's negative row (when guided) and
    positive row, in the order the call stacks them."""
    keys: list[tuple[int, str]] = []
    thresholds: list[float] = []
    for sequence in active:
        branches = ("negative", "positive") if sequence.guided else ("positive",)
        keys.extend((sequence.key, branch) for branch in branches)
        thresholds.extend([cache.threshold_for(sequence.spec.cache_threshold)] * len(branches))
    return cache.rows(keys, thresholds)


class StableDiffusionLoop(DenoisingLoop):
    """Stable Diffusion 1.x/2.x: one text encoder, a UNet without a guidance embedding (LCM) or
    image conditioning, the safety checker."""

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
        shape = (1, pipeline.unet.config.in_channels, spec.height // factor, spec.width // factor)
        noise = randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        return timesteps, noise * scheduler.init_noise_sigma

    def _prepare_scheduler(self, scheduler: Any) -> None:
        """What ``__call__`` does to its scheduler after setting the timesteps (SD: nothing)."""

    def _step_arguments(self, generator: torch.Generator) -> dict[str, Any]:
        # eta 0, __call__'s default; every sequence's scheduler is of the class the method inspects.
        return dict(self.pipeline.prepare_extra_step_kwargs(generator, 0.0))

    def _scaled(self, sequence: Sequence, model_input: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = sequence.scheduler.scale_model_input(model_input, t)
        return scaled

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        hidden = conditioning.pop("encoder_hidden_states")
        predicted: torch.Tensor = self.pipeline.unet(inputs, times, encoder_hidden_states=hidden,
                                                     added_cond_kwargs=conditioning or None, return_dict=False)[0]
        return predicted

    def decode(self, sequences: list[Sequence]) -> np.ndarray:
        pipeline = self.pipeline
        latents = torch.cat([s.latents for s in sequences])
        image = pipeline.vae.decode(latents / pipeline.vae.config.scaling_factor, return_dict=False)[0]
        image, nsfw = pipeline.run_safety_checker(image, self.device, latents.dtype)
        denormalize = [True] * image.shape[0] if nsfw is None else [not flagged for flagged in nsfw]
        return np.asarray(pipeline.image_processor.postprocess(image, output_type="np", do_denormalize=denormalize))


class StableDiffusionXLLoop(StableDiffusionLoop):
    """SDXL: two text encoders, pooled embeddings and size micro-conditioning, and its own VAE
    decoding (fp16 upcasting, latents mean and std, the watermark)."""

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
        time_ids = pipeline._get_add_time_ids(size, (0, 0), size, dtype=positive.dtype,
                                              text_encoder_projection_dim=projection).to(self.device)
        if not guided:
            return {"encoder_hidden_states": positive, "text_embeds": pooled, "time_ids": time_ids}
        return {"encoder_hidden_states": torch.cat([negative, positive]),
                "text_embeds": torch.cat([negative_pooled, pooled]), "time_ids": torch.cat([time_ids, time_ids])}

    def decode(self, sequences: list[Sequence]) -> np.ndarray:
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
        return np.asarray(pipeline.image_processor.postprocess(image, output_type="np"))


class StableDiffusion3Loop(DenoisingLoop):
    """SD3: three text encoders, pooled projections, a flow-matching transformer whose scheduler
    may shift its sigmas by the image's size."""

    denoiser = "transformer"

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
        shift: dict[str, Any] = {}  # mu, where the scheduler shifts by the image size
        if scheduler.config.get("use_dynamic_shifting", None):
            patch = pipeline.transformer.config.patch_size
            config = scheduler.config
            shift["mu"] = calculate_shift((latents.shape[2] // patch) * (latents.shape[3] // patch),
                                          config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                                          config.get("base_shift", 0.5), config.get("max_shift", 1.16))
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, self.device, **shift)
        return timesteps, latents

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        predicted: torch.Tensor = self.pipeline.transformer(hidden_states=inputs, timestep=times, return_dict=False,
                                                            **conditioning)[0]
        return predicted

    def decode(self, sequences: list[Sequence]) -> np.ndarray:
        pipeline = self.pipeline
        config = pipeline.vae.config
        latents = torch.cat([s.latents for s in sequences]) / config.scaling_factor + config.shift_factor
        image = pipeline.vae.decode(latents, return_dict=False)[0]
        return np.asarray(pipeline.image_processor.postprocess(image, output_type="np"))


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


def loop_for(pipeline: DiffusionPipeline, device: torch.device) -> DenoisingLoop | None:
    """The step-level loop the family registry declares for the pipeline's family, where it serves this
    pipeline, or None (request-level batching)."""
    # Imported here: the registry names these loop classes, so it imports this module.
    from runner_service.models.families import family_of

    family = family_of(pipeline)
    if family is None or family.loop is None or not family.loop.serves(pipeline):
        return None
    return family.loop(pipeline, device)
