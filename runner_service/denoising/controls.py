"""ControlNet residuals in a step batch: each row steered by its own ControlNets, at its own scale
and over its own part of the steps, rows without any beside them in the same denoiser call.

What one step does is what diffusers' ControlNet pipelines (``StableDiffusion[XL]ControlNetPipeline``,
``StableDiffusion3ControlNetPipeline``, ``FluxControlNetPipeline``) do for their whole batch: a
ControlNet is kept at step ``i`` of ``n`` unless ``i / n < start`` or ``(i + 1) / n > end`` (their
``controlnet_keep``), it reads the rows' model input, timestep and text conditioning with its own
arguments (its conditioning image as the family's pipeline prepares it: pixels for the UNet
families, VAE latents for SD3 and Flux), its residuals are multiplied by the scale, several
ControlNets of one row are summed in the request's order (the families' ``MultiControlNetModel``),
and the denoiser adds them to its blocks. Rows are grouped per ControlNet (and per place in their
request's list, so that sums keep that order): one ControlNet call per group. A row whose
ControlNets are all off at this step, or that has none, gets zeros, which leave the denoiser's
features exactly as they are; a call where no row has one passes no residuals at all.

A sequence's rows need not each be read by the ControlNet: Flux's pipeline runs it on the positive
prompt alone and adds the same residuals to its true-CFG negative pass (``ControlledRows.sources``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

# What a family's ControlNet call returns: its residual lists (the UNet's down blocks and middle
# block; SD3's transformer blocks; Flux's double and single blocks), None where it has none of a kind.
ResidualLists = list[list[torch.Tensor] | None]
# A family's ControlNet call: the ControlNet, the call's rows it reads (indices into the denoiser
# call's inputs) and its own arguments for them (one row each), to its residuals at scale 1.
RunControlNet = Callable[[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor]], ResidualLists]
# How the denoiser reads a residual list of another length than a ControlNet of the same call
# made: list ``position``'s residuals, one per block of the denoiser, as it indexes them.
Spread = Callable[[int, list[torch.Tensor]], list[torch.Tensor]]
# SD3's pipeline draws the control image's VAE noise from torch's global generator: here from a
# generator of the image's seed with these bits flipped (not its starting noise's stream).
CONTROL_NOISE_SALT = 0x5EED_C0DE


def control_noise_seed(seed: int) -> int:
    """The seed of the generator an image's control images draw their VAE noise from, where its
    family's pipeline draws it from torch's global generator (SD3)."""
    return seed ^ CONTROL_NOISE_SALT


@dataclass(frozen=True)
class SequenceControl:
    """One ControlNet of one image: its module, its conditioning image (1 x 3 x height x width
    float32 in [0, 1] on the device, ``control_image``), its scale, and the fractions of the steps
    it starts and ends at."""

    net: torch.nn.Module
    image: torch.Tensor
    scale: float
    start: float
    end: float

    @property
    def dtype(self) -> torch.dtype:
        """The ControlNet's dtype (the model's)."""
        return next(self.net.parameters()).dtype

    def scale_at(self, step: int, total: int) -> float:
        """Its scale at step ``step`` (0-based) of ``total``: 0 where the pipeline does not keep it.
        Start and end arrive as float32; read back at six decimals, they are the values the caller
        wrote (0.3, not 0.30000001), which the pipeline compares step fractions with."""
        start, end = round(self.start, 6), round(self.end, 6)
        kept = not (step / total < start or (step + 1) / total > end)
        return self.scale if kept else 0.0


def control_image(image: Image.Image, width: int, height: int, vae_scale_factor: int,
                  device: torch.device) -> torch.Tensor:
    """A conditioning image as the ControlNet pipelines' ``prepare_image`` reads it before their
    own steps: RGB, float32 in [0, 1] (the UNet families' as is, SD3 and Flux normalize it), at
    the image's size, on ``device``."""
    processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor, do_convert_rgb=True, do_normalize=False)
    tensor: torch.Tensor = processor.preprocess(image, height=height, width=width).to(dtype=torch.float32)
    return tensor.to(device=device)


