"""The output path's speed: encode time per image for each format, size, encoder and level.

``python -m benchmarks.bench_encoding`` prints a table and writes ``results/encoding.json``.
For every candidate encoder found installed (Pillow always; OpenCV's ``imencode`` and
``imagecodecs`` when importable) and each of its levels it measures, on two deterministic
synthetic images (``picture``: gradients, shaded shapes and mild noise, like a model's decoded
output; ``flat``: noise-free flat shapes):

- ``ms``: wall milliseconds per image encoded on ONE thread (median of the repeats);
- ``cpu_ms``: the process's CPU milliseconds per image in that run (catches encoders that
  spread work over threads of their own);
- ``batch8_ips``: images per second for a batch of 8 encoded in parallel threads (1024 only);
- ``kib``: the encoded size; ``exact``: the bytes decode (with Pillow, an independent decoder)
  to exactly the input pixels, which PNG and lossless WebP must.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from diffusion.v1 import worker_pb2
from worker_service.pixel_encoders import FASTEST

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (256, 512, 1024)
BATCH = 8
FORMATS = {"png": worker_pb2.OUTPUT_FORMAT_PNG, "webp": worker_pb2.OUTPUT_FORMAT_WEBP,
           "jpeg": worker_pb2.OUTPUT_FORMAT_JPEG}


def synthetic_image(size: int, kind: str) -> np.ndarray:
    """A deterministic ``size`` x ``size`` RGB image: ``picture`` or ``flat`` (see the module doc)."""
    rng = np.random.default_rng(size)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    if kind == "picture":
        image = np.stack([160 + 80 * np.sin(3 * x + 1.5 * y), 120 + 90 * y, 100 + 70 * np.cos(4 * x * y)], axis=-1)
    else:
        image = np.broadcast_to(np.array([70.0, 110.0, 150.0], np.float32), (size, size, 3)).copy()
    for _ in range(12):
        cx, cy, r = rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9), rng.uniform(0.05, 0.25)
        color = rng.uniform(0, 255, 3).astype(np.float32)
        disc = rng.random() < 0.5
        inside = (x - cx) ** 2 + (y - cy) ** 2 < r * r if disc else (abs(x - cx) < r) & (abs(y - cy) < r / 2)
        shade = 1.0 - 0.6 * (y - cy + r) / (2 * r) if kind == "picture" else 1.0
        image[inside] = (color * np.clip(shade, 0.3, 1.0)[..., None])[inside] if kind == "picture" else color
    if kind == "picture":
        image += rng.normal(0.0, 2.0, image.shape).astype(np.float32)
    return np.ascontiguousarray(np.clip(image, 0, 255).astype(np.uint8))


@dataclass(frozen=True)
class Candidate:
    fmt: str  # png, webp (lossless) or jpeg
    encoder: str
    level: str
    encode: Callable[[np.ndarray], bytes]


def _pillow(fmt: str, **options: Any) -> Callable[[np.ndarray], bytes]:
    def encode(pixels: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, fmt, **options)
        return buffer.getvalue()
    return encode


def _codec(encode: Callable[..., Any], **options: Any) -> Callable[[np.ndarray], bytes]:
    return lambda pixels: bytes(encode(pixels, **options))


def candidates() -> list[Candidate]:
    # The worker's own encoders first (worker_service.pixel_encoders.FASTEST), then the candidates.
    found = [Candidate(name, "worker", "chosen", FASTEST[output_format]) for name, output_format in FORMATS.items()]
    found += [Candidate("png", "pillow", str(level), _pillow("PNG", compress_level=level)) for level in range(10)]
    # Pillow's compress_type is zlib's strategy: 2 Huffman only, 3 RLE.
    found += [Candidate("png", "pillow", f"1-{name}", _pillow("PNG", compress_level=1, compress_type=strategy))
              for name, strategy in (("huffman", 2), ("rle", 3))]
    # Lossless WebP: ``quality`` is the effort (0 fastest), ``method`` 0-6 (4 is Pillow's default).
    found += [Candidate("webp", "pillow", f"m{m}q{q}", _pillow("WEBP", lossless=True, method=m, quality=q))
              for m, q in ((0, 0), (0, 50), (0, 100), (1, 0), (1, 25), (2, 50), (3, 50), (4, 80))]
    found.append(Candidate("jpeg", "pillow", "q95", _pillow("JPEG", quality=95)))
    try:
        import cv2  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        pass
    else:
        def opencv(ext: str, params: list[int]) -> Callable[[np.ndarray], bytes]:
            def encode(pixels: np.ndarray) -> bytes:
                ok, data = cv2.imencode(ext, cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR), params)
                assert ok
                return bytes(data)
            return encode
        found += [Candidate("png", "opencv", str(level), opencv(".png", [cv2.IMWRITE_PNG_COMPRESSION, level]))
                  for level in (1, 3, 6, 9)]
        found.append(Candidate("png", "opencv", "1-rle-sub", opencv(".png", [
            cv2.IMWRITE_PNG_COMPRESSION, 1, cv2.IMWRITE_PNG_STRATEGY, cv2.IMWRITE_PNG_STRATEGY_RLE,
            cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_SUB])))
        found.append(Candidate("webp", "opencv", "lossless", opencv(".webp", [cv2.IMWRITE_WEBP_QUALITY, 101])))
        found.append(Candidate("jpeg", "opencv", "q95", opencv(".jpg", [cv2.IMWRITE_JPEG_QUALITY, 95])))
    try:
        import imagecodecs
    except ImportError:
        pass
    else:
        found += [Candidate("png", "imagecodecs-libpng", str(level), _codec(imagecodecs.png_encode, level=level))
                  for level in (1, 3, 6, 9)]
        # zlib strategy and PNG row filter at level 1 (the filter is the per-row cost).
        strategies, filters = imagecodecs.PNG.STRATEGY, imagecodecs.PNG.FILTER
        found += [Candidate("png", "imagecodecs-libpng", f"1-{strategy.name.lower()}-{row.name.lower()}",
                            _codec(imagecodecs.png_encode, level=1, strategy=strategy, filter=row))
                  for strategy in (strategies.RLE, strategies.HUFFMAN_ONLY)
                  for row in (filters.NONE, filters.SUB, filters.UP, filters.PAETH)]
        found += [Candidate("png", "imagecodecs-spng", str(level), _codec(imagecodecs.spng_encode, level=level))
                  for level in (1, 6)]
        found += [Candidate("webp", "imagecodecs", f"m{m}q{q}",
                            _codec(imagecodecs.webp_encode, level=q, lossless=True, method=m, numthreads=1))
                  for m, q in ((0, 0), (1, 25), (4, 80))]
        found.append(Candidate("jpeg", "imagecodecs", "q95", _codec(imagecodecs.jpeg8_encode, level=95)))
    return found


def exact(data: bytes, pixels: np.ndarray) -> bool:
    """Whether ``data`` decodes (with Pillow) to exactly ``pixels``."""
    decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return decoded.shape == pixels.shape and bool((decoded == pixels).all())


def measure(candidate: Candidate, pixels: np.ndarray, repeats: int) -> dict[str, Any]:
    data = candidate.encode(pixels)  # warm-up, and the bytes checked
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        candidate.encode(pixels)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"ms": 1e3 * statistics.median(walls), "cpu_ms": 1e3 * statistics.median(cpus),
            "kib": len(data) / 1024, "exact": exact(data, pixels)}


def batch_throughput(candidate: Candidate, pixels: np.ndarray, threads: int) -> float:
    """Images per second for BATCH copies of ``pixels`` encoded by ``threads`` parallel threads."""
    batch = [pixels.copy() for _ in range(BATCH)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(candidate.encode, batch[:threads]))  # start the threads
        start = time.perf_counter()
        list(pool.map(candidate.encode, batch))
        return BATCH / (time.perf_counter() - start)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for the batch of 8")
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        for kind in ("picture", "flat"):
            pixels = synthetic_image(size, kind)
            for candidate in candidates():
                row = {"format": candidate.fmt, "encoder": candidate.encoder, "level": candidate.level,
                       "size": size, "image": kind, **measure(candidate, pixels, args.repeats)}
                if size == max(args.sizes) and kind == "picture":
                    row["batch8_ips"] = batch_throughput(candidate, pixels, args.threads)
                rows.append(row)
                print(f"{candidate.fmt:5} {candidate.encoder:19} {candidate.level:14} {size:5} {kind:8}"
                      f" {row['ms']:8.1f} ms {row['cpu_ms']:8.1f} cpu-ms {row['kib']:8.1f} KiB"
                      f" exact={row['exact']!s:5} {row.get('batch8_ips', float('nan')):7.1f} img/s", flush=True)
    RESULTS.mkdir(exist_ok=True)
    machine = {"cpu": _cpu_model(), "cpus": os.cpu_count(), "threads": args.threads, "repeats": args.repeats,
               "versions": {name: _version(name) for name in ("pillow", "imagecodecs", "opencv-python-headless")}}
    (RESULTS / "encoding.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
