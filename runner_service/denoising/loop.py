"""What every step-level loop shares: a sequence (one image being denoised, with its own
scheduler, timesteps, conditioning and guidance) and the loop's ``start``/``step``/``decode``.
Each family's loop is the ``loop.py`` of its folder (``runner_service.families``), whose registry
finds a loaded pipeline's loop (``loop_for``); this module knows no family.

Every piece is the pipeline's own: ``encode_prompt``, the noise ``prepare_latents`` draws, the
scheduler's class and config, the denoiser, the VAE and the image processor; a loop only does what
``__call__`` does between them, for one timestep of many sequences at once. Diffusers' Modular
blocks run one timestep schedule for the whole batch, so they cannot let a request join at
another's step.

One denoiser call takes every sequence's model input (two rows with classifier-free guidance,
one without), at each row's own timestep; the guidance and the scheduler step are then applied
per sequence, exactly as ``__call__`` applies them to its batch.

Image-to-image and inpainting sequences (``SequenceSpec.source``) start from the input image's
latents noised to the first timestep of the strength's shorter schedule, each made by the task's
own pipeline (derived from the loop's with diffusers' ``from_pipe``, sharing its modules): its
``get_timesteps``, ``prepare_latents``, image and mask processors, run with the sequence's own
scheduler. Their latents are the text-to-image ones' (same channels), so they share denoiser calls
with them; an inpainting sequence is blended with its image's latents after every step, as the
inpainting ``__call__`` blends a UNet or transformer of the standard channels.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from PIL import Image

from runner_service.acceleration.step_cache import StepCache
from runner_service.denoising.controls import (
    ControlledRows,
    ResidualLists,
    Residuals,
    SequenceControl,
    control_residuals,
)
from runner_service.denoising.prompt_cache import Embeddings, PromptCache
from runner_service.denoising.size_turns import SizeTurns
from runner_service.samplers import scheduler_for
from serving_common.generation_params import GenerationParams


@dataclass(frozen=True)
class ImageSource:
    """What an image-to-image or inpainting sequence starts from: the task's pipeline (derived
    from the loop's, ``PipelineAdapter.for_task``), the input image, its strength and, inpainting,
    the mask (white: repainted)."""

    task: str  # "IMAGE_TO_IMAGE" or "INPAINT", as the pipeline adapter names them
    pipeline: DiffusionPipeline
    image: Image.Image
    strength: float
    mask: Image.Image | None = None


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
    # The input image of an image-to-image or inpainting sequence (None: text-to-image).
    source: ImageSource | None = None
    # Its sampler (``runner_service.samplers``): its own scheduler is of that; empty: of the pipeline's.
    sampler: str = ""
    # Its ControlNets (``denoising.controls``), on a family that takes them (``runner_service.controlnets``).
    controls: tuple[SequenceControl, ...] = ()
    # Its image prompt (``runner_service.ip_adapters.ImagePromptInput``), on a family that takes them.
    image_prompt: Any = None

    @classmethod
    def of_request(cls, params: GenerationParams, seed: int, conditioning_key: Hashable, true_cfg: float,
                   source: ImageSource | None = None, image_prompt: Any = None,
                   controls: tuple[SequenceControl, ...] = ()) -> SequenceSpec:
        """The spec of one image of a request (``params``), with its ``seed`` and its ``true_cfg``
        (the request's, else the call's default)."""
        return cls(params.prompt, params.negative_prompt, params.width, params.height, params.num_inference_steps,
                   params.guidance_scale, seed, conditioning_key, true_cfg, params.cache_threshold, source,
                   params.sampler, controls, image_prompt)

    def cache_setting(self, cache: StepCache) -> float:
        """This image's rows' setting in the step cache: the request's where it set one, else the model's."""
        return cache.threshold_for(self.cache_threshold)


class ImagePrompts(Protocol):
    """A model's IP-Adapters as its loop uses them (``runner_service.ip_adapters.IpAdapterSet``):
    each sequence's image embeddings made once at its start, which sequences can share a denoiser
    call, and one call's embeddings and per-row scales."""

    def embed(self, pipeline: Any, prompt: Any, guided: bool, device: torch.device) -> Any: ...

    def sharing(self, prompts: list[Any]) -> list[list[int]]: ...

    def denoiser_call(self, unet: torch.nn.Module,
                      rows: list[tuple[Any, int]]) -> contextlib.AbstractContextManager[None]: ...


