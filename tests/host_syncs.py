"""Counts what would make the host wait for an accelerator, on the CPU where nothing does.

On CPU every tensor is on the host, so a device sync cannot be seen as such; ``HostSyncs`` sees the
operations that WOULD wait on an accelerator, applied to "device" tensors: those derived (by any
operation, transitively) from the tensors it is told live on the device (``on_device``: the model's
weights, the sequences' latents, timesteps and prompt embeddings). Values diffusers keeps on the host
by design (the schedulers' ``sigmas``, moved ``.to("cpu")`` "to avoid too much CPU/GPU communication")
and plain Python numbers are not device tensors, as on a GPU.

What it counts, on device tensors only:

- ``scalar_reads``: the dispatcher's scalar reads (``aten::item``, ``aten::_local_scalar_dense``,
  ``aten::is_nonzero``, ``aten::equal``): ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``,
  ``if t:``, ``t.__index__`` (a tensor as a list index), ``torch.equal``;
- ``data_dependent``: operations whose output shape depends on the values, which wait for them
  on CUDA (``aten::nonzero``, ``aten::masked_select``, ``aten::unique*``, indexing by a boolean mask);
- ``transfers`` (and ``bytes_to_host``): the conversions to host memory called on a tensor
  (``Tensor.cpu``, ``Tensor.numpy``, ``Tensor.tolist``, ``Tensor.__array__``: ``np.asarray(t)``),
  seen by a ``TorchFunctionMode`` since on CPU they dispatch nothing distinctive. A ``.to("cpu")``
  is not counted (on CPU it cannot be told from a move to the tensor's own device).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_SCALAR_READS = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal"}
_DATA_DEPENDENT = {"aten::nonzero", "aten::nonzero_static", "aten::masked_select", "aten::unique",
                   "aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim"}
_TO_HOST = {"cpu", "numpy", "tolist", "__array__"}


@dataclass
class Counts:
    scalar_reads: list[str] = field(default_factory=list)
    data_dependent: list[str] = field(default_factory=list)
    transfers: list[str] = field(default_factory=list)
    bytes_to_host: int = 0
    # Each of them in order: the operation's name and its caller (the first frame outside torch).
    events: list[tuple[str, str]] = field(default_factory=list)

    @property
    def syncs(self) -> list[str]:
        """Everything that would wait for the device, in order, by the operation's name."""
        return [name for name, _ in self.events]

    @property
    def origins(self) -> list[str]:
        return [origin for _, origin in self.events]

    def add(self, kind: list[str], name: str) -> None:
        kind.append(name)
        self.events.append((name, _caller()))


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _caller() -> str:
    """Where the operation was called from: the innermost frame outside torch and this module, as
    ``path:line`` (site-packages' paths from the package on)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in path and path != __file__:
            return f"{path.rpartition('site-packages' + os.sep)[2]}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class _Dispatch(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        derived = any(self.syncs.is_on_device(tensor) for tensor in inputs)
        name = func._schema.name
        if derived and self.syncs.counting:
            counts = self.syncs.counts
            if name in _SCALAR_READS:
                counts.add(counts.scalar_reads, name)
            elif name in _DATA_DEPENDENT or (name == "aten::index" and any(
                    index is not None and index.dtype == torch.bool for index in _tensors(args[1:]))):
                counts.add(counts.data_dependent, name)
        output = func(*args, **kwargs)
        if derived:
            self.syncs.on_device(_tensors(output))
        return output


class _Functions(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if (name in _TO_HOST and self.syncs.counting and args and isinstance(args[0], torch.Tensor)
                and self.syncs.is_on_device(args[0])):
            self.syncs.counts.add(self.syncs.counts.transfers, f"Tensor.{name}")
            self.syncs.counts.bytes_to_host += args[0].numel() * args[0].element_size()
            output = func(*args, **(kwargs or {}))
            if isinstance(output, torch.Tensor):  # on the host now (on CPU: the same tensor)
                self.syncs.off_device(output)
            return output
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Within ``with syncs:``, counts (``counts``) what would sync on device tensors, while
    ``counting``; tensors derived from device tensors are device tensors from then on."""

    def __init__(self) -> None:
        self._device: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.counts = Counts()
        self.counting = True
        self._modes: tuple[_Functions, _Dispatch] | None = None

    def on_device(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self._device[tensor] = True

    def off_device(self, tensor: torch.Tensor) -> None:
        self._device.pop(tensor, None)

    def modules_on_device(self, modules: Iterable[torch.nn.Module]) -> None:
        for module in modules:
            self.on_device(module.parameters())
            self.on_device(module.buffers())

    def is_on_device(self, tensor: torch.Tensor) -> bool:
        return tensor in self._device

    def take(self) -> Counts:
        """The counts so far, starting new ones."""
        counts, self.counts = self.counts, Counts()
        return counts

    def __enter__(self) -> HostSyncs:
        self._modes = (_Functions(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._modes is not None
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None
