"""What a family's record (``Family``) says: what is particular to one diffusers family.

Its diffusers pipeline class (a real checkpoint is matched to its record by the exact class name of
its pipeline, so its quirks apply to it as to the tiny build), its tiny random build, the smallest
size that build generates, its call quirks, its step-level denoising loop (or none: request-level
batching), its latent preview map, how parallel CFG splits its guidance branches, and where it
overrides what the pipeline adapter derives from the call signature (``rounds_to``, a video
family's frame grid).

Sizes are width = height in pixels; "grid" is the multiple the requested size must be of (VAE
scale factor times transformer patch size, or the pipeline's own rule; non-square sizes on the
grid work too). ``Family.smallest_size`` is the smallest size, found by trying, at which one step
of the tiny build through ``DiffusionPipeline.from_pretrained`` gives an image of exactly that
size, with and without classifier-free guidance. (The worker refuses sizes under its
``--min-size``, 8 by default.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from runner_service.denoising.loop import DenoisingLoop
from runner_service.previews import LatentPreview


@dataclass(frozen=True)
class VideoGrid:
    """The frame counts and sizes a video pipeline takes, as its components' configs give them."""

    frame_step: int  # frame counts are frame_step * k + 1 (the VAE's temporal compression)
    max_frames: int  # the most its transformer's position embedding covers; 0: no limit of the model's own
    # What widths and heights must be multiples of: VAE scale times patch, or more where ``check_inputs``
    # demands it. Video pipelines name their VAE factors their own way (no ``vae_scale_factor``), so the
    # adapter cannot derive it as it does for images.
    size_multiple: int
    max_size: int  # likewise for width and height; 0: no limit of the model's own


@dataclass(frozen=True)
class Video:
    """What a video family's pipeline does not say in its call signature (its default frame count
    is the ``num_frames`` default of ``__call__``)."""

    default_fps: int  # the frame rate its checkpoints are trained for: the call makes frames, not a rate
    grid: Callable[[DiffusionPipeline], VideoGrid]  # read from the loaded pipeline, so a real checkpoint's own


class CfgLayout(Enum):
    """Where the two guidance branches meet the denoiser in a family's pipeline ``__call__``."""

    # One call whose rows are [unconditional; conditional] (``torch.cat([latents] * 2)``): each
    # CFG rank computes its half of the rows.
    ROWS = "rows"
    # Two calls per step, the conditional one first (Flux's true CFG, Wan): each CFG rank computes
    # one of the two calls.
    CALLS = "calls"


@dataclass(frozen=True)
class CfgBranches:
    """How a family's pipeline runs its two guidance branches: where they meet the denoiser, and
    the call argument whose value above 1 turns the second branch on (with a negative prompt,
    which the runner always passes: an empty one where the request has none)."""

    layout: CfgLayout
    scale: str


@dataclass(frozen=True)
class Family:
    """One family: its pipeline, its tiny build, and what the runner does differently for it."""

    name: str
    pipeline_class: str  # the diffusers class its checkpoints load as, matched exactly (a subclass may differ)
    build: Callable[[], DiffusionPipeline]  # its tiny build, in memory, with seeded random weights
    smallest_size: int  # of the tiny build, found by trying
    quirks: str  # what its ``__call__`` takes, and why the tiny build differs from diffusers' test config
    loop: type[DenoisingLoop] | None = None  # its step-level loop; None: batched per request
    # The pipeline rounds sizes inside ``__call__`` instead of refusing one off its grid: the multiple
    # that comes out exactly, reported as its size grid instead of the one the adapter derives.
    rounds_to: int = 0
    builtin: str = ""  # the built-in model (``models.catalog``) that is this tiny build, beside ``tiny`` and ``small``
    edit: bool = False  # its call takes an image and an instruction: it serves TASK_EDIT only
    video: Video | None = None  # a video family (text- or image-to-video); None: it makes images
    # Its latents' preview map (``runner_service.previews``); None: its requests get no previews.
    preview: LatentPreview | None = None
    # How parallel CFG splits its guidance branches over two ranks, as read in diffusers 0.42's
    # pipeline and tested on two ranks (tests/test_parallel_modes.py); None: ``parallel.cfg`` is refused.
    cfg: CfgBranches | None = None
    # Its pipelines' (its own and those derived from it for image-to-image, inpainting and ControlNets)
    # ``output_type="pt"`` is their ``"np"`` output before the conversion to numpy: floats in [0, 1] on
    # the device, channels before height and width (diffusers' ``postprocess``), so the request-level
    # call asks for it and its images leave the device as uint8 (``device_output``). False: it asks
    # for ``"np"``.
    tensor_output: bool = True
