"""ControlNets of the loaded model: registered by name (LoadAdapter with ADAPTER_KIND_CONTROLNET),
kept on the device in a least-recently-used store bounded by bytes (``--max-controlnet-bytes``),
and chosen per request (``ExecuteItem.controls``).

A ControlNet is a diffusers ControlNet directory (``config.json`` and safetensors weights) inside
the model roots, of the family's class (``CONTROLNET_FAMILIES``: ``ControlNetModel`` for Stable
Diffusion 1.x/2.x and SDXL, ``SD3ControlNetModel``, ``FluxControlNetModel``): its config must fit
the loaded model's denoiser (text width, latent channels, blocks or attention width, conditioning
resolution, Flux's guidance embedding) and be of a kind the family's diffusers pipeline serves
without more inputs, or it is refused INVALID_ARGUMENT naming ``path`` before its weights are read.
Its module is built empty from the config and takes the file's tensors in the model's dtype, on
its device. An evicted one (the bound, a level-2 sleep) stays registered and loads again from its
path when a request names it, provided its files still have the digest they were registered with.

Every method that loads or frees runs on the runner's device thread, under its device lock.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from accelerate import init_empty_weights  # type: ignore[import-untyped]  # diffusers' own loader uses it
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.controlnets.controlnet import ControlNetModel
from diffusers.models.controlnets.controlnet_flux import FluxControlNetModel, FluxMultiControlNetModel
from diffusers.models.controlnets.controlnet_sd3 import SD3ControlNetModel, SD3MultiControlNetModel
from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel
from diffusers.models.modeling_utils import ModelMixin
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from PIL import Image

from diffusion.v1 import common_pb2, runner_pb2
from runner_service.adapter_stores import AdapterSource, SourceFiles
from runner_service.denoising.controls import SequenceControl, control_image, control_noise_seed
from runner_service.families import family_of
from runner_service.model_roots import ModelRoots
from runner_service.pipeline_adapter import PipelineAdapter
from serving_common.conditioning_rules import (
    CONDITIONED_TASKS,
    MAX_CONTROLS,
    count_problem,
    guidance_window_problems,
    scale_problem,
    wrong_kind,
)
from serving_common.errors import ServiceError, failed_precondition, invalid_argument, not_found
from serving_common.protocol import image_seed

logger = logging.getLogger(__name__)

# What a ControlNet's config says that the family's pipeline cannot serve (None: nothing), given
# the config with the class's defaults filled in and the loaded pipeline.
Unserved = Callable[[dict[str, Any], DiffusionPipeline], "str | None"]


def _unserved_unet(config: dict[str, Any], pipeline: DiffusionPipeline) -> str | None:
    if config.get("global_pool_conditions"):
        return "pools its conditions (guess mode), which this runner does not serve"
    factor = 2 ** (len(config["conditioning_embedding_out_channels"]) - 1)
    if factor != pipeline.vae_scale_factor:
        return (f"reads its image at 1/{factor} of the image's size; this model's latents are "
                f"1/{pipeline.vae_scale_factor}")
    return None


def _unserved_sd3(config: dict[str, Any], pipeline: DiffusionPipeline) -> str | None:
    if not config["use_pos_embed"] or config["extra_conditioning_channels"]:
        return ("needs inputs StableDiffusion3ControlNetPipeline does not give it (no position embedding, or "
                "extra conditioning channels)")
    return None


def _unserved_flux(config: dict[str, Any], pipeline: DiffusionPipeline) -> str | None:
    if config["num_mode"] is not None:
        return "is a union ControlNet, whose control mode requests do not carry"
    if config["conditioning_embedding_channels"] is not None:
        return "reads pixels through its own hint block (XLabs' kind), which this runner does not serve yet"
    return None


@dataclass(frozen=True)
class ControlNetFamily:
    """How one family takes ControlNets: their class and the one diffusers runs several as, the
    config entries they share with the denoiser (their residuals are added to its blocks, and they
    read the same latents, text and added embeddings), what else they must not need, and the
    tasks the family's diffusers pipelines take them for."""

    net: type[torch.nn.Module]
    multi: Callable[[list[Any]], torch.nn.Module]
    fit: tuple[str, ...]
    unserved: Unserved
    tasks: frozenset[int]
    # Whether its pipelines read the control image in [-1, 1] (normalized, then VAE-encoded), not [0, 1].
    normalized: bool = False
    # Whether its pipeline draws the control images' VAE noise from torch's global generator (SD3).
    global_noise: bool = False
    # Whether its image-to-image ControlNet pipeline takes true CFG (a negative prompt at a
    # true_cfg_scale above 1): FluxControlNetImg2ImgPipeline takes neither, so it is refused there.
    image_true_cfg: bool = True


