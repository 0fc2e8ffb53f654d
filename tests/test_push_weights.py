"""PushWeights through a real worker and runner: all or nothing, checked by sha256, kept for restarts."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusion.v1 import common_pb2, worker_pb2
from harness.processes import start_runner, start_worker, wait_until, worker_stub
from runner_service.models.catalog import ensure_builtin
from serving_common.tensor_stream import stream_parts

W = worker_pb2
REQUEST = W.GenerateRequest(prompt="a lighthouse", num_inference_steps=3, seed=4, output_format=W.OUTPUT_FORMAT_RAW)
pytestmark = pytest.mark.timeout(300)


def unet_tensors(noise: float = 0.0) -> dict[str, torch.Tensor]:
    """The built-in tiny model's UNet tensors as its files hold them, named for LoadWeights and PushWeights."""
    tensors = load_file(ensure_builtin("tiny") / "unet" / "diffusion_pytorch_model.safetensors")
    generator = torch.Generator().manual_seed(3)
    return {f"unet.{name}": (t + noise * torch.randn(t.shape, generator=generator) if noise and t.is_floating_point()
                             else t).contiguous() for name, t in sorted(tensors.items())}


def requests(tensors: dict[str, torch.Tensor], chunk_bytes: int = 64 * 1024, sha256: str = ""):
    parts = stream_parts(((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numpy().tobytes())
                          for name, t in tensors.items()), chunk_bytes)
    for part in parts:
        if isinstance(part, common_pb2.TensorChunk):
            yield W.PushWeightsRequest(chunk=part)
        else:
            yield W.PushWeightsRequest(commit=common_pb2.PushWeightsCommit(sha256=sha256 or part.sha256))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("push-logs")
    runner = start_runner(logs)
    worker = start_worker(logs, runner.target, "--max-pushed-bytes", str(64 * 1024**2))
    yield runner, worker
    worker.stop()
    runner.stop()


@pytest.fixture(scope="module")
def stub(pair):
    with worker_stub(pair[1].target) as stub:
        yield stub


@pytest.fixture
def fresh(stub):
    """The tiny model as built, before and after each test."""
    stub.Init(W.InitRequest(model="tiny"), timeout=120)
    yield stub
    stub.Init(W.InitRequest(model="tiny"), timeout=120)


def checksum(stub) -> str:
    return stub.GetWeightsChecksum(W.GetWeightsChecksumRequest(), timeout=60).checksum


def image(stub) -> bytes:
    return stub.Generate(REQUEST, timeout=60).images[0].data


def test_pushing_the_models_own_tensors_changes_neither_image_nor_checksum(fresh):
    before_image, before_checksum = image(fresh), checksum(fresh)
    tensors = unet_tensors()
    reply = fresh.PushWeights(requests(tensors), timeout=120)
    assert sorted(reply.loaded_names) == sorted(tensors) and reply.checksum == before_checksum
    assert reply.bytes_received == sum(t.numel() * t.element_size() for t in tensors.values())
    assert image(fresh) == before_image and checksum(fresh) == before_checksum
    status = fresh.GetStatus(W.GetStatusRequest(), timeout=10)
    assert status.weights_checksum == before_checksum and status.weights_version == reply.weights_version


def test_perturbed_tensors_change_both_and_match_load_weights_of_the_same(fresh, tmp_path):
    before_image, before_checksum = image(fresh), checksum(fresh)
    tensors = unet_tensors(noise=0.05)
    pushed = fresh.PushWeights(requests(tensors), timeout=120)
    pushed_image = image(fresh)
    assert pushed.checksum != before_checksum and pushed_image != before_image
    fresh.Init(W.InitRequest(model="tiny"), timeout=120)
    path = tmp_path / "perturbed.safetensors"
    save_file(tensors, str(path))
    fresh.LoadWeights(W.LoadWeightsRequest(path=str(path)), timeout=120)
    assert image(fresh) == pushed_image and checksum(fresh) == pushed.checksum


def test_a_stream_cut_in_the_middle_or_a_wrong_sha256_changes_nothing(fresh):
    before_image, before_checksum = image(fresh), checksum(fresh)
    version = fresh.GetStatus(W.GetStatusRequest(), timeout=10).weights_version
    tensors = unet_tensors(noise=0.05)
    sent = threading.Event()

    def cut():
        for count, request in enumerate(requests(tensors, chunk_bytes=16 * 1024)):
            if count == 20:
                sent.set()
                return  # the client's stream ends with no commit
            yield request

    with pytest.raises(grpc.RpcError) as ended:
        fresh.PushWeights(cut(), timeout=60)
    assert sent.is_set() and ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "without its commit" in ended.value.details()
    call = fresh.PushWeights.future(requests(tensors, chunk_bytes=16 * 1024), timeout=60)
    call.cancel()  # cancelled part way (or before it began)
    with pytest.raises(grpc.RpcError) as wrong:
        fresh.PushWeights(requests(tensors, sha256="0" * 64), timeout=60)
    assert wrong.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "sha256" in wrong.value.details()
    with pytest.raises(grpc.RpcError) as bad:
        fresh.PushWeights(requests({"unet.no_such.weight": torch.zeros(2)}), timeout=60)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert image(fresh) == before_image and checksum(fresh) == before_checksum
    assert fresh.GetStatus(W.GetStatusRequest(), timeout=10).weights_version == version


def test_a_push_past_max_pushed_bytes_is_refused(fresh):
    big = {"unet.conv_in.weight": torch.zeros(17 * 1024**2)}  # 68 MiB of float32, past the 64 MiB kept
    with pytest.raises(grpc.RpcError) as refused:
        fresh.PushWeights(requests(big, chunk_bytes=1024**2), timeout=120)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pushed-bytes" in \
        refused.value.details()


def test_a_restarted_runner_gets_the_pushed_weights_back(tmp_path):
    runner = start_runner(tmp_path)
    worker = start_worker(tmp_path, runner.target)
    try:
        with worker_stub(worker.target) as stub:
            reply = stub.PushWeights(requests(unet_tensors(noise=0.05)), timeout=120)
            pushed_image = image(stub)
            target = runner.target
            runner.stop()
            runner = start_runner(tmp_path, target=target)
            wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].ready, 60, "re-applied")
            assert image(stub) == pushed_image and checksum(stub) == reply.checksum
    finally:
        worker.stop()
        runner.stop()
