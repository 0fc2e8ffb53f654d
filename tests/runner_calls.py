"""Small helpers for calling a runner directly from tests."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc


def runner_stub(target: str) -> runner_pb2_grpc.RunnerServiceStub:
    return runner_pb2_grpc.RunnerServiceStub(grpc.insecure_channel(target))


def item(seed: int = 1, steps: int = 4, size: int = 64, prompt: str = "a red fox", **fields) -> runner_pb2.ExecuteItem:
    return runner_pb2.ExecuteItem(
        request_id=fields.pop("request_id", f"req-{seed}"), prompt=prompt, width=size, height=size,
        num_inference_steps=steps, guidance_scale=fields.pop("guidance_scale", 7.5), seed=seed,
        num_images=fields.pop("num_images", 1), **fields,
    )


def execute(stub, *items: runner_pb2.ExecuteItem, progress: bool = False, progress_interval_ms: int = 0):
    """Runs a batch; returns (progress events, result)."""
    events = list(stub.Execute(runner_pb2.ExecuteRequest(items=list(items), progress=progress,
                                                         progress_interval_ms=progress_interval_ms)))
    assert events[-1].HasField("result"), events[-1]
    return [e.progress for e in events[:-1]], events[-1].result


def pixels(result: runner_pb2.ExecuteResult, output: int = 0, image: int = 0) -> np.ndarray:
    raw = result.outputs[output].images[image]
    return np.frombuffer(raw.pixels, dtype=np.uint8).reshape(raw.height, raw.width, raw.channels)


def generate(stub, seed: int = 1, steps: int = 4, size: int = 64) -> np.ndarray:
    return pixels(execute(stub, item(seed=seed, steps=steps, size=size))[1])


def info(stub) -> common_pb2.RunnerInfo:
    return stub.GetInfo(runner_pb2.GetInfoRequest()).info


def perturbed_weights(path, seed: int = 0) -> None:
    """Writes the tiny UNet's conv_in weight plus noise seeded ``seed`` as a safetensors file."""
    import torch
    from safetensors.torch import save_file

    from runner_service.families.sd.tiny import build_sd

    weight = build_sd("tiny").unet.conv_in.weight.detach()
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.5
    save_file({"unet.conv_in.weight": (weight + noise).contiguous()}, str(path))


# One short request for the ``shapes`` model.
SHAPES_ITEM: dict[str, Any] = dict(prompt="a red circle on a blue background", guidance_scale=1.0, steps=8, size=64)


def load(stub, source: str, **acceleration: Any) -> common_pb2.RunnerInfo:
    """LoadModel of ``source`` with the Acceleration of these fields; the runner's info after it."""
    request = runner_pb2.LoadModelRequest(source=source, acceleration=common_pb2.Acceleration(**acceleration))
    info: common_pb2.RunnerInfo = stub.LoadModel(request, timeout=300).info
    return info


def refused(call, request, **kwargs) -> grpc.RpcError:
    """The error a unary call ends with (it must fail)."""
    try:
        call(request, **kwargs)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"{request} succeeded")


def tiny_model_copy(destination):
    """A copy of the built-in ``tiny`` model directory (built into the session's cache once)."""
    import os
    import shutil
    from pathlib import Path

    from runner_service.models.catalog import ensure_builtin

    cache = os.environ.get("DIFFUSION_MODEL_CACHE")
    source = ensure_builtin("tiny", Path(cache) if cache else None)
    return Path(shutil.copytree(source, destination))
