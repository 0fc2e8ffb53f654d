"""Step-level (continuous) batching: requests join the running batch at the next step boundary
and leave when their own steps are done.

One asyncio task, the loop, holds the device (through the runner's ``DeviceGate``) while any
request runs, and runs one step at a time on the device thread: it admits waiting submissions
(one Execute's items each, all or none), advances every running sequence by one of its own
timesteps in one denoiser call, decodes the sequences that finished and hands each submission its
progress and, when all its images are done, its result.

Admission is FIFO: a submission joins when it has the running batch's adapters (which every
denoiser call of a step shares) and the batch has room (``--max-batch-images``); once the oldest
waiting submission has other adapters, nothing more joins, the batch drains and the next adapters
start. Sizes mix: a step runs one denoiser call per size group, so a small image need not wait
for a batch of large ones to drain. Image-to-image and inpainting sequences (where the model's loop
runs them) start from their input image, with the strength's shorter schedule, and share the
denoiser calls of text-to-image ones. An exclusive user of the gate (LoadWeights, Sleep, a
request-level execution...) stops admission too, so it runs once the batch has drained, never
mid-step.

The device thread runs consecutive steps itself while nothing changes for the event loop to act
on: no submission arrived and no call ended (``_changed``, a thread-safe flag the event loop sets),
and the step finished and failed nothing. Each of those steps hands its progress (the steps a
call's ``progress_pacing`` lets through) to the event loop with ``call_soon_threadsafe`` without
waiting for it; the device thread returns to the loop (which drops what was cancelled, admits,
delivers results) only when something changed, so a request still joins, and a cancelled one still
leaves, at the next step boundary. An exclusive user announced changes nothing for the running
batch (it waits for it to drain), only admission.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from PIL import Image

from diffusion.v1 import common_pb2, runner_pb2
from runner_service.controlnets import sequence_controls
from runner_service.denoising.controls import SequenceControl
from runner_service.denoising.loop import DenoisingLoop, ImageSource, Sequence, SequencesFailed, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.denoising.size_turns import SizeTurns
from runner_service.device_gate import DeviceGate
from runner_service.device_output import ToHost, as_pixels, plain_copy
from runner_service.execution import (
    BatchResult,
    ImageOutput,
    StepProgress,
    image_inputs_of,
    keep_unmasked,
    preview_targets,
    task_name,
    validate_batch,
)
from runner_service.ip_adapters import ImagePromptInput, prompt_of
from runner_service.limits import BatchLimits
from runner_service.loaded_model import LoadedModel
from runner_service.overrun import Abandonment
from runner_service.phase_timing import DECODE, DENOISE, TEXT_ENCODE, TO_HOST, Clock, PhaseSpans
from runner_service.pipeline_adapter import ImageInputs
from runner_service.previews import LatentPreview, Preview, take_previews
from runner_service.progress_pacing import ProgressPacing
from serving_common.errors import ServiceError
from serving_common.generation_params import GenerationParams
from serving_common.protocol import image_seed

logger = logging.getLogger(__name__)

Event = StepProgress | BatchResult | BaseException


def batch_adapters(items: list[runner_pb2.ExecuteItem]) -> tuple[tuple[str, float], ...]:
    """What every denoiser call of a step shares across its rows: the active adapters."""
    return GenerationParams.from_item(items[0]).adapters


@dataclass(eq=False)
class _Submission:
    items: list[runner_pb2.ExecuteItem]
    pacing: ProgressPacing | None  # which steps' progress it is sent; None: none
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    sequences: list[Sequence] = field(default_factory=list)
    inputs: ImageInputs | None = None  # image-to-image and inpainting: one input image (and mask) per image
    weights_version: str = ""
    started: float = 0.0
    reported: int = 0  # the last step reached (sent as progress when paced so); set on the device thread
    abandoned: Abandonment = field(default_factory=Abandonment)  # set when its call ends
    spans: PhaseSpans = field(default_factory=PhaseSpans)  # its phases: its start, the steps it was in, its decode

    @property
    def cancelled(self) -> bool:
        return self.abandoned.is_set()

    @property
    def images(self) -> int:
        return sum(item.num_images for item in self.items)

    @functools.cached_property
    def adapters(self) -> tuple[tuple[str, float], ...]:
        """Read once: admission compares the running batch's at every step."""
        return batch_adapters(self.items)


@dataclass
class _StepOutcome:
    """What one step did, for the event loop to deliver."""

    failed: list[tuple[_Submission, BaseException]] = field(default_factory=list)
    finished: list[tuple[_Submission, list[ImageOutput]]] = field(default_factory=list)
    progress: list[tuple[_Submission, StepProgress]] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        """Whether the step ended no submission: the device thread may go on to the next step."""
        return not (self.failed or self.finished)


