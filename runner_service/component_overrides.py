"""Components taken from elsewhere than the model (LoadModelRequest.component_overrides), as
A1111 users swap a VAE.

Each is checked against the pipeline's own component from the configs alone, before anything is
loaded or unloaded: the pipeline must have a component of that name holding weights, the
override must be of the class the pipeline expects there, and agree with the model's own
component on every config field through which it meets the rest of the pipeline
(``INTERFACE_FIELDS``: the latent channels of a VAE, the width of a text encoder...). Its source
is a diffusers model directory (its subfolder of that name is taken), a component's own directory
(config.json and weights), a Hugging Face id of either in the hub cache, or a single file holding
only it (a diffusers model class's ``from_single_file``, configured as the model's own).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers

from runner_service.model_roots import ModelRoots
from runner_service.single_file import is_single_file
from serving_common.errors import invalid_argument

# Config fields through which a component meets the rest of its pipeline.
INTERFACE_FIELDS = ("in_channels", "out_channels", "latent_channels", "cross_attention_dim", "hidden_size",
                    "projection_dim", "joint_attention_dim", "pooled_projection_dim", "vocab_size")
# The libraries whose components hold weights (the others: schedulers, tokenizers, processors).
_LIBRARIES = {"diffusers": diffusers, "transformers": transformers}

# A source -> the directory or file it names and the roots its reads are confined to.
Locate = Callable[[str, str], tuple[Path, ModelRoots]]


@dataclass(frozen=True)
class CheckedOverride:
    """One checked override: the pipeline's component ``name`` of class ``library.class_name``, read
    from ``directory`` (config.json and weights), or from ``single_file`` configured as the
    model's own component in ``directory``."""

    name: str
    source: str
    library: str
    class_name: str
    directory: Path
    roots: ModelRoots
    single_file: Path | None = None

    def load(self, dtype: torch.dtype) -> torch.nn.Module:
        cls = getattr(_LIBRARIES[self.library], self.class_name)
        if self.single_file is not None:
            module: torch.nn.Module = cls.from_single_file(
                str(self.single_file), config=str(self.directory.parent), subfolder=self.name,
                local_files_only=True, torch_dtype=dtype)
        else:
            module = cls.from_pretrained(self.directory, dtype=dtype)
        return module


def _config(directory: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return loaded


def _class_of(config: dict[str, Any]) -> str:
    """A component's class as its config names it (diffusers: _class_name; transformers: architectures)."""
    if "_class_name" in config:
        return str(config["_class_name"])
    architectures = config.get("architectures") or [""]
    return str(architectures[0])


def check_overrides(requested: Sequence[tuple[str, str]], model: Path, locate: Locate) -> tuple[CheckedOverride, ...]:
    """Checks each (name, source) against the diffusers model directory ``model`` (the model's own,
    or a single file's config); INVALID_ARGUMENT naming ``component_overrides[i]`` where one does
    not fit."""
    if not requested:  # a model whose index cannot be read is the load's to refuse, not this check's
        return ()
    index = json.loads((model / "model_index.json").read_text())
    weighted = {name: spec for name, spec in index.items()
                if not name.startswith("_") and isinstance(spec, list) and spec[0] in _LIBRARIES}
    checked = []
    for position, (name, source) in enumerate(requested):
        field = f"component_overrides[{position}]"
        if name not in weighted:
            raise invalid_argument({f"{field}.name": f"{name!r} is not a component of {index.get('_class_name')} "
                                                     f"holding weights; it has {sorted(weighted)}"})
        library, class_name = weighted[name]
        if is_single_file(source):
            path, roots = locate(source, f"{field}.source")
            roots.regular_file(path, f"{field}.source")
            if not hasattr(getattr(_LIBRARIES[library], class_name), "from_single_file"):
                raise invalid_argument({f"{field}.source": f"{class_name} cannot be read from a single file; give "
                                                           "a diffusers directory holding it"})
            checked.append(CheckedOverride(name, source, library, class_name, model / name, roots, path))
            continue
        directory, roots = _component_directory(name, source, locate, f"{field}.source")
        theirs = _config(directory)
        if _class_of(theirs) != class_name:
            holds = _class_of(theirs) or "component of no named class"
            raise invalid_argument({f"{field}.source": f"{source} holds a {holds}; {name} of this pipeline is a "
                                                        f"{class_name}"})
        own = _config(model / name) if (model / name / "config.json").is_file() else {}
        differ = [f"{key} {theirs[key]} (the model's: {own[key]})" for key in INTERFACE_FIELDS
                  if key in own and key in theirs and own[key] != theirs[key]]
        if differ:
            raise invalid_argument({f"{field}.source": f"{source} does not fit this pipeline's {name}: "
                                                        + ", ".join(differ)})
        checked.append(CheckedOverride(name, source, library, class_name, directory, roots))
    return tuple(checked)


def _component_directory(name: str, source: str, locate: Locate, field: str) -> tuple[Path, ModelRoots]:
    """The directory holding the component: the source's subfolder ``name`` for a model directory,
    else the source itself; every entry checked inside the roots."""
    path, roots = locate(source, field)
    directory = path / name if (path / "model_index.json").is_file() else path
    if not (directory / "config.json").is_file():
        raise invalid_argument({field: f"{source} is neither a diffusers model with a {name} folder nor a "
                                       "component's directory (no config.json)"})
    roots.model_tree(directory, field)
    roots.regular_file(directory / "config.json", field)
    return directory, roots
