"""LoadWeights: named tensors from safetensors files, checked in full before anything changes."""

from __future__ import annotations

import hashlib
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.models.modeling_utils import ModelMixin
from safetensors import SafetensorError
from safetensors.torch import load

from runner_service.adapters import canonical_state
from runner_service.checkpoint_keys import loaded_names
from runner_service.loaded_model import LoadedModel, WeightUpdate
from runner_service.model_roots import MAX_WEIGHT_FILES, ModelRoots, RegularFile
from runner_service.tensor_parts import is_composite, split
from serving_common.errors import failed_precondition, invalid_argument
from serving_common.tensor_stream import still_needed, tensor_preamble

# Digests in messages: enough hex to tell files apart at a glance.
SHORT_DIGEST = 12
# Unknown tensor names quoted in a message; the rest are counted.
SHOWN_NAMES = 5


@dataclass(frozen=True)
class WeightsLoaded:
    """What one LoadWeights did: the tensor names copied, the update now in effect (None when the
    files held no tensors, which changes nothing) and the model's weights version after it."""

    names: list[str]
    update: WeightUpdate | None
    weights_version: str


def weight_files(path: Path, roots: ModelRoots) -> list[RegularFile]:
    """The files a LoadWeights of ``path`` reads: the file itself, or a directory's ``*.safetensors``
    in name order, each resolved, inside the roots and a regular file (nothing opened yet)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise invalid_argument({"path": f"{path} does not exist on the runner"}) from None
    except OSError as error:
        raise invalid_argument({"path": f"{path} cannot be read: {error.strerror}"}) from None
    if not stat.S_ISDIR(mode):
        return [roots.regular_file(path, "path")]
    names = []
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name.endswith(".safetensors"):
                names.append(entry.name)
                if len(names) > MAX_WEIGHT_FILES:
                    raise invalid_argument({"path": f"{path} holds more than {MAX_WEIGHT_FILES} .safetensors files"})
    if not names:
        raise invalid_argument({"path": f"{path} holds no .safetensors files"})
    return [roots.regular_file(path / name, "path") for name in sorted(names)]


def read_tensors(path: Path, roots: ModelRoots, max_bytes: int) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor in a .safetensors file or a directory of them, and a digest of their bytes.

    At most ``max_bytes`` are read in all: the sizes are checked before the first read, and
    each read is bounded by what is left.
    """
    files = weight_files(path, roots)
    size = sum(file.size for file in files)
    if size > max_bytes:
        raise invalid_argument({"path": f"{path} holds {size} bytes; this runner reads at most {max_bytes} "
                                        "per LoadWeights (--max-weights-bytes)"})
    tensors: dict[str, torch.Tensor] = {}
    digest = hashlib.sha256()
    left = max_bytes
    for file in files:
        data = roots.read(file, "path", left)
        left -= len(data)
        digest.update(data)
        try:
            loaded = load(data)
        except (SafetensorError, ValueError) as error:
            raise invalid_argument({"path": f"{file.shown} is not a safetensors file: {error}"}) from error
        duplicates = sorted(set(loaded) & set(tensors))
        if duplicates:
            raise invalid_argument({"path": f"tensors appear in more than one file: {duplicates[:SHOWN_NAMES]}"})
        tensors.update(loaded)
    return tensors, digest.hexdigest()


def load_weights(model: LoadedModel, path: Path, roots: ModelRoots, max_bytes: int, expected_digest: str = "",
                 before_change: Callable[[], None] = lambda: None) -> WeightsLoaded:
    """Copies the file's tensors into the model, all or nothing.

    Names are ``<component>.<parameter or buffer name>``. The digest (when ``expected_digest`` is
    set) and every name, shape and dtype are checked before the first copy, so a bad file
    changes nothing. ``before_change`` runs right before the first copy and may raise to stop
    it (the caller is gone).
    """
    tensors, digest = read_tensors(path, roots, max_bytes)
    if expected_digest and expected_digest != digest:
        raise failed_precondition(
            f"{path} has digest {digest[:SHORT_DIGEST]}, not the expected {expected_digest[:SHORT_DIGEST]}; "
            "nothing loaded"
        )
    return apply_tensors(model, tensors, digest, before_change)


def diffusers_names(module: ModelMixin, keys: list[str], state: dict[str, torch.Tensor]) -> dict[str, str]:
    """For each of ``keys`` (none of them ``state``'s names), the name diffusers' own on-load fix-up
    gives it, when that is one of ``state``'s names.

    ``from_pretrained`` renames an old checkpoint's attention blocks (``query`` to ``to_q``,
    ``proj_attn`` to ``to_out.0``...) with ``ModelMixin._fix_state_dict_keys_on_load``; it moves
    entries by key, so it runs here on the names alone. The base class's method, not the module's:
    an override may also change the module (Cosmos3's drops its encoder when no key names it).
    """
    fixed: OrderedDict[str, str] = OrderedDict((key, key) for key in keys)
    ModelMixin._fix_state_dict_keys_on_load(module, fixed)
    return {given: name for name, given in fixed.items() if name != given and name in state}


def module_names(module: torch.nn.Module, keys: list[str], state: dict[str, torch.Tensor]) -> dict[str, str]:
    """For each of ``keys`` that is not one of ``state``'s names, the module's name for it, through
    its own library's key conversion on load: a component's ``save_pretrained`` file (transformers
    saves the names it converts on load back in the checkpoint's form) or an old checkpoint loads
    back as ``from_pretrained`` would load it. Keys neither conversion gives a name of ``state``
    are left out (they stay unknown)."""
    renamed = loaded_names(module, keys, state)
    if isinstance(module, ModelMixin):
        left = [key for key in keys if key not in state and key not in renamed]
        if left:
            renamed.update(diffusers_names(module, left, state))
    return renamed


