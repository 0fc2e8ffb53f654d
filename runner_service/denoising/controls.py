"""ControlNet residuals in a step batch: each row steered by its own ControlNets, at its own scale
and over its own part of the steps, rows without any beside them in the same denoiser call.

What one step does is what diffusers' ControlNet pipelines (``StableDiffusion[XL]ControlNetPipeline``)
do for their whole batch: a ControlNet is kept at step ``i`` of ``n`` unless ``i / n < start`` or
``(i + 1) / n > end`` (their ``controlnet_keep``), it reads the row's scaled model input, timestep,
text embeddings (and SDXL's added embeddings) with its conditioning image (the same image for a
guided sequence's negative and positive rows), its residuals are multiplied by the scale, several
ControlNets of one row are summed in the request's order (``MultiControlNetModel``), and the UNet
adds them to its down and middle blocks. Rows are grouped per ControlNet (and per place in their
request's list, so that sums keep that order): one ControlNet call per group. A row whose
ControlNets are all off at this step, or that has none, gets zeros, which leave the UNet's
features exactly as they are; a call where no row has one passes no residuals at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from runner_service.denoising.prompt_cache import Embeddings

# The conditioning entries a ControlNet reads beside the text embeddings: SDXL's added embeddings
# (an IP-Adapter's image embeddings go to the UNet alone, as in diffusers' pipelines).
_ADDED = ("text_embeds", "time_ids")


@dataclass(frozen=True)
class SequenceControl:
    """One ControlNet of one image: its module, its conditioning image (1 x 3 x height x width, as
    the pipeline's ``prepare_image`` makes it), its scale, and the fractions of the steps it starts
    and ends at."""

    net: torch.nn.Module
    image: torch.Tensor
    scale: float
    start: float
    end: float

    def scale_at(self, step: int, total: int) -> float:
        """Its scale at step ``step`` (0-based) of ``total``: 0 where the pipeline does not keep it.
        Start and end arrive as float32; read back at six decimals, they are the values the caller
        wrote (0.3, not 0.30000001), which the pipeline compares step fractions with."""
        start, end = round(self.start, 6), round(self.end, 6)
        kept = not (step / total < start or (step + 1) / total > end)
        return self.scale if kept else 0.0


def control_image(image: Image.Image, width: int, height: int, vae_scale_factor: int,
                  net: torch.nn.Module) -> torch.Tensor:
    """A conditioning image as the ControlNet pipelines' ``prepare_image`` makes it: RGB, in [0, 1]
    (not normalized), at the image's size, in the ControlNet's dtype on its device."""
    processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor, do_convert_rgb=True, do_normalize=False)
    tensor: torch.Tensor = processor.preprocess(image, height=height, width=width).to(dtype=torch.float32)
    parameter = next(net.parameters())
    return tensor.to(device=parameter.device, dtype=parameter.dtype)


@dataclass(frozen=True)
class ControlledRows:
    """A sequence's rows in one denoiser call, with its ControlNets and where it is in its steps."""

    controls: tuple[SequenceControl, ...]
    step: int
    total: int
    first: int  # its first row in the call's inputs
    rows: int  # 2 when guided (negative, positive), else 1


@dataclass(frozen=True)
class Residuals:
    """What the UNet adds to its down blocks' outputs and to its middle block's."""

    down: list[torch.Tensor]
    mid: torch.Tensor


def control_residuals(sequences: Sequence[ControlledRows], inputs: torch.Tensor, times: torch.Tensor,
                      conditioning: Embeddings) -> Residuals | None:
    """The residuals of every row of one denoiser call (``inputs``, ``times`` and ``conditioning``
    are the call's, a row each): each row's ControlNets' at this step, zeros for rows without; None
    when no row has a ControlNet on."""
    groups: dict[tuple[int, int], list[tuple[ControlledRows, SequenceControl, float]]] = {}
    for sequence in sequences:
        for position, control in enumerate(sequence.controls):
            scale = control.scale_at(sequence.step, sequence.total)
            if scale:
                groups.setdefault((position, id(control.net)), []).append((sequence, control, scale))
    if not groups:
        return None
    hidden = conditioning["encoder_hidden_states"]
    added = {name: conditioning[name] for name in _ADDED if name in conditioning}
    down: list[torch.Tensor] = []
    mid = torch.empty(0)
    for key in sorted(groups, key=lambda key: key[0]):  # stable: in each place, the order first seen
        members = groups[key]
        index = torch.cat([torch.arange(rows.first, rows.first + rows.rows) for rows, _, _ in members]).to(
            inputs.device)
        images = torch.cat([control.image.expand(rows.rows, -1, -1, -1) for rows, control, _ in members])
        scales = torch.cat([torch.full((rows.rows,), scale, dtype=torch.float32) for rows, _, scale in members])
        net = members[0][1].net
        down_part, mid_part = net(inputs[index], times[index], encoder_hidden_states=hidden[index],
                                  controlnet_cond=images, conditioning_scale=1.0,
                                  added_cond_kwargs={name: value[index] for name, value in added.items()} or None,
                                  return_dict=False)
        if not down:
            down = [torch.zeros((inputs.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
                    for part in down_part]
            mid = torch.zeros((inputs.shape[0], *mid_part.shape[1:]), dtype=mid_part.dtype, device=mid_part.device)
        for full, part in zip([*down, mid], [*down_part, mid_part], strict=True):
            full.index_add_(0, index, _scaled(part, scales))
    return Residuals(down, mid)


def _scaled(residual: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A residual times each row's scale, in float32 as a float scalar multiplies it, back in its dtype."""
    factors = scales.to(residual.device).view(-1, *([1] * (residual.dim() - 1)))
    return (residual.float() * factors).to(residual.dtype)