_TRANSFORMER_FIT = ("in_channels", "patch_size", "num_attention_heads", "attention_head_dim", "joint_attention_dim",
                    "pooled_projection_dim")
_UNET = ControlNetFamily(ControlNetModel, MultiControlNetModel,
                         ("in_channels", "cross_attention_dim", "block_out_channels", "layers_per_block",
                          "addition_embed_type", "projection_class_embeddings_input_dim"),
                         _unserved_unet, frozenset(CONDITIONED_TASKS))
# Each family that takes ControlNets, by family name. SD3's ControlNet pipeline takes no input image.
CONTROLNET_FAMILIES: dict[str, ControlNetFamily] = {
    "sd": _UNET,
    "sdxl": _UNET,
    "sd3": ControlNetFamily(SD3ControlNetModel, SD3MultiControlNetModel, _TRANSFORMER_FIT, _unserved_sd3,
                            frozenset({common_pb2.TASK_TEXT_TO_IMAGE}), normalized=True, global_noise=True),
    "flux": ControlNetFamily(FluxControlNetModel, FluxMultiControlNetModel, (*_TRANSFORMER_FIT, "guidance_embeds"),
                             _unserved_flux, frozenset(CONDITIONED_TASKS), normalized=True, image_true_cfg=False),
}
# A ControlNet's config.json is a few kilobytes.
MAX_CONFIG_BYTES = 1024 * 1024

# Reads a ControlNet directory's safetensors weights: its tensors and the digest of their bytes.
ReadWeights = Callable[[Path], tuple[dict[str, torch.Tensor], str]]


def controlnet_family(pipeline: DiffusionPipeline) -> ControlNetFamily | None:
    """How ``pipeline``'s family takes ControlNets; None where it takes none."""
    family = family_of(pipeline)
    return CONTROLNET_FAMILIES.get(family.name) if family is not None else None


@dataclass
class ControlNet:
    """One registered ControlNet; ``module`` is None while it is not on the device."""

    name: str
    path: Path
    digest: str
    pinned: bool
    parameter_bytes: int
    module: torch.nn.Module | None = None
    asleep: bool = False  # freed by a level-2 sleep: loaded again at wake
    last_used: int = 0
    requests: int = 0

    @property
    def resident(self) -> bool:
        return self.module is not None

    def info(self) -> common_pb2.AdapterInfo:
        return common_pb2.AdapterInfo(name=self.name, path=str(self.path), pinned=self.pinned, digest=self.digest,
                                      resident=self.resident, parameter_bytes=self.parameter_bytes,
                                      requests=self.requests, kind=common_pb2.ADAPTER_KIND_CONTROLNET)


