"""The loaded pipeline: its components discovered by name, its weights held in process memory."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import gc
import hashlib
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from diffusers.models.modeling_utils import ModelMixin
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from PIL import Image
from safetensors.torch import load_file
from transformers.modeling_utils import PreTrainedModel

from diffusion.v1 import common_pb2
from runner_service.acceleration.apply import accelerate, offer
from runner_service.acceleration.step_cache import StepCache
from runner_service.adapter_stores import AdapterStore
from runner_service.adapters import AdapterSet
from runner_service.component_overrides import check_overrides
from runner_service.controlnets import ControlNets
from runner_service.cost_meter import CostMeter
from runner_service.denoising.loop import DenoisingLoop, ImageSource, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families import latent_preview, loop_for
from runner_service.fused_adapters import check_fusions
from runner_service.generation_config import GenerationDefaults, read_generation_defaults
from runner_service.ip_adapters import IpAdapterSet, takes_ip_adapters
from runner_service.model_extras import LoadOptions, ModelExtras
from runner_service.model_roots import ModelRoots
from runner_service.model_sources import HubCache, SourceKind, locate
from runner_service.models.catalog import BUILTIN_MODELS
from runner_service.parallel import ParallelRun
from runner_service.pipeline_adapter import Capabilities, ImageRows, PipelineAdapter, adapt, short_reason
from runner_service.platforms import Platform
from runner_service.previews import LatentPreview
from runner_service.single_file import check as check_single_file
from runner_service.single_file import is_single_file
from runner_service.tensor_parts import stored_bytes
from serving_common.errors import ServiceError, failed_precondition, invalid_argument
from serving_common.generation_params import GenerationParams
from serving_common.input_rules import AccelerationPlan
from serving_common.protocol import DTYPES

logger = logging.getLogger(__name__)

# The protocol's dtype names are torch's own.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}


def describe(error: BaseException) -> str:
    """An error in one line for a message that goes on: a ServiceError's own message (or its
    violations), anything else's type and text."""
    if isinstance(error, ServiceError):
        return error.message or "; ".join(f"{field}: {why}" for field, why in error.violations)
    return f"{type(error).__name__}: {error}"


class DeviceOutOfMemory(Exception):
    """Moving a pipeline to the device ran out of device memory; the pipeline is released already."""


@dataclass
class Component:
    """One ``torch.nn.Module`` of the pipeline, with its size as loaded."""

    name: str
    module: torch.nn.Module
    parameter_count: int
    bytes: int
    sleep_level: int = 0

    @property
    def asleep(self) -> bool:
        return self.sleep_level > 0


class WeightUpdate(NamedTuple):
    """One LoadWeights or PushWeights in effect: the digest of what was read, the components it
    changed and the tensors it set (the module's names)."""

    digest: str
    components: frozenset[str]
    pushed: bool = False
    names: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ModelSource:
    """A LoadModel source checked before anything is loaded: the directory, the roots its reads
    are confined to (none for a built-in model, which the runner wrote itself) and the bytes of
    its files."""

    source: str
    directory: Path
    roots: ModelRoots
    file_bytes: int
    # A Hugging Face id's resolved commit (ModelInfo.revision); "" for any other source.
    revision: str = ""
    # A single file's weights, components from elsewhere, adapters to fuse (``check_load``).
    extras: ModelExtras = ModelExtras()


