"""Single-file checkpoints: one ``.safetensors`` file in the original (A1111/ComfyUI) key layout,
loaded through diffusers' ``from_single_file``, offline.

A file holds weights only; the pipeline's configs (model_index.json, each component's config,
scheduler and tokenizers) come from a diffusers model of the same family, the file's *config*:

- one given to the runner with ``--single-file-config`` (a built-in model such as ``tiny``, a
  diffusers model directory, or a Hugging Face id in the hub cache), the one whose pipeline class
  is the family's where the family can be told from the keys, the only one given where it cannot;
- else, where the keys tell the family (Stable Diffusion 1.x/2.x, SDXL, SD3, Flux), the family's
  reference repository (diffusers' own choice, e.g. stabilityai/stable-diffusion-xl-base-1.0) when
  it is in the hub cache.

Nothing is downloaded: ``from_single_file`` is always given a local directory. A file whose family
cannot be told and no config, or a family whose config is nowhere here, is refused saying so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers.loaders.single_file_utils import (
    CHECKPOINT_KEY_NAMES,
    DIFFUSERS_DEFAULT_PIPELINE_PATHS,
    convert_open_clip_checkpoint,
    infer_diffusers_model_type,
)
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from safetensors import SafetensorError, safe_open

from serving_common.errors import failed_precondition, invalid_argument

SUFFIX = ".safetensors"

# The families loaded from one file: diffusers' model type (``infer_diffusers_model_type``) -> the
# pipeline class and the family's name in messages.
FAMILIES: dict[str, tuple[str, str]] = {
    "v1": ("StableDiffusionPipeline", "Stable Diffusion 1.x"),
    "v2": ("StableDiffusionPipeline", "Stable Diffusion 2.x"),
    "xl_base": ("StableDiffusionXLPipeline", "SDXL"),
    "sd3": ("StableDiffusion3Pipeline", "SD3"),
    "sd35_medium": ("StableDiffusion3Pipeline", "SD3.5 Medium"),
    "sd35_large": ("StableDiffusion3Pipeline", "SD3.5 Large"),
    "flux-dev": ("FluxPipeline", "Flux.1 dev"),
    "flux-schnell": ("FluxPipeline", "Flux.1 schnell"),
}
# Each family's key layout, by a prefix only its files have (the original repositories' module names).
LAYOUTS = (
    ("conditioner.embedders.1.model.", "StableDiffusionXLPipeline"),
    ("cond_stage_model.", "StableDiffusionPipeline"),
    ("model.diffusion_model.joint_blocks.", "StableDiffusion3Pipeline"),
    ("model.diffusion_model.double_blocks.", "FluxPipeline"),
)
# SDXL's second text encoder, in OpenCLIP's layout under this prefix (see ``_sdxl_text_encoder_2``).
_OPEN_CLIP_SDXL = "conditioner.embedders.1.model."

# A config source (--single-file-config) -> its diffusers model directory.
FindConfig = Callable[[str], Path]


def is_single_file(source: str) -> bool:
    """Whether a source names a single-file checkpoint (by its suffix, as A1111 and ComfyUI do)."""
    return source.lower().endswith(SUFFIX)


class CheckpointKeys(Mapping[str, torch.Tensor]):
    """A safetensors file's tensors by name, each read only when asked for: telling the family
    reads the names and a handful of small tensors, not the whole file."""

    def __init__(self, path: Path) -> None:
        try:
            self._file: Any = safe_open(str(path), framework="pt")
            self._keys: list[str] = list(self._file.keys())  # type: ignore[no-untyped-call]  # untyped in safetensors
        except (SafetensorError, OSError) as error:
            raise invalid_argument({"source": f"{path} is not a safetensors file: {error}"}) from None

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        tensor: torch.Tensor = self._file.get_tensor(key)
        return tensor

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def model_type(keys: Mapping[str, torch.Tensor]) -> str | None:
    """The family's diffusers model type (a key of ``FAMILIES``), or None where the keys do not tell
    one of them. diffusers answers "v1" for anything it does not recognise, so for that one its
    marker key must be there too (every other type is answered only on its own keys)."""
    inferred: str = infer_diffusers_model_type(keys)  # type: ignore[no-untyped-call]  # diffusers leaves it untyped
    if inferred not in FAMILIES or inferred == "v1" and CHECKPOINT_KEY_NAMES["v1"] not in keys:
        return None
    return inferred


def pipeline_class_name(config: Path) -> str:
    """The pipeline class a diffusers model directory's model_index.json names."""
    index = json.loads((config / "model_index.json").read_text())
    return str(index.get("_class_name", ""))