def _no_weights(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    raise failed_precondition("this runner takes no ControlNets")


class ControlNets:
    """The ControlNets registered on the loaded model, and which of them are on its device."""

    def __init__(self, max_bytes: int = 0, roots: ModelRoots | None = None, read: ReadWeights | None = None) -> None:
        self.max_bytes = max_bytes
        self._roots = roots or ModelRoots()
        self._read = read or _no_weights
        self.registered: dict[str, ControlNet] = {}
        self._clock = itertools.count(1)

    def resident_bytes(self) -> int:
        return sum(net.parameter_bytes for net in self.registered.values() if net.resident)

    def register(self, pipeline: DiffusionPipeline, source: AdapterSource, files: SourceFiles | None = None,
                 before_change: Callable[[], None] = lambda: None) -> ControlNet:
        """Reads a ControlNet directory and loads it; nothing changes when it does not fit the model.
        ``files``: unused, the store reads by its own roots and ``read`` (``--max-controlnet-bytes``)."""
        name, path, pin, expected_digest = source.name, source.path, source.pin, source.expected_digest
        existing = self.registered.get(name)
        if existing is not None and existing.path != path:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"ControlNet {name!r} is registered from {existing.path}; unload it first")
        kind = controlnet_family(pipeline)
        if kind is None:
            raise failed_precondition(f"{type(pipeline).__name__} takes no ControlNets")
        config = self._config(path)
        _check_fits(pipeline, kind, config, path)
        tensors, digest = self._read(path)
        if expected_digest and digest != expected_digest:
            raise failed_precondition(f"ControlNet {name!r} at {path} changed since it was registered; nothing loaded")
        if existing is not None and existing.digest == digest:
            existing.pinned = pin
            return existing
        module = _build(kind.net, config, tensors, pipeline, path)
        size = _parameter_bytes(module)
        pinned = sum(net.parameter_bytes for net in self.registered.values() if net.pinned and net.name != name)
        if size > self.max_bytes - pinned:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"ControlNet {name!r} holds {size} bytes and {pinned} are pinned of the "
                               f"{self.max_bytes} ControlNets may hold (--max-controlnet-bytes); unpin or unload one")
        before_change()
        if existing is not None:
            del self.registered[name]
        net = ControlNet(name, path, digest, pin, size)
        self._make_room(size, keep=())
        net.module = module
        net.last_used = next(self._clock)
        self.registered[name] = net
        logger.info("ControlNet %s registered from %s: %d bytes%s", name, path, size, " (pinned)" if pin else "")
        return net

    def unregister(self, pipeline: DiffusionPipeline, name: str) -> None:
        """Forgets a ControlNet (its module is no part of ``pipeline``: nothing there changes)."""
        if self.registered.pop(name, None) is None:
            raise not_found(f"ControlNet {name!r} is not registered")
        logger.info("ControlNet %s unloaded", name)

    def require(self, pipeline: DiffusionPipeline, names: Sequence[str],
                keep: Collection[str] = ()) -> dict[str, torch.nn.Module]:
        """The modules of ``names`` (each counted as a request), on the device: evicted ones load again
        from their paths, the least recently used unpinned ones not in ``names`` nor ``keep`` (in use by
        a running batch) making room."""
        modules = {}
        for name in names:
            net = self.registered.get(name)
            if net is None:
                raise failed_precondition(f"ControlNet {name!r} is not registered")
            net.last_used = next(self._clock)
            net.requests += 1
            if net.module is None:
                self._reload(pipeline, net, keep={*names, *keep})
                net.asleep = False
            assert net.module is not None
            modules[name] = net.module
        return modules

    def free_all(self) -> None:
        """Takes every ControlNet off the device for a level-2 sleep; ``restore`` loads them again."""
        for net in self.registered.values():
            if net.module is not None:
                net.module, net.asleep = None, True
        logger.info("ControlNets freed for sleep")

    def restore(self, pipeline: DiffusionPipeline) -> None:
        """Loads again what ``free_all`` freed (at wake); one whose files changed or are gone stays off
        the device, and a request naming it is refused then, saying why."""
        for net in [net for net in self.registered.values() if net.asleep]:
            net.asleep = False
            if net.resident:  # a request loaded it again already
                continue
            try:
                self._reload(pipeline, net, keep=())
            except ServiceError as error:
                logger.warning("ControlNet %s stays off the device after wake: %s", net.name, error.message)

    def _reload(self, pipeline: DiffusionPipeline, net: ControlNet, keep: Collection[str]) -> None:
        kind = controlnet_family(pipeline)
        assert kind is not None  # it was registered on this model
        config = self._config(net.path)
        tensors, digest = self._read(net.path)
        if digest != net.digest:
            raise failed_precondition(f"ControlNet {net.name!r} at {net.path} changed since it was registered; "
                                      "load it again with LoadAdapter")
        self._make_room(net.parameter_bytes, keep)
        net.module = _build(kind.net, config, tensors, pipeline, net.path)
        logger.info("ControlNet %s loaded again from %s", net.name, net.path)

    def _make_room(self, size: int, keep: Collection[str]) -> None:
        while self.resident_bytes() + size > self.max_bytes:
            candidates = [net for net in self.registered.values()
                          if net.resident and not net.pinned and net.name not in keep]
            if not candidates:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"no ControlNet can be evicted to make room for {size} bytes: the resident ones "
                                   "are pinned or in use (--max-controlnet-bytes)")
            victim = min(candidates, key=lambda net: net.last_used)
            victim.module = None
            logger.info("ControlNet %s evicted (least recently used)", victim.name)

    def _config(self, path: Path) -> dict[str, Any]:
        """The directory's config.json, read within the roots and bounded."""
        file = self._roots.regular_file(path / "config.json", "path")
        try:
            config = json.loads(self._roots.read(file, "path", MAX_CONFIG_BYTES))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise invalid_argument({"path": f"{file.shown} is not JSON: {error}"}) from None
        if not isinstance(config, dict):
            raise invalid_argument({"path": f"{file.shown} is not a JSON object"})
        return config


