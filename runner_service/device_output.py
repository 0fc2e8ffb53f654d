"""Images and video frames leave the device as uint8: a quarter of float32's bytes.

A decode's output (floats in [0, 1], as diffusers' postprocessing leaves them before its conversion
to numpy) is converted to uint8 where it was made, and only then copied to the host
(``Platform.to_host``: through pinned memory on an accelerator). The conversion is the one the
runner applied on the host to diffusers' float32 numpy output, ``(x * 255).round().clip(0, 255)``,
in float32 as that array was: multiplication and round-half-to-even are exact IEEE operations on
every device, so the bytes are those of the host conversion.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# A device tensor's copy on the host (``Platform.to_host``).
ToHost = Callable[[torch.Tensor], np.ndarray]


def plain_copy(tensor: torch.Tensor) -> np.ndarray:
    """The host copy without a platform (a plain ``.cpu()``; none on the CPU)."""
    return tensor.cpu().numpy()


def as_pixels(images: torch.Tensor) -> torch.Tensor:
    """Floats in [0, 1] (any layout, any float dtype) as uint8, on their device. One float32 copy
    is made (rounded and clamped in place): a video's frames are hundreds of MiB of them."""
    pixels = images.float() * 255
    return pixels.round_().clamp_(0, 255).to(torch.uint8)


def channels_last(images: torch.Tensor) -> torch.Tensor:
    """Decoded images (n x 3 x h x w) as n x h x w x 3, or videos (n x frames x 3 x h x w) as
    n x frames x h x w x 3: the layout of the pixels sent, on their device."""
    return images.movedim(-3, -1)