class StepEngine:
    """Runs the submissions of step-batched models; ``execute`` is one Execute call's view."""

    def __init__(self, gate: DeviceGate, current_model: Callable[[], LoadedModel], limits: BatchLimits,
                 cache: PromptCache, turns: SizeTurns | None = None, clock: Clock | None = None,
                 to_host: ToHost = plain_copy) -> None:
        self._gate = gate
        self._clock = clock  # the platform's ``time_point`` for the phases; None: the host's clock
        self._to_host = to_host  # the platform's copy of the finished images to the host
        self._current_model = current_model
        self._limits = limits
        self.cache = cache
        self._turns = turns  # --step-schedule budget: size groups take turns by their compute
        self._waiting: deque[_Submission] = deque()
        self._running: list[_Submission] = []
        self._loop_task: asyncio.Task[None] | None = None
        # Set on the event loop when a submission arrives or a call ends; the device thread, running
        # consecutive steps, returns to the event loop when it is set.
        self._changed = threading.Event()

    async def execute(self, items: list[runner_pb2.ExecuteItem],
                      pacing: ProgressPacing | None) -> AsyncGenerator[StepProgress | BatchResult, None]:
        """Yields the submission's progress (the steps ``pacing`` lets through) and then its result;
        closing it early (the call was cancelled) takes its sequences out of the batch at the next
        step boundary."""
        submission = _Submission(items, pacing)
        self._waiting.append(submission)
        self._changed.set()
        self._ensure_loop()
        try:
            while True:
                event = await submission.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, BatchResult):
                    return
        finally:
            submission.abandoned.set()
            self._changed.set()

    def _ensure_loop(self) -> None:
        if (self._loop_task is None or self._loop_task.done()) and (self._waiting or self._running):
            self._loop_task = asyncio.create_task(self._run(), name="step-level batching")

    async def _run(self) -> None:
        while self._waiting or self._running:
            # The gate lets the loop in while no exclusive user is announced; the loop lets go once
            # one is and the running batch has drained.
            async with self._gate.steps():
                while self._running or (self._waiting and not self._gate.exclusive_waiting):
                    self._changed.clear()  # before the checks: what changes after them ends the next steps
                    self._drop_cancelled()
                    admitted = self._admit()
                    if not self._running:
                        break
                    steps = functools.partial(self._steps, admitted, asyncio.get_running_loop())
                    try:
                        outcome = await self._gate.run(steps, [s.abandoned for s in self._running])
                    except Exception as error:  # noqa: BLE001 - the step failed: so did every request in it
                        logger.exception("a denoising step failed for %d request(s)", len(self._running))
                        outcome = _StepOutcome(failed=[(s, _status(error)) for s in self._running])
                    self._deliver(outcome)

    def _drop_cancelled(self) -> None:
        """Takes the submissions whose call ended out of the batch, after the step they reached, and
        out of the queue: one line each, whether it was running or waiting (after step 0)."""
        for submission in [s for s in (*self._running, *self._waiting) if s.cancelled]:
            logger.info("stopped %s after step %d: the call ended",
                        ",".join(item.request_id for item in submission.items), submission.reported)
        self._running = [s for s in self._running if not s.cancelled]
        self._waiting = deque(s for s in self._waiting if not s.cancelled)

    def _admit(self) -> list[_Submission]:
        """Moves the waiting submissions that join now to the running batch (FIFO, same adapters, room)."""
        admitted: list[_Submission] = []
        room = self._limits.max_batch_images - sum(s.images for s in self._running)
        adapters = self._running[0].adapters if self._running else None
        while self._waiting and not self._gate.exclusive_waiting:
            head = self._waiting[0]
            if (adapters is not None and head.adapters != adapters) or head.images > room:
                break
            self._waiting.popleft()
            adapters, room = head.adapters, room - head.images
            admitted.append(head)
            self._running.append(head)
        return admitted

    def _steps(self, admitted: list[_Submission], loop: asyncio.AbstractEventLoop) -> _StepOutcome:
        """In the device thread: one step, then more while nothing changed (no submission arrived,
        no call ended, the step ended no submission), each one's progress handed to the event loop
        without waiting; returns the outcome of the step after which something changed."""
        outcome = self._step(admitted)
        while outcome.settled and not self._changed.is_set():
            if outcome.progress:  # a step whose progress no call is sent wakes nothing
                loop.call_soon_threadsafe(self._deliver, outcome)
            outcome = self._step([])
        return outcome

    def _step(self, admitted: list[_Submission]) -> _StepOutcome:
        """In the device thread: starts the admitted submissions' sequences, runs one step of all,
        decodes what finished."""
        outcome = _StepOutcome()
        model = self._current_model()
        for submission in admitted:
            if submission.cancelled:  # its call ended since it was admitted: left at the next boundary
                continue
            try:
                self._start(model, submission)
            except Exception as error:  # noqa: BLE001 - refused alone; the batch goes on
                outcome.failed.append((submission, error))
        failed = {id(s) for s, _ in outcome.failed}
        running = [s for s in self._running if id(s) not in failed and not s.cancelled]
        loop = _loop_of(model)
        with torch.inference_mode():
            stepped = [sequence for submission in running for sequence in submission.sequences]
            before = {id(sequence): sequence.done for sequence in stepped}
            began, step_start = time.perf_counter(), self._spans().clock()
            try:
                loop.step(stepped, model.row_cache, self._turns)
            except SequencesFailed as step_failed:  # those submissions fail alone; the others advanced
                broken = {id(sequence): error for sequence, error in step_failed.failures.items()}
                failing = [s for s in running if any(id(q) in broken for q in s.sequences)]
                running = [s for s in running if s not in failing]
                for submission in failing:
                    own = next(broken[id(q)] for q in submission.sequences if id(q) in broken)
                    outcome.failed.append((submission, _failed_alone(submission, own, len(running))))
            _measured(model, stepped, time.perf_counter() - began, "step_ms")
            step_end = self._spans().clock()
            for submission in running:
                submission.spans.add(DENOISE, step_start, step_end)
            preview = model.preview
            for submission in running:
                first = submission.sequences[0]
                if first.done > submission.reported:
                    pacing = submission.pacing
                    if pacing is not None:
                        taken = () if preview is None else _previews(preview, submission, before)
                        if pacing.due(first.done, first.total, common_pb2.PROGRESS_PHASE_DENOISING, bool(taken)):
                            outcome.progress.append((submission, StepProgress(
                                first.done, first.total, (time.perf_counter() - submission.started) * 1000,
                                previews=taken)))
                    submission.reported = first.done
            done = [s for s in running if all(sequence.finished for sequence in s.sequences)]
            finished = [sequence for submission in done for sequence in submission.sequences]
            began, decoding = time.perf_counter(), self._spans()
            try:
                pixels = decode_finished(loop, finished, decoding, self._to_host)
            except Exception as error:  # noqa: BLE001 - what finished fails; the others go on
                outcome.failed.extend((submission, _failed_alone(submission, error, len(running) - len(done)))
                                      for submission in done)
                return outcome
            _measured(model, finished, time.perf_counter() - began, "decode_ms")
            for submission in done:
                submission.spans.extend(decoding)
                images = np.stack([pixels[id(sequence)] for sequence in submission.sequences])
                if submission.inputs is not None and submission.inputs.masks is not None:
                    images = keep_unmasked(images, submission.inputs)  # as a request-level inpainting
                outcome.finished.append((submission, [
                    ImageOutput(item.request_id, image_seed(item.seed, index), image)
                    for (item, index), image in zip(_images_of(submission), images, strict=True)]))
        return outcome

    def _start(self, model: LoadedModel, submission: _Submission) -> None:
        validate_batch(submission.items, self._limits, model)
        model.require_awake()
        if not self._running or self._running[0] is submission:
            # The first of a batch: its adapters are the batch's (every submission in it has them).
            model.adapters.activate(model.pipeline, list(submission.adapters))
        adapters = tuple((name, model.adapters.registered[name].digest, scale)
                         for name, scale in submission.adapters)
        model.ip_adapters.activate(model.pipeline, [item.ip_adapter.name for item in submission.items
                                                    if item.HasField("ip_adapter")])
        loop = _loop_of(model)
        version = model.weights_version
        submission.weights_version, submission.started = version, time.perf_counter()
        submission.inputs = image_inputs_of(submission.items)
        sources = _sources(model, submission.items, submission.inputs)
        in_use = {control.name for running in self._running for item in running.items for control in item.controls}
        controls = {id(item): sequence_controls(model.controlnets, model.pipeline, item, in_use)
                    for item in submission.items}
        submission.spans = self._spans()
        with submission.spans.span(TEXT_ENCODE):  # the prompts (what the cache lacks) and the start latents
            submission.sequences = [
                loop.start(_spec(GenerationParams.from_item(item), index, adapters, model, source, prompt_of(item),
                                 controls[id(item)]), self.cache, version)
                for (item, index), source in zip(_images_of(submission), sources, strict=True)]

    def _spans(self) -> PhaseSpans:
        return PhaseSpans() if self._clock is None else PhaseSpans(self._clock)

    def _deliver(self, outcome: _StepOutcome) -> None:
        """On the event loop: what a step failed, its progress, then its results."""
        for submission, error in outcome.failed:
            self._leave(submission)
            submission.events.put_nowait(error)
        for submission, progress in outcome.progress:
            submission.events.put_nowait(progress)
        for submission, outputs in outcome.finished:
            self._leave(submission)
            submission.events.put_nowait(BatchResult(outputs, submission.weights_version,
                                                     (time.perf_counter() - submission.started) * 1000,
                                                     submission.spans.resolve()))

    def _leave(self, submission: _Submission) -> None:
        if submission in self._running:
            self._running.remove(submission)


