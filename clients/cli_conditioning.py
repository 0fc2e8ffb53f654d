"""``diffusion generate``'s ControlNet and IP-Adapter flags (docs/conditioning.md):

    --control NAME=IMAGE[:SCALE]          a ControlNet and its conditioning image; repeatable, up to 3
    --ip-adapter NAME=IMAGE[,IMAGE][:SCALE]   an IP-Adapter and 1 to 4 reference images; repeatable
                                          (the same NAME: the images add up)

IMAGE is a file on this machine (PNG, JPEG or WebP), read when the flags are parsed; SCALE a number
(0 to 2, the worker checks; default 1). A file name that itself ends in ``:NUMBER`` needs the
``:SCALE`` written out.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.conditioning import Control, ImagePrompt
from serving_common.conditioning_rules import MAX_CONTROLS


@dataclass(frozen=True)
class Conditioning:
    """One --control or --ip-adapter flag: the adapter's name, its images' bytes, its scale (None: unset)."""

    name: str
    images: tuple[bytes, ...]
    scale: float | None


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {error.strerror or error}") from None


def _parse(text: str, several: bool) -> Conditioning:
    """NAME=IMAGE[:SCALE] (``several``: NAME=IMAGE[,IMAGE...][:SCALE])."""
    form = "NAME=IMAGE[,IMAGE...][:SCALE]" if several else "NAME=IMAGE[:SCALE]"
    name, equals, rest = text.partition("=")
    if not name or not equals or not rest:
        raise argparse.ArgumentTypeError(f"must be {form}, not {text!r}")
    images, colon, scale_text = rest.rpartition(":")
    scale: float | None = None
    try:
        scale = float(scale_text) if colon else None
    except ValueError:
        images = rest  # the colon is part of a file name
    if scale is not None and not math.isfinite(scale):
        raise argparse.ArgumentTypeError(f"{form}: SCALE must be a finite number, not {scale_text!r}")
    paths = (images or rest).split(",") if several else [images or rest]
    if not all(paths):
        raise argparse.ArgumentTypeError(f"must be {form} with no empty IMAGE, not {text!r}")
    return Conditioning(name, tuple(_read(path) for path in paths), scale)


def control_flag(text: str) -> Conditioning:
    return _parse(text, several=False)


def ip_adapter_flag(text: str) -> Conditioning:
    return _parse(text, several=True)


def add_conditioning_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control", type=control_flag, action="append", default=[], metavar="NAME=IMAGE[:SCALE]",
                   help=f"a ControlNet registered with 'adapters load --kind controlnet' and its conditioning "
                   f"image (fitted to the size as --image is: --resize), at SCALE (0 to 2, default 1); repeatable, "
                   f"up to {MAX_CONTROLS}")
    p.add_argument("--ip-adapter", type=ip_adapter_flag, action="append", default=[],
                   metavar="NAME=IMAGE[,IMAGE][:SCALE]",
                   help="an IP-Adapter registered with 'adapters load --kind ip_adapter' and 1 to 4 reference "
                   "images, at SCALE (0 to 2, default 1); repeatable with the same NAME to add images")


def conditioning_options(controls: Sequence[Conditioning], prompts: Sequence[Conditioning]) -> dict[str, Any]:
    """The client's ``controls`` and ``ip_adapter`` of the flags; ValueError when the --ip-adapter
    flags name different IP-Adapters (a request takes one) or give different scales."""
    options: dict[str, Any] = {"controls": [Control(c.name, c.images[0], c.scale) for c in controls]}
    if prompts:
        names = {prompt.name for prompt in prompts}
        scales = {prompt.scale for prompt in prompts if prompt.scale is not None}
        if len(names) > 1:
            raise ValueError(f"--ip-adapter names {', '.join(sorted(names))}: a request takes one IP-Adapter")
        if len(scales) > 1:
            raise ValueError(f"--ip-adapter gives the scales {', '.join(map(str, sorted(scales)))}: give one")
        options["ip_adapter"] = ImagePrompt(prompts[0].name, [image for p in prompts for image in p.images],
                                            scales.pop() if scales else None)
    return options