@dataclass(frozen=True)
class Inpainting:
    """What an inpainting sequence blends its latents with after each step (``__call__``'s
    ``image_latents``, ``noise`` and ``mask``, shaped as the latents)."""

    image_latents: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor  # 1 where the latents are repainted, 0 where the image's are kept


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
    inpainting: Inpainting | None = None
    done: int = 0
    image_prompt: Any = None  # its image embeddings and scale (``ImagePrompts.embed``); None: no image prompt
    # Each of its ControlNets' own arguments for the rows it reads (``DenoisingLoop._control_inputs``).
    control_inputs: tuple[dict[str, torch.Tensor], ...] = ()

    @property
    def total(self) -> int:
        return len(self.timesteps)

    @property
    def remaining(self) -> int:
        """Denoiser calls left, the next one included."""
        return self.total - self.done

    @property
    def finished(self) -> bool:
        return self.done >= self.total


# The sequences whose part of a step failed, with their errors.
Failures = dict[Sequence, Exception]


class SequencesFailed(Exception):
    """``DenoisingLoop.step`` failed for some sequences, each with its own error; every other
    sequence of the step advanced."""

    def __init__(self, failures: Failures) -> None:
        super().__init__("; ".join(f"{type(error).__name__}: {error}" for error in failures.values()))
        self.failures = failures