def _check_fits(pipeline: DiffusionPipeline, kind: ControlNetFamily, config: dict[str, Any], path: Path) -> None:
    """INVALID_ARGUMENT naming ``path`` unless ``config`` is a ControlNet of ``kind`` that fits the
    pipeline's denoiser and VAE and that its pipeline serves."""
    found = config.get("_class_name")
    family = family_of(pipeline)
    family_name = family.name if family is not None else type(pipeline).__name__
    if found != kind.net.__name__:
        raise invalid_argument({"path": f"{path} is a {found or 'directory without _class_name'}, not a "
                                        f"{kind.net.__name__} ({family_name} models take those)"})
    denoiser = _denoiser(pipeline)
    full = {name: parameter.default for name, parameter in _init_parameters(kind.net).items()} | config
    for key in kind.fit:
        theirs = full.get(key)
        ours = denoiser.config.get(key)
        if _normalized(theirs) != _normalized(ours):
            raise invalid_argument({"path": f"{path} is a ControlNet of another model: its {key} is {theirs}, "
                                            f"this {family_name} model's is {ours}"})
    unserved = kind.unserved(full, pipeline)
    if unserved is not None:
        raise invalid_argument({"path": f"{path} {unserved}"})


def _denoiser(pipeline: DiffusionPipeline) -> ModelMixin:
    """The module a ControlNet steers: the UNet, or the transformer."""
    unet: ModelMixin | None = getattr(pipeline, "unet", None)
    return unet if unet is not None else pipeline.transformer


def _init_parameters(kind: type[torch.nn.Module]) -> dict[str, Any]:
    """What a config leaves out takes the class's ``__init__`` default."""
    return dict(inspect.signature(kind.__init__).parameters)


