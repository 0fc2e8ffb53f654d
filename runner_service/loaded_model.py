"""The loaded pipeline: its components discovered by name, its weights held in process memory."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from runner_service.model_roots import ModelRoots
from runner_service.models.builtin import BUILTIN_MODELS, ensure_builtin
from runner_service.platforms import Platform
from serving_common.errors import failed_precondition, invalid_argument
from serving_common.protocol import DTYPES

logger = logging.getLogger(__name__)

# The protocol's dtype names are torch's own.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}


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
    """One LoadWeights in effect: the digest of the files read and the components it changed."""

    digest: str
    components: frozenset[str]


@dataclass
class LoadedModel:
    source: str
    directory: Path
    pipeline: DiffusionPipeline
    dtype: torch.dtype
    device: torch.device
    components: dict[str, Component]
    base_version: str
    # Each LoadWeights still in effect, in the order applied.
    weight_updates: list[WeightUpdate] = field(default_factory=list)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def weights_version(self) -> str:
        digest = hashlib.sha256(self.base_version.encode())
        for update in self.weight_updates:
            digest.update(update.digest.encode())
        return digest.hexdigest()[:16]

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

    def reload_parameters(self, name: str) -> dict[str, torch.Tensor]:
        """Reads one component's parameters afresh from the model's source (sleep level 2 wake).

        The component's safetensors files are read directly when they hold every parameter
        (several times faster than building the module again); otherwise the component's
        class loads it with ``from_pretrained``.
        """
        module = self.components[name].module
        wanted = dict(module.named_parameters())
        stored: dict[str, torch.Tensor] = {}
        for file in _weight_files(self.directory / name):
            stored.update(load_file(file))
        if not set(wanted) <= set(stored):
            fresh = type(module).from_pretrained(self.directory, subfolder=name, torch_dtype=self.dtype)
            stored = dict(fresh.named_parameters())
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


def resolve_source(source: str, cache_dir: Path | None, roots: ModelRoots) -> Path:
    if source in BUILTIN_MODELS:
        return ensure_builtin(source, cache_dir)
    directory = roots.check(source, "source")
    if not (directory / "model_index.json").is_file():
        raise invalid_argument(
            {"source": f"{source!r} is neither a built-in model {sorted(BUILTIN_MODELS)} "
                       "nor a diffusers model directory (no model_index.json)"}
        )
    return directory


def load_model(
    source: str, dtype_name: str | None, platform: Platform, cache_dir: Path | None, roots: ModelRoots
) -> LoadedModel:
    """Loads any diffusers text-to-image pipeline from a directory and moves it to the device.

    ``dtype_name`` is one of the protocol's ``DTYPES``; None means the platform's default.
    """
    directory = resolve_source(source, cache_dir, roots)
    dtype = TORCH_DTYPES[dtype_name] if dtype_name else platform.default_dtype()
    try:
        pipeline = DiffusionPipeline.from_pretrained(directory, torch_dtype=dtype)
    except (OSError, ValueError, TypeError) as error:
        raise failed_precondition(f"cannot load {source!r}: {error}") from error
    pipeline.to(platform.device)
    pipeline.set_progress_bar_config(disable=True)
    components = {}
    for name, module in pipeline.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        module.eval().requires_grad_(False)
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.data = own(tensor.data)
        parameters = list(module.parameters())
        components[name] = Component(
            name=name,
            module=module,
            parameter_count=sum(p.numel() for p in parameters),
            bytes=sum(p.numel() * p.element_size() for p in parameters),
        )
    platform.release_host_memory()
    base = hashlib.sha256(f"{source}|{type(pipeline).__name__}|{dtype}".encode()).hexdigest()
    logger.info("loaded %s (%s, %s) on %s: %s", source, type(pipeline).__name__, dtype, platform.device,
                ", ".join(f"{c.name}={c.parameter_count}" for c in components.values()))
    return LoadedModel(source=source, directory=directory, pipeline=pipeline, dtype=dtype,
                       device=platform.device, components=components, base_version=base)