@contextlib.contextmanager
def failing_alone(sequence: Sequence, failures: Failures) -> Iterator[None]:
    """A sequence's own part of a step: an error in it is recorded in ``failures`` and fails that
    sequence alone, not the step's other sequences."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - whatever it is, it is this sequence's alone
        failures[sequence] = error


def group_failures(group: list[Sequence], step: Callable[[], Failures]) -> Failures:
    """What ``step`` (one denoiser call of ``group``) failed: its sequences' own failures, or, where
    the shared call itself failed, every sequence of the group with that error."""
    try:
        return step()
    except Exception as error:  # noqa: BLE001 - the call's rows are all its sequences'
        return dict.fromkeys(group, error)


class DenoisingLoop:
    """A family's loop: ``start`` a sequence, ``step`` many at once, ``decode`` the finished."""

    denoiser = "unet"
    # The tasks this loop starts sequences of (others run request-level).
    tasks: ClassVar[frozenset[str]] = frozenset({"TEXT_TO_IMAGE"})
    # A guided sequence's input rows, in the order its conditioning stacks them (their names in the
    # step cache): classifier-free guidance's two, or a family's own (the edit model's three).
    guided_rows: ClassVar[tuple[str, ...]] = ("negative", "positive")
    # The model's IP-Adapters, on a family that takes them (set at load); None: no image prompts.
    image_prompts: ImagePrompts | None = None

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
        task = "TEXT_TO_IMAGE" if spec.source is None else spec.source.task
        key = (spec.conditioning_key, guided, spec.prompt, spec.negative_prompt, spec.width, spec.height, task)
        conditioning = cache.get(version, key, lambda: self._conditioning(spec, guided))
        scheduler = scheduler_for(self.pipeline.scheduler, spec.sampler)
        generator = torch.Generator("cpu").manual_seed(spec.seed)
        dtype = next(iter(conditioning.values())).dtype
        inpainting = None
        # Before the starting latents: Flux's pipelines draw the control images' VAE noise from the
        # image's generator first.
        control_inputs = self._control_inputs(spec, conditioning, guided, generator) if spec.controls else ()
        if spec.source is None:
            timesteps, latents = self._schedule(spec, scheduler, generator, dtype)
            _begins_at_first_step(scheduler)
        else:
            with _scheduled_by(spec.source.pipeline, scheduler):
                timesteps, latents, inpainting = self._image_schedule(spec, spec.source, scheduler, generator, dtype)
        with _scheduled_by(self.pipeline, scheduler):  # the arguments its own scheduler's step takes
            step_arguments = self._step_arguments(generator)
        image_prompt = None
        if spec.image_prompt is not None:
            if self.image_prompts is None:
                raise ValueError(f"{type(self.pipeline).__name__} takes no IP-Adapters")
            image_prompt = self.image_prompts.embed(self.pipeline, spec.image_prompt, guided, self.device)
        return Sequence(spec, scheduler, timesteps, latents, conditioning, guided, step_arguments,
                        next(self._keys), inpainting, image_prompt=image_prompt, control_inputs=control_inputs)

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

    def _image_schedule(self, spec: SequenceSpec, source: ImageSource, scheduler: Any, generator: torch.Generator,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, Inpainting | None]:
        """An image-to-image or inpainting sequence's timesteps (the strength's shorter schedule),
        initial latents (its image's, noised to the first of them) and, inpainting, what it blends
        with after each step: as the task's ``__call__`` makes them, with ``source.pipeline``'s
        own methods, whose scheduler is the sequence's meanwhile. Only for the loop's ``tasks``."""
        raise NotImplementedError

    def _noised(self, scheduler: Any, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The image's latents noised to timestep ``t``, as the inpainting ``__call__`` noises them."""
        raise NotImplementedError

    def _step_arguments(self, generator: torch.Generator) -> dict[str, Any]:
        return {}

    def _predict(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> torch.Tensor:
        raise NotImplementedError

    def _scaled(self, sequence: Sequence, model_input: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model_input

    def step(self, sequences: list[Sequence], cache: StepCache | None = None, turns: SizeTurns | None = None) -> None:
        """Advances every unfinished sequence by one of its own timesteps: one denoiser call per
        size group (sequences of one size share a call; groups of other sizes run in turn, in order
        of their first sequence). With ``turns``, only the groups whose turn it is by their compute
        advance. With the model's step cache, each sequence's rows keep their own cached state.

        A sequence whose own part of the step fails (its scheduler's step, its input's scaling) fails
        alone, and a failed denoiser call fails the sequences of that call: the others still advance,
        and then ``SequencesFailed`` names the failed ones (left as they were)."""
        active = [s for s in sequences if not s.finished]
        if cache is not None:
            cache.retain({key for sequence in active for key in _row_keys(sequence, self.guided_rows)})
        groups: dict[Hashable, list[Sequence]] = {}
        for sequence in active:
            groups.setdefault(tuple(sequence.latents.shape), []).append(sequence)
        if turns is not None:
            # A group's call costs its rows times their latent elements.
            due = turns.due({shape: sum(len(_row_keys(s, self.guided_rows)) * s.latents.numel() for s in group)
                             for shape, group in groups.items()})
            groups = {shape: groups[shape] for shape in due}
        failures: Failures = {}
        for group in groups.values():
            for part in self._sharing(group):
                failures.update(group_failures(part, functools.partial(self._step_group, part, cache)))
        if failures:
            raise SequencesFailed(failures)

    def _step_group(self, group: list[Sequence], cache: StepCache | None) -> Failures:
        """One denoiser call of ``group`` and each sequence's scheduler step; the sequences whose
        own part failed, with their errors (an error of the call itself is raised)."""
        failures: Failures = {}
        prepared: list[tuple[Sequence, torch.Tensor, torch.Tensor]] = []
        for sequence in group:
            with failing_alone(sequence, failures):
                t = sequence.timesteps[sequence.done]
                model_input = (torch.cat([sequence.latents] * len(self.guided_rows)) if sequence.guided
                               else sequence.latents)
                prepared.append((sequence, self._scaled(sequence, model_input, t), t))
        if not prepared:
            return failures
        stepped = [sequence for sequence, _, _ in prepared]
        conditioning = self._merged([s.conditioning for s in stepped])
        inputs = torch.cat([model_input for _, model_input, _ in prepared])
        times = torch.cat([t.reshape(1).expand(model_input.shape[0]) for _, model_input, t in prepared])
        residuals = self._control_residuals(prepared, inputs, times, conditioning)
        prompted = (contextlib.nullcontext() if self.image_prompts is None else self.image_prompts.denoiser_call(
            getattr(self.pipeline, self.denoiser), [(s.image_prompt, m.shape[0]) for s, m, _ in prepared]))
        branch_rows = [(sequence, branch) for sequence in stepped for branch in _branches(sequence, self.guided_rows)]
        with contextlib.nullcontext() if cache is None else cached_rows(cache, branch_rows), prompted:
            predictions = (self._predict(inputs, times, conditioning) if residuals is None
                           else self._predict_controlled(inputs, times, conditioning, residuals))
        offset = 0
        for sequence, model_input, t in prepared:
            rows = predictions[offset:offset + model_input.shape[0]]
            offset += model_input.shape[0]
            with failing_alone(sequence, failures):
                if sequence.guided:
                    rows = self._guided(sequence, *rows.chunk(len(self.guided_rows)))
                sequence.latents = sequence.scheduler.step(rows, t, sequence.latents, **sequence.step_arguments,
                                                           return_dict=False)[0]
                if sequence.inpainting is not None:
                    sequence.latents = self._blended(sequence, sequence.inpainting)
                sequence.done += 1
        return failures

    def _control_residuals(self, prepared: list[tuple[Sequence, torch.Tensor, torch.Tensor]], inputs: torch.Tensor,
                           times: torch.Tensor, conditioning: Embeddings) -> Residuals | None:
        """The ControlNet residuals of one denoiser call's rows (``denoising.controls``); None where
        no sequence of the call has a ControlNet on at its step."""
        controlled, first = [], 0
        for sequence, model_input, _ in prepared:
            if sequence.spec.controls:
                controlled.append(ControlledRows(sequence.spec.controls, sequence.control_inputs, sequence.done,
                                                 sequence.total, first, self._control_sources(model_input.shape[0])))
            first += model_input.shape[0]
        if not controlled:
            return None

        def run(net: torch.nn.Module, rows: torch.Tensor, arguments: dict[str, torch.Tensor]) -> ResidualLists:
            return self._run_controlnet(net, rows, arguments, inputs, times, conditioning)

        return control_residuals(controlled, inputs.shape[0], inputs.device, run, self._spread_residuals)

    def _control_inputs(self, spec: SequenceSpec, conditioning: Embeddings, guided: bool,
                        generator: torch.Generator) -> tuple[dict[str, torch.Tensor], ...]:
        """Each of ``spec``'s ControlNets' own arguments for the rows it reads (its conditioning image
        as the family's ControlNet pipeline prepares it), made once at the sequence's start."""
        raise ValueError(f"{type(self.pipeline).__name__} takes no ControlNets")

    def _control_sources(self, rows: int) -> tuple[int, ...]:
        """For each of a sequence's ``rows`` rows, the row whose ControlNet residuals it takes: its own."""
        return tuple(range(rows))

    def _run_controlnet(self, net: torch.nn.Module, rows: torch.Tensor, arguments: dict[str, torch.Tensor],
                        inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings) -> ResidualLists:
        """One ControlNet on ``rows`` of the call's inputs with its ``arguments``: its residual lists at scale 1."""
        raise NotImplementedError

    def _spread_residuals(self, position: int, residuals: list[torch.Tensor]) -> list[torch.Tensor]:
        """Residual list ``position`` as the denoiser reads it, one per block (for ControlNets of other depths)."""
        raise NotImplementedError(f"{type(self.pipeline).__name__}'s ControlNets all have one depth")

    def _predict_controlled(self, inputs: torch.Tensor, times: torch.Tensor, conditioning: Embeddings,
                            residuals: Residuals) -> torch.Tensor:
        """``_predict`` with ControlNet residuals added to the denoiser's blocks."""
        raise NotImplementedError

    def _sharing(self, group: list[Sequence]) -> list[list[Sequence]]:
        """The denoiser calls a group of one size takes: one, unless their image prompts need more
        (``ImagePrompts.sharing``)."""
        if self.image_prompts is None:
            return [group]
        return [[group[index] for index in call]
                for call in self.image_prompts.sharing([sequence.image_prompt for sequence in group])]

    def _guided(self, sequence: Sequence, uncond: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """The sequence's guided prediction at its step from its two rows: classifier-free guidance."""
        return uncond + self._cfg_scale(sequence.spec) * (text - uncond)

    def _blended(self, sequence: Sequence, inpainting: Inpainting) -> torch.Tensor:
        """The inpainting ``__call__``'s blend after step ``done``: the image's latents, noised to
        the next timestep (none after the last), where the mask keeps them."""
        proper = inpainting.image_latents
        if sequence.done < sequence.total - 1:
            proper = self._noised(sequence.scheduler, proper, inpainting.noise,
                                  sequence.timesteps[sequence.done + 1].reshape(1))  # on the device: no read back
        blended: torch.Tensor = (1 - inpainting.mask) * proper + inpainting.mask * sequence.latents
        return blended

    def _merged(self, conditionings: list[Embeddings]) -> Embeddings:
        """One denoiser call's conditioning from its sequences' (each one row per input row), in
        order. A family whose prompts encode to different lengths pads them here, with a mask."""
        return {name: torch.cat([conditioning[name] for conditioning in conditionings])
                for name in conditionings[0]}

    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        """The images of finished sequences (n x height x width x 3 floats in [0, 1]), decoded together,
        on the device (``device_output``: they leave it as uint8)."""
        raise NotImplementedError


def _begins_at_first_step(scheduler: Any) -> None:
    """A text-to-image schedule starts at its first timestep: where the scheduler counts its step
    index and no begin index is set yet, it is set to 0, so its first ``step`` does not look the
    timestep up in the schedule (``index_for_timestep``: a ``nonzero`` and an ``item`` on the
    device's timesteps, a host sync). The lookup finds index 0 for a first timestep that occurs
    once, as every sampler's schedule has it."""
    if hasattr(scheduler, "set_begin_index") and getattr(scheduler, "begin_index", 0) is None:
        scheduler.set_begin_index(0)


@contextlib.contextmanager
def _scheduled_by(pipeline: DiffusionPipeline, scheduler: Any) -> Iterator[None]:
    """The pipeline's methods (``get_timesteps``, ``prepare_latents``) run with a sequence's own
    scheduler in place of the shared one, on the device thread, which runs one thing at a time."""
    shared = pipeline.scheduler
    pipeline.scheduler = scheduler
    try:
        yield
    finally:
        pipeline.scheduler = shared


def masked_prompts(pipeline: DiffusionPipeline, spec: SequenceSpec, guided: bool, device: torch.device,
                   encoding: dict[str, Any]) -> Embeddings:
    """One image's conditioning where ``encode_prompt`` returns the embeddings with their attention
    masks, negative ones after (PixArt, Sana, Lumina2): a row each, the negative first."""
    positive, mask, negative, negative_mask = pipeline.encode_prompt(
        [spec.prompt], guided, negative_prompt=[spec.negative_prompt], num_images_per_prompt=1, device=device,
        **encoding)
    if not guided:
        return {"encoder_hidden_states": positive, "encoder_attention_mask": mask}
    return {"encoder_hidden_states": torch.cat([negative, positive]),
            "encoder_attention_mask": torch.cat([negative_mask, mask])}


def _branches(sequence: Sequence, guided_rows: tuple[str, ...]) -> tuple[str, ...]:
    """A sequence's rows in a denoiser call, in the order it stacks them: its loop's ``guided_rows``
    when guided, else its positive row alone."""
    return guided_rows if sequence.guided else ("positive",)


def _row_keys(sequence: Sequence, guided_rows: tuple[str, ...]) -> list[tuple[int, str]]:
    """A sequence's rows in the step cache, in the order a call stacks them."""
    return [(sequence.key, branch) for branch in _branches(sequence, guided_rows)]


def cached_rows(cache: StepCache, rows: list[tuple[Sequence, str]]) -> contextlib.AbstractContextManager[None]:
    """The step cache's rows of one denoiser call, in order: each (sequence, branch) named
    ``(sequence.key, branch)``, with its sequence's threshold and denoiser calls left (this one
    included)."""
    return cache.rows([(sequence.key, branch) for sequence, branch in rows],
                      [sequence.spec.cache_setting(cache) for sequence, _ in rows],
                      [sequence.remaining for sequence, _ in rows])