def _normalized(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def _build(kind: type[torch.nn.Module], config: dict[str, Any], tensors: dict[str, torch.Tensor],
           pipeline: DiffusionPipeline, path: Path) -> torch.nn.Module:
    """The ControlNet of ``config`` holding ``tensors``, in the model's dtype on its device."""
    denoiser = _denoiser(pipeline)
    try:
        with init_empty_weights(include_buffers=False):
            module: torch.nn.Module = kind.from_config(config)  # type: ignore[attr-defined]  # a ModelMixin
        module.load_state_dict(tensors, strict=True, assign=True)
    except (RuntimeError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise invalid_argument({"path": f"{path}: its weights do not match its config: {reason[:300]}"}) from None
    module = module.to(device=denoiser.device, dtype=denoiser.dtype)
    module.eval().requires_grad_(False)
    return module


def _parameter_bytes(module: torch.nn.Module) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in module.parameters())


def control_violations(items: Sequence[runner_pb2.ExecuteItem], pipeline: DiffusionPipeline | None,
                       kinds: Mapping[str, int], default_true_cfg: float = 0.0,
                       guidance_is_true_cfg: bool = False) -> list[tuple[str, str]]:
    """(field, why) for each ControlNet of ``items`` that cannot run, by the rules the worker holds
    requests to (``serving_common.conditioning_rules``): too many, a scale or a start and end out of
    bounds, an image of another size, on a model or task that takes none, or a name registered as
    another kind (``kinds``: every registered name's kind); and true CFG (above 1: the item's
    ``true_cfg_scale``, else ``default_true_cfg``, the model's; its ``guidance_scale`` where
    ``guidance_is_true_cfg``: a Flux without a guidance embedding, as ``shapes``, whose guidance
    travels as true_cfg_scale) where the family's image-to-image ControlNet pipeline takes none,
    never run without it. No pipeline: only the bounds."""
    controlnet = common_pb2.ADAPTER_KIND_CONTROLNET
    violations: list[tuple[str, str]] = []
    for index, item in enumerate(items):
        where = f"items[{index}].controls"
        if not item.controls:
            continue
        too_many = count_problem(len(item.controls), MAX_CONTROLS, "ControlNets")
        if too_many is not None:
            violations.append((where, too_many))
        kind = controlnet_family(pipeline) if pipeline is not None else None
        if pipeline is not None and kind is None:
            violations.append((where, f"{type(pipeline).__name__} takes no ControlNets"))
        task = item.task or common_pb2.TASK_TEXT_TO_IMAGE
        if task not in CONDITIONED_TASKS:
            violations.append((where, "only text-to-image and image-to-image take ControlNets"))
        elif kind is not None and task not in kind.tasks:
            violations.append((where, f"{type(pipeline).__name__} takes ControlNets from text alone (diffusers has "
                                      "no image-to-image ControlNet pipeline for it)"))
        elif kind is not None and task == common_pb2.TASK_IMAGE_TO_IMAGE and not kind.image_true_cfg:
            name, true_cfg = ("guidance_scale", item.guidance_scale) if guidance_is_true_cfg else (
                "true_cfg_scale", item.true_cfg_scale if item.HasField("true_cfg_scale") else default_true_cfg)
            if true_cfg > 1:
                violations.append((f"items[{index}].{name}",
                                   f"must be at most 1 (true CFG off) for image-to-image with ControlNets, got "
                                   f"{true_cfg:g}: {type(pipeline).__name__}'s ControlNet image-to-image pipeline "
                                   "takes no true CFG nor negative prompt"
                                   + (" (this model's guidance is its true CFG)" if guidance_is_true_cfg else "")))
        for position, control in enumerate(item.controls):
            field = f"{where}[{position}]"
            image = control.image
            if (image.width, image.height, image.channels) != (item.width, item.height, 3) or \
                    len(image.pixels) != item.width * item.height * 3:
                violations.append((f"{field}.image", f"must be {item.width}x{item.height}x3 bytes, got "
                                                     f"{image.width}x{image.height}x{image.channels} in "
                                                     f"{len(image.pixels)}"))
            scale = scale_problem(control.conditioning_scale)
            if scale is not None:
                violations.append((f"{field}.conditioning_scale", scale))
            violations.extend((f"{field}.{name}", why)
                              for name, why in guidance_window_problems(control.guidance_start, control.guidance_end))
            if control.name in kinds and kinds[control.name] != controlnet:
                violations.append((f"{field}.name", wrong_kind(control.name, kinds[control.name], controlnet)))
    return violations


def check_registered(items: Sequence[runner_pb2.ExecuteItem], store: ControlNets) -> None:
    """FAILED_PRECONDITION naming ``controls[i].name`` for a ControlNet that is not registered."""
    missing = [(f"items[{index}].controls[{position}].name", f"ControlNet {control.name!r} is not registered; "
                                                             "load it with LoadAdapter (ADAPTER_KIND_CONTROLNET)")
               for index, item in enumerate(items) for position, control in enumerate(item.controls)
               if control.name not in store.registered]
    if missing:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "; ".join(why for _, why in missing), missing)