@dataclass(frozen=True)
class SingleFile:
    """A checked single-file checkpoint: the file, the diffusers directory its configs come from,
    and the pipeline class that loads it."""

    path: Path
    config: Path
    pipeline_class: str

    def load(self, dtype: torch.dtype, components: Mapping[str, Any] | None = None) -> DiffusionPipeline:
        """The pipeline, read from the file (``components``: ones given instead of read)."""
        cls = getattr(diffusers, self.pipeline_class, None)
        if cls is None or not hasattr(cls, "from_single_file"):
            raise failed_precondition(f"{self.pipeline_class} (from {self.config}) cannot load a single file")
        given = dict(components or {})
        if self.pipeline_class.startswith("StableDiffusionXL") and "text_encoder_2" not in given:
            given["text_encoder_2"] = _sdxl_text_encoder_2(self, dtype)
        pipeline: DiffusionPipeline = cls.from_single_file(str(self.path), config=str(self.config),
                                                           local_files_only=True, dtype=dtype, **given)
        return pipeline


def layout_class(keys: Mapping[str, torch.Tensor]) -> str | None:
    """The pipeline class a file's key layout belongs to, whatever its sizes (a fine-tune or a small
    build diffusers' ``model_type`` does not recognise); None for a layout of none of them."""
    for prefix, class_name in LAYOUTS:
        if any(key.startswith(prefix) for key in keys):
            return class_name
    return None


def check(path: Path, configs: Sequence[str], find_config: FindConfig, find_cached: FindConfig) -> SingleFile:
    """Tells a single file's family and finds its config (see the module's docstring).

    ``find_config`` makes a ``--single-file-config`` source a directory; ``find_cached`` finds a
    family's reference repository in the hub cache (raising where it is not there)."""
    keys = CheckpointKeys(path)
    inferred = model_type(keys)
    class_name = FAMILIES[inferred][0] if inferred else layout_class(keys)
    given = [find_config(source) for source in configs]
    if class_name is None and len(given) == 1:
        return SingleFile(path, given[0], pipeline_class_name(given[0]))
    if class_name is None:
        raise invalid_argument({"source": (
            f"{path}: its model family cannot be told from its keys (none of Stable Diffusion 1.x/2.x, SDXL, SD3 "
            "or Flux's layouts); start the runner with one --single-file-config naming a diffusers model of its "
            f"family (a directory, a Hugging Face id in the cache or a built-in model){_given(configs)}")})
    for directory in given:
        if pipeline_class_name(directory) == class_name:
            return SingleFile(path, directory, class_name)
    if inferred is None:
        raise failed_precondition(
            f"{path} is a {class_name} checkpoint of sizes no reference model has; start the runner with a "
            f"--single-file-config of that pipeline class and those sizes{_given(configs)}")
    family = FAMILIES[inferred][1]
    reference = DIFFUSERS_DEFAULT_PIPELINE_PATHS[inferred]["pretrained_model_name_or_path"]
    try:
        directory = find_cached(reference)
    except Exception as error:  # noqa: BLE001 - told with what to do instead
        raise failed_precondition(
            f"{path} is a {family} checkpoint; its configs come from a diffusers model of that family: "
            f"{reference} is not in the Hugging Face cache on the runner ({error}), and no --single-file-config "
            f"of pipeline class {class_name} was given{_given(configs)}") from None
    return SingleFile(path, directory, class_name)


def _given(configs: Sequence[str]) -> str:
    return f" (given: {', '.join(configs)})" if configs else ""


def _sdxl_text_encoder_2(file: SingleFile, dtype: torch.dtype) -> torch.nn.Module:
    """SDXL's second text encoder read from the file's OpenCLIP tensors. diffusers takes the first
    encoder's CLIP tensors instead where both encoders are as wide (its checks go by the position
    embedding's width), which small builds are."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig.from_pretrained(file.config / "text_encoder_2")
    model = CLIPTextModelWithProjection(config)
    state: dict[str, torch.Tensor] = convert_open_clip_checkpoint(  # type: ignore[no-untyped-call]  # untyped
        model, CheckpointKeys(file.path), prefix=_OPEN_CLIP_SDXL)
    model.load_state_dict(state, strict=False)
    missing = {name for name, _ in model.named_parameters()} - set(state)
    if missing:
        raise failed_precondition(f"{file.path} lacks SDXL's second text encoder tensors: {sorted(missing)[:3]}")
    module: torch.nn.Module = model
    return module.requires_grad_(False).to(dtype).eval()