def _measured(model: LoadedModel, sequences: list[Sequence], seconds: float, what: str) -> None:
    """What one image cost in a step (``step_ms``) or a decode (``decode_ms``) of ``sequences``, where
    all are of one size (``model.costs``; a step of several sizes says nothing of each)."""
    sizes = {(sequence.spec.width, sequence.spec.height) for sequence in sequences}
    if len(sizes) == 1:
        width, height = sizes.pop()
        model.costs.observe(width * height, **{what: seconds * 1000 / len(sequences)})


def decode_finished(loop: DenoisingLoop, sequences: list[Sequence], spans: PhaseSpans | None = None,
                    to_host: ToHost = plain_copy) -> dict[int, np.ndarray]:
    """The finished sequences' images as uint8 on the host, by ``id`` of sequence: decoded together
    per size (a VAE decodes one size at a time), converted to uint8 on the device and copied with
    ``to_host`` (the platform's), one copy per size. ``spans`` gets the decodes (the VAE and the
    conversion) and the copies."""
    spans = spans or PhaseSpans()
    groups: dict[tuple[int, ...], list[Sequence]] = {}
    for sequence in sequences:
        groups.setdefault(tuple(sequence.latents.shape), []).append(sequence)
    pixels = {}
    for group in groups.values():
        with spans.span(DECODE):
            decoded = as_pixels(loop.decode(group))
        with spans.span(TO_HOST):
            images = to_host(decoded)
        pixels.update({id(sequence): image for sequence, image in zip(group, images, strict=True)})
    return pixels