@dataclass
class LoadedModel:
    source: str
    directory: Path
    pipeline: DiffusionPipeline
    dtype: torch.dtype
    device: torch.device
    components: dict[str, Component]
    base_version: str
    # How its pipeline is called, and what it can honour.
    adapter: PipelineAdapter
    roots: ModelRoots = field(default_factory=ModelRoots)
    # Its LoRA adapters.
    adapters: AdapterSet = field(default_factory=AdapterSet)
    # Its ControlNets (``controlnets.py``).
    controlnets: ControlNets = field(default_factory=ControlNets)
    # Its IP-Adapters (``ip_adapters.py``): its step loop's ``image_prompts`` where the family takes them.
    ip_adapters: IpAdapterSet = field(default_factory=IpAdapterSet)
    # Each LoadWeights or PushWeights still in effect (not wholly replaced by a later one), in order.
    weight_updates: list[WeightUpdate] = field(default_factory=list)
    # (weights_version, checksum) of the last checksum computed: valid while the version holds.
    checksum_cache: tuple[str, str] = ("", "")
    # The runner's own denoising loop, for step-level batching (None: the family's loop is not standard).
    loop: DenoisingLoop | None = None
    # Its family's latent preview map (``Family.preview``); None: its requests get no previews.
    preview: LatentPreview | None = None
    # What it was loaded with (InitRequest.acceleration), and its step cache where that has one.
    acceleration: AccelerationPlan = field(default_factory=AccelerationPlan)
    row_cache: StepCache | None = None
    # What it could have been loaded with here, found once at load (GetInfo reports it).
    acceleration_offer: common_pb2.AccelerationOffer = field(default_factory=common_pb2.AccelerationOffer)
    # How a runner group shares its requests out (LoadModelRequest.parallel); None: one device.
    parallel: ParallelRun | None = None
    # What one image costs it here, by size (ModelInfo.costs).
    costs: CostMeter = field(default_factory=CostMeter)
    # Its own defaults for requests (generation_config.json: ModelInfo.defaults).
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # The commit a Hugging Face id resolved to (ModelInfo.revision); "" for any other source.
    revision: str = ""
    # What it was loaded with beyond a directory: where each component's weights come from, what is fused.
    extras: ModelExtras = ModelExtras()

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def weights_version(self) -> str:
        digest = hashlib.sha256(self.base_version.encode())
        for update in self.weight_updates:
            digest.update(update.digest.encode())
        return digest.hexdigest()[:16]

    @property
    def capabilities(self) -> Capabilities:
        """The pipeline's, with the sizes a context-parallel split can take (whole multiples of its
        degree in latent patches)."""
        own = self.adapter.capabilities
        if self.parallel is None or self.parallel.plan.context_degree == 1:
            return own
        multiple = self.parallel.plan.size_multiple(own.size_multiple)
        smallest = -(-max(own.min_size, multiple) // multiple) * multiple
        return dataclasses.replace(own, size_multiple=multiple, min_size=smallest)

    @property
    def parameter_bytes(self) -> int:
        return sum(component.bytes for component in self.components.values())

    def asleep_components(self) -> list[str]:
        return [name for name, component in self.components.items() if component.asleep]

    def select(self, tags: list[str]) -> list[Component]:
        """The components named by ``tags`` (all when empty); unknown names are INVALID_ARGUMENT."""
        unknown = [tag for tag in tags if tag not in self.components]
        if unknown:
            raise invalid_argument(
                {"tags": f"unknown components {unknown}; this model has {sorted(self.components)}"}
            )
        return [self.components[tag] for tag in tags] if tags else list(self.components.values())

    def require_awake(self) -> None:
        asleep = self.asleep_components()
        if asleep:
            raise failed_precondition(f"components asleep: {', '.join(asleep)}; call WakeUp")

    @property
    def adapter_stores(self) -> dict[int, AdapterStore]:
        """Its adapters' stores by kind (``common_pb2.AdapterKind``), as LoadAdapter and UnloadAdapter
        find them (``adapter_stores.py``); in the order RunnerInfo lists their adapters."""
        return {common_pb2.ADAPTER_KIND_LORA: self.adapters, common_pb2.ADAPTER_KIND_CONTROLNET: self.controlnets,
                common_pb2.ADAPTER_KIND_IP_ADAPTER: self.ip_adapters}

    def forget_cached_rows(self) -> None:
        """Drops the row cache's per-row residuals (a sequence in flight computes its next step in
        full): they were computed by weights that a wake-up or a weights change replaces."""
        if self.row_cache is not None:
            self.row_cache.reset()

    def reload_parameters(self, name: str) -> dict[str, torch.Tensor]:
        """Reads one component's parameters afresh from the model's source (sleep level 2 wake).

        The component's files are checked again first (inside the roots, regular files). Its
        safetensors files are read directly when they hold every parameter (several times faster
        than building the module again); otherwise the component's class loads it with
        ``from_pretrained``. A component from a single file is read from it again; adapters fused
        at load are not in what this returns (the wake-up fuses them again).
        """
        module = self.components[name].module
        wanted = dict(module.named_parameters())
        where = self.extras.weights_source(name, self.directory, self.roots)
        if where is None:
            return self._own_parameters(wanted, dict(self.extras.fresh_component(name, self.dtype).named_parameters()))
        directory, roots = where
        roots.model_tree(directory, "source")
        stored: dict[str, torch.Tensor] = {}
        for file in _weight_files(directory):
            stored.update(load_file(roots.regular_file(file, "source").resolved))
        if not set(wanted) <= set(stored):
            kind = type(module)
            if not issubclass(kind, (ModelMixin, PreTrainedModel)):
                raise failed_precondition(f"cannot reload {name}: {kind.__name__} has no from_pretrained")
            fresh = kind.from_pretrained(directory, dtype=self.dtype)
            stored = dict(fresh.named_parameters())
        return self._own_parameters(wanted, stored)

    def _own_parameters(self, wanted: Mapping[str, torch.Tensor],
                        stored: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Each parameter keeps the dtype it had (sleeping keeps it on the emptied tensor).
        return {key: own(stored[key].detach().to(self.device, wanted[key].dtype)) for key in wanted}


def _weight_files(directory: Path) -> list[Path]:
    """The default (not variant) safetensors weights of a component: one file or its shards."""
    return sorted(
        path for path in directory.glob("*.safetensors")
        if path.stem in ("diffusion_pytorch_model", "model") or "-of-" in path.stem
    )


def own(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor in memory this process owns.

    Freshly loaded safetensors weights are views of the file's memory map (page cache, shared
    and file-backed); copying them into the heap makes sleeping release them for real.
    """
    return tensor.clone() if tensor.device.type == "cpu" else tensor


def check_source(source: str, cache_dir: Path | None, roots: ModelRoots, hub: HubCache) -> ModelSource:
    """Checks a LoadModel source without loading it (``model_sources.locate`` says what it names):
    a built-in, a Hugging Face id's snapshot in the hub cache, or a diffusers model directory inside
    the roots; every entry must be a regular file or directory inside the roots of its kind."""
    located = locate(source, cache_dir, roots, hub)
    roots = located.roots
    if located.kind is SourceKind.BUILTIN:
        return ModelSource(source, located.path, roots, roots.model_tree(located.path, "source"))
    directory = roots.check(located.path, "source")
    try:
        mode = os.stat(directory).st_mode
    except OSError:
        mode = None
    if mode is None or not stat.S_ISDIR(mode):
        close = difflib.get_close_matches(source, BUILTIN_MODELS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        what = "does not exist on the runner" if mode is None else "is not a directory"
        raise invalid_argument(
            {"source": f"{source!r} is not a built-in model {sorted(BUILTIN_MODELS)} and {what}{hint}"}
        )
    index = directory / "model_index.json"
    if not index.exists():
        raise invalid_argument(
            {"source": f"{source!r} is neither a built-in model {sorted(BUILTIN_MODELS)} "
                       f"nor a diffusers model directory (no model_index.json in {directory})"}
        )
    roots.regular_file(index, "source")
    return ModelSource(source, directory, roots, roots.model_tree(directory, "source"), located.revision)


def check_load(source: str, options: LoadOptions, single_file_configs: Sequence[str], cache_dir: Path | None,
               roots: ModelRoots, hub: HubCache) -> ModelSource:
    """Checks a LoadModel before anything is loaded or unloaded: its source (``check_source``, or a
    single-file checkpoint and the config it takes, ``single_file.check``), then its component
    overrides against that pipeline's configs and its adapters to fuse."""
    def find(text: str, field: str) -> tuple[Path, ModelRoots]:
        located = locate(text, cache_dir, roots, hub)
        return located.roots.check(located.path, field), located.roots

    def directory(text: str) -> Path:
        return check_source(text, cache_dir, roots, hub).directory

    if is_single_file(source):
        path, file_roots = find(source, "source")
        file = file_roots.regular_file(path, "source")
        single = check_single_file(file.resolved, single_file_configs, directory, directory)
        checked = ModelSource(source, single.config, ModelRoots(), file.size)
    else:
        single = None
        checked = check_source(source, cache_dir, roots, hub)
    extras = ModelExtras(options, single, check_overrides(options.component_overrides, checked.directory, find),
                         check_fusions(options.fused_adapters, find))
    return dataclasses.replace(checked, extras=extras)


def _to_device(pipeline: DiffusionPipeline, platform: Platform) -> str:
    """Moves a pipeline to the device; returns "" or, out of device memory, the error's first line."""
    try:
        pipeline.to(platform.device)
    except Exception as error:  # noqa: BLE001 - out of memory is told apart here, the rest re-raised
        if not platform.is_out_of_memory(error):
            raise
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return ""


def load_model(checked: ModelSource, dtype_name: str | None, platform: Platform,
               adapters: AdapterSet | None = None, plan: AccelerationPlan | None = None,
               controlnets: ControlNets | None = None) -> LoadedModel:
    """Loads any diffusers text-to-image pipeline from a checked source, moves it to the device,
    accelerates it as ``plan`` says (INVALID_ARGUMENT where it cannot take that) and runs the
    adapter's canary (one step at the smallest size), so a loaded model can generate: compiled
    kernels are built by then.

    ``dtype_name`` is one of the protocol's ``DTYPES``; None means the platform's default.
    ``adapters``: the model's (empty) adapter set; none means it takes no adapters. ``controlnets``:
    its (empty) ControlNet store; none means it takes no ControlNets.
    Raises ``DeviceOutOfMemory`` when the device cannot hold it.
    """
    source = checked.source
    dtype = TORCH_DTYPES[dtype_name] if dtype_name else platform.default_dtype()
    defaults = read_generation_defaults(checked.directory, checked.roots)  # a bad file stops the load here
    try:
        pipeline = checked.extras.load_pipeline(checked.directory, dtype)
    except ServiceError:
        raise
    except Exception as error:  # noqa: BLE001 - a malformed model directory can raise anything
        raise failed_precondition(f"cannot load {source!r}: {type(error).__name__}: {error}") from error
    if not callable(pipeline):
        raise failed_precondition(f"{source!r} is a {type(pipeline).__name__}, which cannot generate images")
    out_of_memory = _to_device(pipeline, platform)
    if out_of_memory:
        # Nothing else holds the half-moved pipeline (the traceback is gone): free it before saying so.
        del pipeline
        gc.collect()
        platform.empty_cache()
        raise DeviceOutOfMemory(out_of_memory)
    checked.extras.fuse_adapters(pipeline)  # on the device, before anything accelerates it
    pipeline.set_progress_bar_config(disable=True)  # type: ignore[no-untyped-call]  # diffusers leaves it untyped
    components = {}
    for module in pipeline.components.values():
        if not isinstance(module, torch.nn.Module):
            continue
        module.eval().requires_grad_(False)
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.data = own(tensor.data)
    plan = plan or AccelerationPlan()
    offered = offer(pipeline, platform)
    row_cache = accelerate(pipeline, plan, platform)
    for name, module in pipeline.components.items():
        if isinstance(module, torch.nn.Module):
            parameters = list(module.parameters())
            components[name] = Component(name=name, module=module, parameter_count=sum(p.numel() for p in parameters),
                                         bytes=sum(stored_bytes(p) for p in parameters))
    platform.release_host_memory()
    adapter = adapt(pipeline).canary()
    capabilities = adapter.capabilities
    loop = _loop_canary(pipeline, platform, capabilities, row_cache)
    if plan.compile:
        _compile_for_requests(adapter, loop, row_cache)
    ip_adapters = IpAdapterSet()
    if loop is not None and takes_ip_adapters(pipeline):
        loop.image_prompts = ip_adapters
    identity = f"{source}|{checked.revision}" if checked.revision else source  # a moved branch: other weights
    base = hashlib.sha256(f"{identity}|{type(pipeline).__name__}|{dtype}{checked.extras.identity()}".encode()
                          ).hexdigest()
    logger.info("loaded %s (%s, %s) on %s: %s; sizes from %d in steps of %d; %s", source, type(pipeline).__name__,
                dtype, platform.device, ", ".join(f"{c.name}={c.parameter_count}" for c in components.values()),
                capabilities.min_size, capabilities.size_multiple, capabilities)
    return LoadedModel(source=source, directory=checked.directory, defaults=defaults, pipeline=pipeline, dtype=dtype,
                       device=platform.device, components=components, base_version=base, adapter=adapter,
                       roots=checked.roots, adapters=adapters or AdapterSet(), ip_adapters=ip_adapters, loop=loop,
                       acceleration=plan, row_cache=row_cache, acceleration_offer=offered,
                       preview=latent_preview(pipeline), revision=checked.revision, extras=checked.extras,
                       controlnets=controlnets or ControlNets())


def _compile_for_requests(adapter: PipelineAdapter, loop: DenoisingLoop | None, row_cache: StepCache | None) -> None:
    """Builds the compiled kernels requests run before the model is ready. Dynamo specializes a
    size of 1, so after the canaries (one image of one token) the first image of a usual size, and
    then the first batch of two, would each compile again while serving; one step of one image and
    one of two, at a size of several tokens, through the pipeline call and the step loop as requests
    run them, compile those graphs, which take any larger batch and size (``dynamic=True``)."""
    capabilities = adapter.capabilities
    size = 2 * (capabilities.min_size or capabilities.size_multiple)
    if capabilities.max_size and size > capabilities.max_size:
        size = capabilities.max_size
    text_to_image = "TEXT_TO_IMAGE" in capabilities.tasks  # an edit model's call needs an image
    with torch.inference_mode():
        for count in (1, 2):
            if text_to_image:
                with (contextlib.nullcontext() if row_cache is None
                      else row_cache.pipeline_call([row_cache.threshold] * count, 1)):
                    adapter.generate(ImageRows.of("", "", list(range(count))),
                                     GenerationParams(width=size, height=size, num_inference_steps=1,
                                                      guidance_scale=capabilities.default_guidance),
                                     lambda done, total: None)
            if loop is not None:
                loop.step([loop.start(SequenceSpec(f"warm-up {n}", "", size, size, 1, 2.0, n, (),
                                                   source=_edit_source(loop.pipeline, capabilities, size)),
                                      PromptCache(0), "")
                           for n in range(count)], row_cache)
    if row_cache is not None:
        row_cache.reset()


def _loop_canary(pipeline: DiffusionPipeline, platform: Platform, capabilities: Capabilities,
                 row_cache: StepCache | None) -> DenoisingLoop | None:
    """The pipeline's step-level loop, once one guided step of one image at the smallest size has
    run through it; None (request-level batching, with a warning) if there is none or it fails."""
    loop = loop_for(pipeline, platform.device)
    if loop is None:
        return None
    size = capabilities.min_size or capabilities.size_multiple
    try:
        with torch.inference_mode():
            sequence = loop.start(SequenceSpec("canary", "", size, size, 1, 2.0, 0, (),
                                               source=_edit_source(pipeline, capabilities, size)), PromptCache(0), "")
            loop.step([sequence], row_cache)
            loop.decode([sequence])
    except Exception as error:  # noqa: BLE001 - any failure means the loop cannot serve this model
        logger.warning("%s's step-level loop fails (%s): request-level batching only", type(pipeline).__name__,
                       short_reason(error))
        return None
    return loop


def _edit_source(pipeline: DiffusionPipeline, capabilities: Capabilities, size: int) -> ImageSource | None:
    """What a canary or warm-up sequence of an edit model (its call needs an image) starts from: a
    grey image, as the adapter's canary edits; None (text to image) for any other model."""
    if "TEXT_TO_IMAGE" in capabilities.tasks:
        return None
    return ImageSource("EDIT", pipeline, Image.new("RGB", (size, size), (128, 128, 128)), 1.0)