def apply_tensors(model: LoadedModel, tensors: dict[str, torch.Tensor], digest: str,
                  before_change: Callable[[], None] = lambda: None, pushed: bool = False) -> WeightsLoaded:
    """Copies named tensors (``<component>.<name>``, the module's name or its checkpoint's) into
    the model, all or nothing: every name, shape and dtype is checked before the first copy. The
    update is recorded with ``digest`` (``pushed``: from PushWeights); the names reported are the
    module's."""
    if not tensors:
        return WeightsLoaded([], None, model.weights_version)
    targets: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    mismatched: dict[str, str] = {}
    asleep = set()
    states = {name: canonical_state(component.module) for name, component in model.components.items()}
    keys: dict[str, list[str]] = {}
    for name in tensors:
        component_name, _, key = name.partition(".")
        keys.setdefault(component_name, []).append(key)
    renamed = {component_name: module_names(model.components[component_name].module, names, states[component_name])
               for component_name, names in keys.items() if component_name in model.components}
    loaded: dict[str, torch.Tensor] = {}
    given_as: dict[str, str] = {}
    for given, value in tensors.items():
        component_name, _, key = given.partition(".")
        key = renamed.get(component_name, {}).get(key, key)
        name = f"{component_name}.{key}"
        if name in given_as:
            # The module's name and its checkpoint's (or two checkpoint names) for one tensor.
            mismatched[given] = f"the same tensor as {given_as[name]} ({name})"
            continue
        given_as[name] = given
        loaded[name] = value
        target = states.get(component_name, {}).get(key)
        if target is None:
            unknown.append(given)
            continue
        if model.components[component_name].asleep:
            asleep.add(component_name)
            continue
        if target.shape != value.shape or target.dtype != value.dtype:
            mismatched[name] = (f"file has {tuple(value.shape)} {value.dtype}, "
                                f"model has {tuple(target.shape)} {target.dtype}")
        targets[name] = target
    if unknown:
        unknown.sort()
        more = f" and {len(unknown) - SHOWN_NAMES} more" if len(unknown) > SHOWN_NAMES else ""
        raise invalid_argument(
            {f"tensors[{name}]": "unknown tensor name" for name in unknown},
            f"{len(unknown)} unknown tensor names: {', '.join(unknown[:SHOWN_NAMES])}{more}",
        )
    if mismatched:
        raise invalid_argument({f"tensors[{name}]": why for name, why in mismatched.items()})
    if asleep:
        raise failed_precondition(f"components asleep: {', '.join(sorted(asleep))}; call WakeUp first")
    quantized = sorted({name.partition(".")[0] for name, target in targets.items() if is_composite(target)})
    if quantized:
        raise failed_precondition(f"{', '.join(quantized)} holds {model.acceleration.quantization} weights, which "
                                  "LoadWeights and PushWeights cannot set; Init the model again to change them")
    with one_host_thread():
        non_finite = first_non_finite({given_as[name]: loaded[name] for name in targets})
        if non_finite is not None:
            raise invalid_argument({f"tensors[{non_finite}]": "holds NaN or infinite values"},
                                   f"tensor {non_finite} holds NaN or infinite values; nothing loaded")
        before_change()
        with torch.no_grad():
            for name, target in targets.items():
                target.copy_(loaded[name].to(target.device))
    update = WeightUpdate(digest, frozenset(name.partition(".")[0] for name in targets), pushed, frozenset(targets))
    # An update whose every tensor this one sets again is not needed to rebuild the weights: the
    # worker drops it from its desired state by the same rule, so both lists stay alike.
    model.weight_updates = still_needed([*model.weight_updates, update])
    return WeightsLoaded(sorted(targets), update, model.weights_version)


@contextmanager
def one_host_thread() -> Iterator[None]:
    """torch's work on the host runs on the calling thread alone for the block (the thread's own
    setting, put back after). An update's checks and copies are one pass over memory each, which a
    second thread barely speeds up; but each of their hundreds of parallel regions waits for its
    slowest thread, and on a busy CPU that is one the scheduler has put aside: with both cores of
    the 2-core machine loaded, the non-finite check of 51 MB took 1.05 s on 2 threads and 9 ms on
    one, the copies 0.31 s and 0.09 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None.

    A sum is finite only when every element is (a NaN or an infinity carries through it), so one
    cheap reduction per tensor clears it; only a sum that is not finite (which may also be an
    overflow of large finite values) is checked element by element."""
    with torch.no_grad():
        for name, tensor in tensors.items():
            if (tensor.is_floating_point() and not bool(torch.isfinite(tensor.sum()))
                    and not bool(torch.isfinite(tensor).all())):
                return name
    return None


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw bytes, row-major, in host byte order (little-endian on every platform served)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights_checksum(model: LoadedModel) -> str:
    """sha256 over every parameter of every component, in name order: its name, dtype and shape (as
    a PushWeights stream hashes them), then its bytes; adapter tensors left out. Kept until the
    weights change."""
    version = model.weights_version
    if model.checksum_cache[0] == version:
        return model.checksum_cache[1]
    model.require_awake()
    digest = hashlib.sha256()
    for component in sorted(model.components):
        state = canonical_state(model.components[component].module, buffers=False)
        # A quantized tensor counts as its parts (int8 data, scales), in name order.
        plain, _ = split(state)
        for name in sorted(plain):
            tensor = plain[name]
            digest.update(tensor_preamble(f"{component}.{name}", str(tensor.dtype).removeprefix("torch."),
                                          tuple(tensor.shape)))
            digest.update(tensor_bytes(tensor))
    model.checksum_cache = (version, digest.hexdigest())
    return model.checksum_cache[1]