def controlnet_kinds(pipeline: DiffusionPipeline) -> list[common_pb2.AdapterKind]:
    """ADAPTER_KIND_CONTROLNET where the pipeline's family takes ControlNets (ModelCapabilities.adapter_kinds)."""
    return [common_pb2.ADAPTER_KIND_CONTROLNET] if controlnet_family(pipeline) is not None else []


def _pixels(image: runner_pb2.RawImage) -> torch.Tensor:
    """A conditioning image as 1 x 3 x height x width floats in [0, 1], as diffusers' image processor
    reads a PIL image (``pil_to_numpy``, ``numpy_to_pt``)."""
    array = VaeImageProcessor.pil_to_numpy([Image.frombytes("RGB", (image.width, image.height), image.pixels)])
    tensor: torch.Tensor = VaeImageProcessor.numpy_to_pt(array)
    return tensor


@dataclass(frozen=True)
class ControlledCall:
    """One request-level call's ControlNet pipeline, its ControlNet arguments, and what the call
    runs within (``noise``)."""

    adapter: PipelineAdapter
    arguments: dict[str, Any]
    noise_seed: int | None  # where the pipeline draws control noise from torch's global generator: its seed

    def noise(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """torch's global generators seeded with ``noise_seed`` for the call and restored after it, so
        that the control images' noise is the first image's, as the step loop draws it, and nothing
        else's randomness moves; nothing where the pipeline draws none from them."""
        return contextlib.nullcontext() if self.noise_seed is None else _seeded(self.noise_seed, device)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    with torch.random.fork_rng(device_type=device.type if device.type != "cpu" else "cuda"):
        torch.manual_seed(seed)
        yield


def call_controls(store: ControlNets, adapter: PipelineAdapter, task: str,
                  items: Sequence[runner_pb2.ExecuteItem]) -> ControlledCall | None:
    """The ControlNet pipeline of one request-level call and its ControlNet arguments; None where the
    batch has no ControlNets (a batch shares them, each image with its item's conditioning images).
    Several ControlNets run as the family's multi-ControlNet (``MultiControlNetModel``,
    ``SD3MultiControlNetModel``, ``FluxMultiControlNetModel``), each with a batch of images."""
    controls = list(items[0].controls)
    if not controls:
        return None
    kind = controlnet_family(adapter.pipeline)
    assert kind is not None  # the batch check refuses controls on a family that takes none
    modules = store.require(adapter.pipeline, [control.name for control in controls])
    nets = [modules[control.name] for control in controls]
    controlled = adapter.with_controlnet(task, nets[0] if len(nets) == 1 else kind.multi(nets))
    images = [torch.cat([_pixels(item.controls[position].image) for item in items for _ in range(item.num_images)])
              for position in range(len(controls))]
    if kind.normalized:  # what their prepare_image leaves a tensor as: normalized by the caller
        images = [image * 2.0 - 1.0 for image in images]

    def each(values: list[Any]) -> Any:
        return values[0] if len(values) == 1 else values

    return ControlledCall(controlled, {
        controlled.control_image_argument: each(images),
        "controlnet_conditioning_scale": each([control.conditioning_scale for control in controls]),
        "control_guidance_start": each([round(control.guidance_start, 6) for control in controls]),
        "control_guidance_end": each([round(control.guidance_end, 6) for control in controls]),
    }, control_noise_seed(image_seed(items[0].seed, 0)) if kind.global_noise else None)


def sequence_controls(store: ControlNets, pipeline: DiffusionPipeline, item: runner_pb2.ExecuteItem,
                      keep: Collection[str]) -> tuple[SequenceControl, ...]:
    """An item's ControlNets as each of its step-loop sequences takes them; ``keep``: the ControlNets
    the running batch's sequences use (never evicted to make room)."""
    if not item.controls:
        return ()
    modules = store.require(pipeline, [control.name for control in item.controls], keep)
    return tuple(
        SequenceControl(modules[control.name],
                        control_image(Image.frombytes("RGB", (item.width, item.height), control.image.pixels),
                                      item.width, item.height, pipeline.vae_scale_factor, pipeline.device),
                        control.conditioning_scale, control.guidance_start, control.guidance_end)
        for control in item.controls)