@dataclass(frozen=True)
class ControlledRows:
    """A sequence's rows in one denoiser call, with its ControlNets, where it is in its steps and
    each ControlNet's own arguments for the rows it reads (``DenoisingLoop._control_inputs``)."""

    controls: tuple[SequenceControl, ...]
    inputs: tuple[dict[str, torch.Tensor], ...]
    step: int
    total: int
    first: int  # its first row in the call's inputs
    # For each of its rows (first, first + 1, ...), the row (counted from first) whose ControlNet
    # residuals it takes: its own, or the positive row's where the family's pipeline runs the
    # ControlNet on that alone (Flux). The rows named are the ones the ControlNet reads.
    sources: tuple[int, ...]


@dataclass(frozen=True)
class Residuals:
    """What the denoiser adds to its blocks: the family's residual lists (``ResidualLists``)."""

    lists: ResidualLists


@dataclass
class _Group:
    """One ControlNet call's rows: which it reads, which rows take which of its outputs, at which scale."""

    reads: list[int]
    writes: list[int]
    takes: list[int]
    scales: list[float]
    arguments: list[dict[str, torch.Tensor]]

    def add(self, sequence: ControlledRows, arguments: dict[str, torch.Tensor], scale: float) -> None:
        read = sorted(set(sequence.sources))
        base = len(self.reads)
        self.reads.extend(sequence.first + row for row in read)
        for offset, source in enumerate(sequence.sources):
            self.writes.append(sequence.first + offset)
            self.takes.append(base + read.index(source))
            self.scales.append(scale)
        self.arguments.append(arguments)


def control_residuals(sequences: Sequence[ControlledRows], rows: int, device: torch.device, run: RunControlNet,
                      spread: Spread) -> Residuals | None:
    """The residuals of every row of one denoiser call of ``rows`` rows: each row's ControlNets' at
    this step, zeros for rows without; None when no row has a ControlNet on. ControlNets whose
    lists differ in length (fewer layers) are spread to one residual per denoiser block first."""
    groups: dict[tuple[int, int], tuple[torch.nn.Module, _Group]] = {}
    for sequence in sequences:
        for position, control in enumerate(sequence.controls):
            scale = control.scale_at(sequence.step, sequence.total)
            if scale:
                key = (position, id(control.net))
                net, group = groups.setdefault(key, (control.net, _Group([], [], [], [], [])))
                group.add(sequence, sequence.inputs[position], scale)
    if not groups:
        return None
    made: list[tuple[_Group, ResidualLists]] = []
    for key in sorted(groups, key=lambda key: key[0]):  # stable: in each place, the order first seen
        net, group = groups[key]
        arguments = {name: torch.cat([each[name] for each in group.arguments]) for name in group.arguments[0]}
        made.append((group, run(net, torch.tensor(group.reads, device=device), arguments)))
    return Residuals([_summed([(group, lists[position]) for group, lists in made], rows, device, position, spread)
                      for position in range(len(made[0][1]))])


def _summed(parts: list[tuple[_Group, list[torch.Tensor] | None]], rows: int, device: torch.device, position: int,
            spread: Spread) -> list[torch.Tensor] | None:
    """One residual list of the call: each group's residuals scaled per row and added at its rows."""
    present = [(group, residuals) for group, residuals in parts if residuals is not None]
    if not present:
        return None
    if len({len(residuals) for _, residuals in present}) > 1:
        present = [(group, spread(position, residuals)) for group, residuals in present]
    first = present[0][1]
    summed = [torch.zeros((rows, *part.shape[1:]), dtype=part.dtype, device=part.device) for part in first]
    for group, residuals in present:
        writes = torch.tensor(group.writes, device=device)
        takes = torch.tensor(group.takes, device=device)
        scales = torch.tensor(group.scales, dtype=torch.float32)
        for full, part in zip(summed, residuals, strict=True):
            full.index_add_(0, writes, _scaled(part[takes], scales))
    return summed


def _scaled(residual: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A residual times each row's scale, in float32 as a float scalar multiplies it, back in its dtype."""
    factors = scales.to(residual.device).view(-1, *([1] * (residual.dim() - 1)))
    return (residual.float() * factors).to(residual.dtype)
