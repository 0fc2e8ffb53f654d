"""IP-Adapters of the loaded model (issue 39 item 3): image prompts per request, registered by name,
loaded with diffusers' own ``load_ip_adapter`` and run by its own attention processors.

An IP-Adapter is a directory as ``load_ip_adapter`` reads it: ``ip_adapter.safetensors`` (its image
projection and the ``to_k_ip``/``to_v_ip`` of every cross-attention layer) beside an
``image_encoder`` folder (a CLIP vision model). Stable Diffusion 1.x/2.x and SDXL UNets take them.

Residency: every registered IP-Adapter is on the UNet at once, as diffusers' multi-IP-Adapter (one
``load_ip_adapter`` call with the list; each adapter one slot of every IP attention processor and of
the UNet's image projection). They are loaded when the first batch needs one, and again after a
registration changes the set or a level-2 sleep took them off (the UNet's own parameters are then
its checkpoint's again). Keeping them all resident lets rows of different IP-Adapters share one
UNet call in a step batch, and a request never waits for a load; the cost is each adapter's own
layers (a few percent of the UNet). diffusers loads one image encoder for the set, the first
adapter's: adapters registered together must have the same image encoder (the same bytes), which the
IP-Adapters of one model family and encoder (h94's ViT-H or bigG ones) do.

Per row: an image's embeddings are computed once when its sequence starts, by the pipeline's own
``prepare_ip_adapter_image_embeds`` (classifier-free guidance's negative as the pipeline makes it).
diffusers' processors take one scale per adapter for the whole batch; here each slot's scale is a
``RowScales`` for the call: every row's own scale (0 where the row has another adapter or none), so
one UNet call serves rows of different adapters, scales and none. A row at scale 0 adds exactly
zero to its attention output, and its zero image embeddings go through the projection only to be
multiplied by it: the row's image is its plain one.

Every method runs on the runner's device thread, under its device lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from diffusers.models.attention_processor import IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import StableDiffusionXLPipeline
from PIL import Image

from diffusion.v1 import common_pb2, runner_pb2
from runner_service.adapter_stores import AdapterSource, SourceFiles
from runner_service.model_roots import ModelRoots
from runner_service.pipeline_adapter import short_reason
from serving_common.conditioning_rules import MAX_PROMPT_IMAGES, count_problem, scale_problem, wrong_kind
from serving_common.errors import ServiceError, failed_precondition, invalid_argument, not_found

logger = logging.getLogger(__name__)

# An IP-Adapter directory, as ``load_ip_adapter`` reads it.
WEIGHTS_FILE = "ip_adapter.safetensors"
ENCODER_FOLDER = "image_encoder"
# The pipelines whose UNet takes IP-Adapters here (their image-to-image pipelines share it).
_PIPELINES = (StableDiffusionPipeline, StableDiffusionXLPipeline)
_PROCESSORS = (IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0)


def takes_ip_adapters(pipeline: Any) -> bool:
    """Whether the loaded pipeline serves IP-Adapters (ModelCapabilities.adapter_kinds)."""
    return isinstance(pipeline, _PIPELINES)


@dataclass
class IpAdapter:
    name: str
    path: Path
    digest: str  # of its weights file and its image encoder's files
    encoder_digest: str
    parameter_bytes: int = 0  # its own layers on the UNet and its image encoder
    resident: bool = False
    requests: int = 0

    def info(self) -> common_pb2.AdapterInfo:
        return common_pb2.AdapterInfo(name=self.name, path=str(self.path), kind=common_pb2.ADAPTER_KIND_IP_ADAPTER,
                                      components=["unet", "image_encoder"], digest=self.digest,
                                      resident=self.resident, parameter_bytes=self.parameter_bytes,
                                      requests=self.requests)


@dataclass(frozen=True)
class ImagePromptInput:
    """What one image of a request asks: its IP-Adapter, reference images and scale."""

    name: str
    images: tuple[Image.Image, ...]
    scale: float


@dataclass(frozen=True)
class RowImagePrompt:
    """One sequence's image prompt, computed when it starts: its adapter, its image embeddings (one
    row per input row of the sequence, the negative first when guided) and its scale."""

    name: str
    embeds: torch.Tensor
    scale: float

    @property
    def images(self) -> int:
        return int(self.embeds.shape[1])


class RowScales:
    """One slot's scale in one UNet call, per row, in place of the float diffusers' IP-Adapter
    processors hold: ``scale == 0`` (the processor skips the adapter) when every row's is 0, and
    ``scale * attention`` scales each row by its own (rows at 0 add exactly zero)."""

    def __init__(self, scales: Sequence[float], device: torch.device) -> None:
        self._groups = [(value, torch.tensor([row for row, scale in enumerate(scales) if scale == value],
                                             device=device))
                        for value in sorted(set(scales)) if value != 0]

    def __eq__(self, other: object) -> bool:
        return other == 0 and not self._groups

    __hash__ = None  # type: ignore[assignment]

    def __mul__(self, attention: torch.Tensor) -> torch.Tensor:
        scaled = torch.zeros_like(attention)
        for value, rows in self._groups:
            scaled[rows] = attention[rows] * value
        return scaled


def prompt_of(item: runner_pb2.ExecuteItem) -> ImagePromptInput | None:
    """An item's image prompt with its reference images decoded; None without one."""
    if not item.HasField("ip_adapter"):
        return None
    prompt = item.ip_adapter
    images = tuple(Image.frombytes("RGB", (raw.width, raw.height), raw.pixels) for raw in prompt.images)
    return ImagePromptInput(prompt.name, images, prompt.scale)


