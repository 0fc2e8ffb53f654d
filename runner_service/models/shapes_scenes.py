"""The world of the built-in ``shapes`` model: its prompts, the pictures it is trained on, and the
checker that reads a picture back.

A scene is one shape of one colour on a background of another colour, in the middle or towards
one side. Its prompt is "a {colour} {shape} on a {colour} background", optionally followed by
"on the left", "on the right", "at the top" or "at the bottom"; "a {colour} {shape}" alone leaves
the background to chance. ``draw`` paints the scene the model is trained on; ``read_back`` is the
automatic checker of the benchmark and the prompt-adherence tests: from pixel statistics alone
(no model), it says which colours, shape and position an image shows.

Numpy only: the tests and the benchmark import it without torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "orange": (245, 130, 15),
    "purple": (140, 40, 170),
}
SHAPES = ("circle", "square", "triangle")
# Where the shape's centre is, as fractions of the width and height; "" is the middle.
POSITIONS: dict[str, tuple[float, float]] = {
    "": (0.5, 0.5),
    "on the left": (0.27, 0.5),
    "on the right": (0.73, 0.5),
    "at the top": (0.5, 0.27),
    "at the bottom": (0.5, 0.73),
}
RADIUS = 0.19  # the shape's half-width, as a fraction of the image's smaller side
# Every word a prompt can have: the tokenizers give each its own token.
VOCABULARY = tuple(dict.fromkeys(["a", "on", "the", "at", "background", "left", "right", "top", "bottom",
                                  *COLOURS, *SHAPES]))


@dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    background: str  # "" in a prompt that leaves the background to chance
    position: str = ""  # a key of POSITIONS

    @property
    def prompt(self) -> str:
        words = [f"a {self.colour} {self.shape}"]
        if self.background:
            words.append(f"on a {self.background} background")
        if self.position:
            words.append(self.position)
        return " ".join(words)


def random_scene(rng: random.Random, background: bool = True) -> Scene:
    """A scene with two different colours, any shape and any position (the middle included)."""
    colour, other = rng.sample(sorted(COLOURS), 2)
    return Scene(colour, rng.choice(SHAPES), other if background else "", rng.choice(sorted(POSITIONS)))


def draw(scene: Scene, width: int, height: int, rng: random.Random) -> np.ndarray:
    """The scene as an HxWx3 uint8 image: its shape a little larger or smaller and off its place by a
    few pixels, drawn at four samples per pixel so its edges are smooth. A scene without a background
    colour gets one at random."""
    background = scene.background or rng.choice([c for c in sorted(COLOURS) if c != scene.colour])
    side = min(width, height)
    radius = RADIUS * side * rng.uniform(0.85, 1.15)
    cx, cy = POSITIONS[scene.position]
    cx = cx * width + rng.uniform(-0.03, 0.03) * side
    cy = cy * height + rng.uniform(-0.03, 0.03) * side
    coverage = shape_coverage(scene.shape, cx, cy, radius, width, height)[..., None]
    shape_rgb, background_rgb = np.array(COLOURS[scene.colour]), np.array(COLOURS[background])
    image: np.ndarray = np.round(coverage * shape_rgb + (1 - coverage) * background_rgb).astype(np.uint8)
    return image


def shape_coverage(shape: str, cx: float, cy: float, radius: float, width: int, height: int) -> np.ndarray:
    """How much of each pixel (HxW, 0 to 1, four samples each) a shape of ``radius`` centred on its
    bounding box at (cx, cy) covers: a circle, a square of side 1.8 radius, or an upright triangle
    2 radius high with a base of 2.2 radius."""
    samples = (np.arange(2) + 0.5) / 2
    ys = (np.arange(height)[:, None] + samples[None, :]).reshape(-1)[:, None] - cy
    xs = (np.arange(width)[:, None] + samples[None, :]).reshape(-1)[None, :] - cx
    if shape == "circle":
        inside = xs**2 + ys**2 <= radius**2
    elif shape == "square":
        inside = (np.abs(xs) <= radius * 0.9) & (np.abs(ys) <= radius * 0.9)
    else:  # an upright triangle, its base at the bottom, centred on its bounding box
        top, bottom = -radius, radius
        half = radius * 1.1 * (ys - top) / (bottom - top)
        inside = (ys >= top) & (ys <= bottom) & (np.abs(xs) <= half)
    coverage: np.ndarray = inside.reshape(height, 2, width, 2).mean(axis=(1, 3))
    return coverage


# Per shape: its area in units of radius squared, and how far below its bounding box's centre its
# centroid lies, in radii (``shape_coverage``'s shapes).
_AREA = {"circle": np.pi, "square": 1.8**2, "triangle": 2.2}
_CENTROID_BELOW = {"circle": 0.0, "square": 0.0, "triangle": 1 / 3}


@dataclass(frozen=True)
class Reading:
    """What ``read_back`` saw; ``shape`` and ``position`` are "" where no shape stood out."""

    colour: str
    shape: str
    background: str
    position: str

    def matches(self, scene: Scene) -> dict[str, bool]:
        """Per property, whether the image shows what the scene asks (a background left to chance
        is any colour but the shape's)."""
        return {
            "colour": self.colour == scene.colour,
            "background": self.background == scene.background if scene.background else self.background != self.colour,
            "shape": self.shape == scene.shape,
            "position": self.position == scene.position,
        }


def nearest_colour(rgb: np.ndarray) -> str:
    names = sorted(COLOURS)
    distances = [float(np.sum((rgb - np.array(COLOURS[name])) ** 2)) for name in names]
    return names[int(np.argmin(distances))]


def read_back(image: np.ndarray) -> Reading:
    """Reads an HxWx3 uint8 image. The background is the median of a frame 1/16 of the image wide;
    the shape's colour the median of the pixels far from it; the shape every pixel nearer its colour
    than the background's (so a soft edge counts half-way, as a person sees it); its position the
    place nearest its centroid; and its kind the one whose ideal outline, of the same area and
    centroid, overlaps it most (intersection over union)."""
    pixels = image.astype(np.float64)
    height, width = image.shape[:2]
    frame = max(1, min(height, width) // 16)
    border = np.concatenate([pixels[:frame].reshape(-1, 3), pixels[-frame:].reshape(-1, 3),
                             pixels[:, :frame].reshape(-1, 3), pixels[:, -frame:].reshape(-1, 3)])
    background_rgb = np.median(border, axis=0)
    background = nearest_colour(background_rgb)
    far = np.sqrt(np.sum((pixels - background_rgb) ** 2, axis=-1)) > 60
    if far.sum() < 0.01 * height * width:
        return Reading("", "", background, "")
    shape_rgb = np.median(pixels[far], axis=0)
    colour = nearest_colour(shape_rgb)
    mask = np.sum((pixels - shape_rgb) ** 2, axis=-1) < np.sum((pixels - background_rgb) ** 2, axis=-1)
    rows, columns = np.nonzero(mask)
    cx, cy = columns.mean() + 0.5, rows.mean() + 0.5
    position = min(POSITIONS, key=lambda name: (POSITIONS[name][0] - cx / width) ** 2
                   + (POSITIONS[name][1] - cy / height) ** 2)

    def overlap(shape: str) -> float:
        radius = float(np.sqrt(mask.sum() / _AREA[shape]))
        ideal = shape_coverage(shape, cx, cy - _CENTROID_BELOW[shape] * radius, radius, width, height) >= 0.5
        return float((ideal & mask).sum() / (ideal | mask).sum())

    return Reading(colour, max(SHAPES, key=overlap), background, position)