def _status(error: BaseException) -> ServiceError:
    """A step's failure as its requests' status: a refusal as it is, anything else INTERNAL."""
    if isinstance(error, ServiceError):
        return error
    return ServiceError(grpc.StatusCode.INTERNAL, f"denoising failed: {type(error).__name__}: {error}")


def _failed_alone(submission: _Submission, error: BaseException, others: int) -> ServiceError:
    """One submission's own failure in a step that ``others`` submissions go on from: logged with its requests."""
    logger.error("denoising failed for %s alone; %d other request(s) of its step batch go on",
                 ",".join(item.request_id for item in submission.items), others, exc_info=error)
    return _status(error)


def _previews(preview: LatentPreview, submission: _Submission, before: dict[int, int]) -> tuple[Preview, ...]:
    """The previews the submission's images take at the step just run: of each sequence that
    advanced in it (a size group may sit a step out: ``SizeTurns``), where its item asks for them."""
    targets = preview_targets(submission.items)
    return tuple(taken for target, sequence in zip(targets, submission.sequences, strict=True)
                 if target.count and sequence.done != before.get(id(sequence))
                 for taken in take_previews(preview, [target], sequence.latents, sequence.done, sequence.total))


def _images_of(submission: _Submission) -> list[tuple[runner_pb2.ExecuteItem, int]]:
    return [(item, index) for item in submission.items for index in range(item.num_images)]


def _sources(model: LoadedModel, items: list[runner_pb2.ExecuteItem],
             inputs: ImageInputs | None) -> list[ImageSource | None]:
    """Each image's input image (and mask) with the task's pipeline, in the order of ``_images_of``;
    None for each of a text-to-image submission."""
    if inputs is None:
        return [None] * sum(item.num_images for item in items)
    task = task_name(items[0])
    pipeline = model.adapter.for_task(task).pipeline
    strength = 1.0 if inputs.strength is None else inputs.strength  # an edit takes none: its whole schedule
    masks: list[Image.Image | None] = [None] * len(inputs.images) if inputs.masks is None else list(inputs.masks)
    return [ImageSource(task, pipeline, image, strength, mask)
            for image, mask in zip(inputs.images, masks, strict=True)]


def _spec(params: GenerationParams, index: int, adapters: tuple[tuple[str, str, float], ...], model: LoadedModel,
          source: ImageSource | None, image_prompt: ImagePromptInput | None = None,
          controls: tuple[SequenceControl, ...] = ()) -> SequenceSpec:
    """The step loop's sequence of image ``index`` of a request; an unset true_cfg_scale is the call's
    default (as a pipeline call gets it)."""
    true_cfg = model.capabilities.default_true_cfg if params.true_cfg_scale is None else params.true_cfg_scale
    return SequenceSpec.of_request(params, image_seed(params.seed, index), adapters, true_cfg, source, image_prompt,
                                   controls)


def _loop_of(model: LoadedModel) -> DenoisingLoop:
    if model.loop is None:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "this model has no step-level loop")
    return model.loop