def item_violations(item: runner_pb2.ExecuteItem) -> list[tuple[str, str | None]]:
    """(field, why or None) for an item's image prompt: its scale, how many images, their bytes."""
    if not item.HasField("ip_adapter"):
        return []
    prompt = item.ip_adapter
    checked: list[tuple[str, str | None]] = [
        ("ip_adapter.scale", scale_problem(prompt.scale)),
        ("ip_adapter.images", "at least one reference image" if not prompt.images
         else count_problem(len(prompt.images), MAX_PROMPT_IMAGES, "reference images")),
    ]
    for index, raw in enumerate(prompt.images[:MAX_PROMPT_IMAGES]):
        if raw.channels != 3 or raw.width < 1 or raw.height < 1 or len(raw.pixels) != raw.width * raw.height * 3:
            got = f"{raw.width}x{raw.height}x{raw.channels} in {len(raw.pixels)}"
            checked.append((f"ip_adapter.images[{index}]", f"must be width x height x 3 bytes, got {got}"))
    return checked


def _directory_digest(roots: ModelRoots, directory: Path, max_bytes: int) -> tuple[str, str]:
    """The digest of an IP-Adapter directory's weights file and image encoder, and of the encoder alone;
    every entry checked inside the roots, at most ``max_bytes`` read."""
    size = roots.model_tree(directory, "path")
    if size > max_bytes:
        raise invalid_argument({"path": f"{directory} holds {size} bytes; this runner reads at most {max_bytes} "
                                        "per LoadAdapter (--max-weights-bytes)"})
    weights = directory / WEIGHTS_FILE
    encoder = directory / ENCODER_FOLDER
    if not weights.is_file() or not (encoder / "config.json").is_file():
        raise invalid_argument({"path": f"{directory} is not an IP-Adapter directory: it needs {WEIGHTS_FILE} and "
                                        f"{ENCODER_FOLDER}/ (as diffusers' load_ip_adapter reads them)"})
    encoder_digest = hashlib.sha256()
    for file in sorted(path for path in encoder.rglob("*") if path.is_file()):
        encoder_digest.update(file.relative_to(encoder).as_posix().encode())
        encoder_digest.update(roots.read(roots.regular_file(file, "path"), "path", max_bytes))
    whole = hashlib.sha256(roots.read(roots.regular_file(weights, "path"), "path", max_bytes))
    whole.update(encoder_digest.digest())
    return whole.hexdigest(), encoder_digest.hexdigest()


