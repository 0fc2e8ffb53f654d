"""Constants of the diffusion.v1 protocol that every side spells the same way."""

from __future__ import annotations

from diffusion.v1 import common_pb2, runner_pb2, worker_pb2

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
RUNNER_SERVICE = runner_pb2.DESCRIPTOR.services_by_name["RunnerService"].full_name

# Weight dtypes by name; DTYPE_UNSPECIFIED (the platform's default) has no name.
DTYPES: dict[str, int] = {
    "float32": common_pb2.DTYPE_FLOAT32,
    "float16": common_pb2.DTYPE_FLOAT16,
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
}
DTYPE_NAMES: dict[int, str] = {number: name for name, number in DTYPES.items()}

# The built-in models the runner serves by name (runner_service.models.catalog): the trained
# ``shapes``, the worker's default, then those built on first use. Named here for whoever must not
# import torch to list them (the CLI's help, diffusion-build-model's choices).
BUILTIN_MODEL_NAMES = ("shapes", "tiny", "small", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-wan", "tiny-wan-i2v")

SEED_MODULUS = 2**64


def image_seed(seed: int, index: int) -> int:
    """The seed of image ``index`` of a request seeded ``seed``: seed + index, wrapping at 2^64."""
    return (seed + index) % SEED_MODULUS


def normal_parallel(parallel: common_pb2.Parallelism) -> common_pb2.Parallelism:
    """``parallel`` with degrees of 0 and 1 (both "none") as unset: how a runner reports what it
    took (ModelInfo.parallel) and how the worker keeps what it asked, so the two compare equal."""
    return common_pb2.Parallelism(cfg=parallel.cfg,
                                  ulysses_degree=parallel.ulysses_degree if parallel.ulysses_degree > 1 else 0,
                                  ring_degree=parallel.ring_degree if parallel.ring_degree > 1 else 0)
