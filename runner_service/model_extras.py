"""What a model is loaded with beyond a diffusers directory: a single-file checkpoint's weights,
components from elsewhere and adapters fused in (LoadModelRequest.component_overrides and
.fused_adapters), checked before anything loads and kept with the model, so that a level-2
wake-up reads each component from where it came and fuses the adapters again."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from diffusion.v1 import common_pb2
from runner_service.component_overrides import CheckedOverride
from runner_service.fused_adapters import CheckedFusion, fuse
from runner_service.model_roots import ModelRoots
from runner_service.single_file import SingleFile
from serving_common.errors import invalid_argument
from serving_common.load_extras import extras_violations


@dataclass(frozen=True)
class LoadOptions:
    """A LoadModel's overrides (name, source) and fused adapters (source, scale or None), as asked."""

    component_overrides: tuple[tuple[str, str], ...] = ()
    fused_adapters: tuple[tuple[str, float | None], ...] = ()

    @classmethod
    def from_proto(cls, overrides: Sequence[common_pb2.ComponentOverride],
                   fused: Sequence[common_pb2.FusedAdapter]) -> LoadOptions:
        """The request's lists; INVALID_ARGUMENT naming the field where they are out of bounds."""
        violations = extras_violations(overrides, fused)
        if violations:
            raise invalid_argument(violations)
        return cls(tuple((o.name, o.source) for o in overrides),
                   tuple((f.source, f.scale if f.HasField("scale") else None) for f in fused))

    def overrides_proto(self) -> list[common_pb2.ComponentOverride]:
        return [common_pb2.ComponentOverride(name=name, source=source) for name, source in self.component_overrides]

    def fused_proto(self) -> list[common_pb2.FusedAdapter]:
        return [common_pb2.FusedAdapter(source=source, scale=scale) for source, scale in self.fused_adapters]


@dataclass(frozen=True)
class ModelExtras:
    """The checked extras of one model (none: a plain diffusers directory)."""

    options: LoadOptions = LoadOptions()
    single_file: SingleFile | None = None
    overrides: tuple[CheckedOverride, ...] = ()
    fusions: tuple[CheckedFusion, ...] = ()

    def identity(self) -> str:
        """What the model's weights version depends on besides its source: the fused adapters' bytes
        and scales and the components' sources."""
        if not (self.overrides or self.fusions):
            return ""
        parts = [f"{o.name}={o.source}" for o in self.overrides] + [f"{f.digest}*{f.scale}" for f in self.fusions]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()

    def load_pipeline(self, directory: Path, dtype: torch.dtype) -> DiffusionPipeline:
        """The pipeline with its overrides in place, from the single file or the directory, and the
        adapters not fused yet (``fuse_adapters``, once it is on its device)."""
        components = {override.name: override.load(dtype) for override in self.overrides}
        if self.single_file is not None:
            return self.single_file.load(dtype, components)
        pipeline: DiffusionPipeline = DiffusionPipeline.from_pretrained(directory, dtype=dtype, **components)
        return pipeline

    def fuse_adapters(self, pipeline: DiffusionPipeline, components: Sequence[str] | None = None) -> None:
        fuse(pipeline, self.fusions, components)

    def weights_source(self, name: str, directory: Path, roots: ModelRoots) -> tuple[Path, ModelRoots] | None:
        """Where component ``name``'s weights are read back from (a level-2 wake-up), with the roots
        confining the reads: the model directory's subfolder or an override's directory; None
        where they are in a single file (``fresh_component``)."""
        override = next((o for o in self.overrides if o.name == name), None)
        if override is not None:
            return None if override.single_file is not None else (override.directory, override.roots)
        return None if self.single_file is not None else (directory / name, roots)

    def fresh_component(self, name: str, dtype: torch.dtype) -> torch.nn.Module:
        """Component ``name`` read again from a single file: the override's, or the model's own
        (the whole pipeline is read for it: diffusers converts a file's components together)."""
        override = next((o for o in self.overrides if o.name == name), None)
        if override is not None:
            return override.load(dtype)
        if self.single_file is None:
            raise AssertionError(f"{name} is read from its directory")
        module: torch.nn.Module = getattr(self.single_file.load(dtype), name)
        return module