class IpAdapterSet:
    """The IP-Adapters registered on this runner's model, and whether they are on its UNet."""

    def __init__(self) -> None:
        self.registered: dict[str, IpAdapter] = {}
        self._slots: list[str] = []  # the names in the UNet's slot order while loaded; empty: none loaded
        self._processors: list[Any] = []  # the UNet's IP-Adapter attention processors while loaded
        self._blanks: list[torch.Tensor] = []  # each slot's embeddings of one image, zeroed

    def resident(self) -> list[IpAdapter]:
        return [adapter for adapter in self.registered.values() if adapter.resident]

    def register(self, pipeline: Any, source: AdapterSource, files: SourceFiles,
                 before_change: Callable[[], None] = lambda: None) -> IpAdapter:
        """Checks and loads the IP-Adapter at ``source.path`` with the others registered, its files
        read within ``files``' roots and budget (an IP-Adapter is never pinned: all are resident);
        nothing changes when it does not fit the model (INVALID_ARGUMENT naming ``path``)."""
        name, path, expected_digest = source.name, source.path, source.expected_digest
        if not takes_ip_adapters(pipeline):
            raise failed_precondition(f"{type(pipeline).__name__} takes no IP-Adapters "
                                      "(Stable Diffusion 1.x/2.x and SDXL do)")
        digest, encoder_digest = _directory_digest(files.roots, path, files.weights_budget())
        if expected_digest and digest != expected_digest:
            raise failed_precondition(f"IP-Adapter {name!r} at {path} changed since it was registered; nothing loaded")
        existing = self.registered.get(name)
        if existing is not None and existing.path != path:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"IP-Adapter {name!r} is registered from {existing.path}; unload it first")
        if existing is not None and existing.digest == digest:
            return existing
        others = [adapter for adapter in self.registered.values() if adapter.name != name]
        if any(adapter.encoder_digest != encoder_digest for adapter in others):
            raise failed_precondition(
                f"IP-Adapter {name!r} has another image encoder than {others[0].name!r}: the IP-Adapters of a model "
                "share one image encoder (diffusers loads one for its set); unload the others first")
        adapter = IpAdapter(name, path, digest, encoder_digest)
        before_change()
        previous = dict(self.registered)
        self.registered = {**{a.name: a for a in others}, name: adapter}
        try:
            self._load(pipeline)
        except Exception as error:  # noqa: BLE001 - any failure: the set as it was, and a refusal
            self.registered = previous
            self._unload(pipeline)
            if any(a.resident for a in previous.values()):
                self._load(pipeline)
            raise invalid_argument({"path": f"IP-Adapter {name!r} does not fit {type(pipeline).__name__}: "
                                            f"{short_reason(error)}; nothing loaded"}) from None
        logger.info("IP-Adapter %s registered from %s: %d bytes", name, path, adapter.parameter_bytes)
        return adapter

    def unregister(self, pipeline: Any, name: str) -> None:
        if name not in self.registered:
            raise not_found(f"IP-Adapter {name!r} is not registered")
        loaded = bool(self._slots)
        del self.registered[name]
        self._unload(pipeline)
        if loaded and self.registered:
            self._load(pipeline)
        logger.info("IP-Adapter %s unloaded", name)

    def evict_all(self, pipeline: Any) -> None:
        """Takes every IP-Adapter off the UNet (they stay registered and load again when a batch
        needs one): before a level-2 sleep, which reloads the UNet's parameters by their names."""
        if self._slots:
            self._unload(pipeline)
            logger.info("IP-Adapters evicted from the device")

    def check_batch(self, pipeline: Any, names: Sequence[tuple[int, str]], kinds: Mapping[str, int]) -> None:
        """Each (item index, name) of a batch's image prompts: INVALID_ARGUMENT on a model that takes
        none or for a name registered as another kind (``kinds``: every registered name's kind),
        FAILED_PRECONDITION for one not registered."""
        if names and not takes_ip_adapters(pipeline):
            raise invalid_argument({f"items[{index}].ip_adapter": f"{type(pipeline).__name__} takes no IP-Adapters"
                                    for index, _ in names})
        ip_adapter = common_pb2.ADAPTER_KIND_IP_ADAPTER
        wrong = {f"items[{index}].ip_adapter.name": wrong_kind(name, kinds[name], ip_adapter)
                 for index, name in names if name in kinds and kinds[name] != ip_adapter}
        if wrong:
            raise invalid_argument(wrong)
        missing = {f"items[{index}].ip_adapter.name": f"IP-Adapter {name!r} is not registered; load it with "
                                                       "LoadAdapter (kind IP_ADAPTER)"
                   for index, name in names if name not in self.registered}
        if missing:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"ip_adapter.name: {'; '.join(missing.values())}", missing)

    def activate(self, pipeline: Any, names: Sequence[str]) -> None:
        """Makes sure the registered set is on the UNet when ``names`` (a batch's image prompts) need it."""
        for name in names:
            if name not in self.registered:
                raise failed_precondition(f"ip_adapter.name: IP-Adapter {name!r} is not registered")
            self.registered[name].requests += 1
        if names and not self._slots:
            self._load(pipeline)

    def embed(self, pipeline: Any, prompt: ImagePromptInput, guided: bool, device: torch.device) -> RowImagePrompt:
        """One image's embeddings for ``prompt``'s adapter, as the pipeline's own
        ``prepare_ip_adapter_image_embeds`` makes them (one entry per loaded adapter: the others'
        are computed too and dropped)."""
        slot = self._slot(prompt.name)
        images = [list(prompt.images)] * len(self._slots)
        embeds = pipeline.prepare_ip_adapter_image_embeds(images, None, device, 1, guided)[slot]
        return RowImagePrompt(prompt.name, embeds, prompt.scale)

    @staticmethod
    def sharing(prompts: Sequence[RowImagePrompt | None]) -> list[list[int]]:
        """The sequences (by index) that can share one UNet call: all, unless rows of one adapter
        have different counts of reference images (its processors attend over every image's tokens
        at once), which go to further calls; rows without an image prompt join the first."""
        calls: list[tuple[dict[str, int], list[int]]] = []
        for index, prompt in enumerate(prompts):
            fits = next((call for call in calls if prompt is None
                         or call[0].get(prompt.name, prompt.images) == prompt.images), None)
            if fits is None:
                fits = ({}, [])
                calls.append(fits)
            if prompt is not None:
                fits[0][prompt.name] = prompt.images
            fits[1].append(index)
        return [indices for _, indices in calls]

    @contextlib.contextmanager
    def denoiser_call(self, unet: torch.nn.Module,
                      rows: Sequence[tuple[RowImagePrompt | None, int]]) -> Iterator[None]:
        """One UNet call of a step batch, each sequence's (image prompt, input rows) in order: its
        image embeddings in the call's ``added_cond_kwargs`` (zeros where a row has none) and each
        slot's ``RowScales``. Nothing changes while no IP-Adapter is loaded."""
        if not self._slots:
            if any(prompt is not None for prompt, _ in rows):
                raise failed_precondition("no IP-Adapter is loaded on the UNet")
            yield
            return
        embeds, scales = [], []
        for slot, name in enumerate(self._slots):
            counts = {prompt.images for prompt, _ in rows if prompt is not None and prompt.name == name}
            if len(counts) > 1:
                raise ValueError(f"rows of IP-Adapter {name!r} with {sorted(counts)} reference images in one call")
            blank = self._blanks[slot]
            blank = blank.expand(1, counts.pop() if counts else 1, *blank.shape[2:])
            parts, row_scales = [], []
            for prompt, count in rows:
                own = prompt is not None and prompt.name == name
                parts.append(prompt.embeds if prompt is not None and own else blank.expand(count, *blank.shape[1:]))
                row_scales.extend([prompt.scale if prompt is not None and own else 0.0] * count)
            embeds.append(torch.cat(parts))
            scales.append(RowScales(row_scales, blank.device))

        def with_image_embeds(module: torch.nn.Module, args: tuple[Any, ...],
                              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            kwargs["added_cond_kwargs"] = {**(kwargs.get("added_cond_kwargs") or {}), "image_embeds": embeds}
            return args, kwargs

        hook = unet.register_forward_pre_hook(with_image_embeds, with_kwargs=True)
        held = [list(processor.scale) for processor in self._processors]
        try:
            for processor in self._processors:
                processor.scale = list(scales)
            yield
        finally:
            hook.remove()
            for processor, scale in zip(self._processors, held, strict=True):
                processor.scale = scale

    @contextlib.contextmanager
    def pipeline_call(self, pipeline: Any, prompts: Sequence[ImagePromptInput | None], guidance: float,
                      device: torch.device) -> Iterator[dict[str, Any]]:
        """A request-level call's IP-Adapter arguments (one prompt per image, all of one adapter
        and scale or none, as a batch shares them): each image's embeddings as ``ip_adapter_image_embeds``
        (zeros for a call without, whose scales are 0) and the call's scale on its adapter's slot
        with ``set_ip_adapter_scale``. Nothing while no IP-Adapter is loaded."""
        if not self._slots:
            yield {}
            return
        unet = pipeline.unet
        guided = guidance > 1 and unet.config.time_cond_proj_dim is None  # the pipelines' do_classifier_free_guidance
        rows = 2 if guided else 1
        own = [None if prompt is None else self.embed(pipeline, prompt, guided, device) for prompt in prompts]
        first = next((prompt for prompt in own if prompt is not None), None)
        if first is not None and any(prompt is None or prompt.images != first.images for prompt in own):
            raise invalid_argument({"items": "one pipeline call takes one count of reference images for all its "
                                             "images; send these requests apart"})
        embeds = []
        for slot, name in enumerate(self._slots):
            if first is not None and first.name == name:
                parts = [prompt.embeds for prompt in own if prompt is not None]
            else:
                parts = [self._blanks[slot].expand(rows, *self._blanks[slot].shape[1:])] * len(prompts)
            # The pipeline splits precomputed embeddings into the negative half and the positive one.
            embeds.append(torch.cat([part[:1] for part in parts] + ([part[1:] for part in parts] if guided else [])))
        held = [list(processor.scale) for processor in self._processors]
        pipeline.set_ip_adapter_scale([first.scale if first is not None and first.name == name else 0.0
                                       for name in self._slots])
        try:
            yield {"ip_adapter_image_embeds": embeds}
        finally:
            for processor, scale in zip(self._processors, held, strict=True):
                processor.scale = scale

    def _slot(self, name: str) -> int:
        if name not in self._slots:
            raise failed_precondition(f"ip_adapter.name: IP-Adapter {name!r} is not loaded")
        return self._slots.index(name)

    def _load(self, pipeline: Any) -> None:
        """Loads every registered IP-Adapter on the UNet with one ``load_ip_adapter`` call."""
        self._unload(pipeline)
        names = list(self.registered)
        if not names:
            return
        paths = [str(self.registered[name].path) for name in names]
        pipeline.load_ip_adapter(paths, subfolder=[""] * len(names), weight_name=[WEIGHTS_FILE] * len(names),
                                 image_encoder_folder=ENCODER_FOLDER)
        unet = pipeline.unet
        self._processors = [p for p in unet.attn_processors.values() if isinstance(p, _PROCESSORS)]
        self._slots = names
        blank = Image.new("RGB", (8, 8))
        with torch.inference_mode():
            found = pipeline.prepare_ip_adapter_image_embeds([blank] * len(names), None, unet.device, 1, False)
        self._blanks = [torch.zeros_like(embeds) for embeds in found]
        encoder_bytes = _bytes(pipeline.image_encoder.parameters())
        projections = unet.encoder_hid_proj.image_projection_layers
        for slot, name in enumerate(names):
            adapter = self.registered[name]
            own = [*projections[slot].parameters()]
            for processor in self._processors:
                own += [*processor.to_k_ip[slot].parameters(), *processor.to_v_ip[slot].parameters()]
            adapter.parameter_bytes = _bytes(own) + encoder_bytes
            adapter.resident = True

    def _unload(self, pipeline: Any) -> None:
        if getattr(pipeline.unet, "encoder_hid_proj", None) is not None or self._slots:
            pipeline.unload_ip_adapter()
        self._slots, self._processors, self._blanks = [], [], []
        for adapter in self.registered.values():
            adapter.resident = False


def _bytes(parameters: Any) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in parameters)


def adapter_kinds(pipeline: Any) -> list[common_pb2.AdapterKind]:
    """The IP-Adapter's place in ModelCapabilities.adapter_kinds: listed where the pipeline takes them."""
    return [common_pb2.ADAPTER_KIND_IP_ADAPTER] if takes_ip_adapters(pipeline) else []
