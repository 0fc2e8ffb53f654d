"""PushWeights through a real worker and runner: all or nothing, checked by sha256, kept for restarts."""

from __future__ import annotations

import json
import signal
import threading

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

import support
from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc, worker_pb2
from fixtures_runner import MAX_PUSHED_BYTES, serve_tiny_as_built, weights_worker_args
from harness.processes import start_runner, start_worker, wait_until, worker_stub
from runner_service.models.catalog import ensure_builtin
from serving_common.tensor_stream import push_messages

W = worker_pb2
REQUEST = support.request(num_inference_steps=3, seed=4)
pytestmark = [pytest.mark.timeout(300), pytest.mark.process]


def unet_tensors(noise: float = 0.0, component: str = "unet") -> dict[str, torch.Tensor]:
    """The built-in tiny model's UNet (or VAE) tensors as its files hold them, named for LoadWeights and PushWeights."""
    tensors = load_file(ensure_builtin("tiny") / component / "diffusion_pytorch_model.safetensors")
    generator = torch.Generator().manual_seed(3)
    return {f"{component}.{name}": (t + noise * torch.randn(t.shape, generator=generator)
                                    if noise and t.is_floating_point() else t).contiguous()
            for name, t in sorted(tensors.items())}


def requests(tensors: dict[str, torch.Tensor], chunk_bytes: int = 64 * 1024, sha256: str = ""):
    messages = push_messages(((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numpy().tobytes())
                              for name, t in tensors.items()), chunk_bytes)
    for message, data_bytes in messages:
        request = W.PushWeightsRequest.FromString(message)
        if data_bytes is None and sha256:  # the commit, with a sha256 of the test's own
            request.commit.sha256 = sha256
        yield request


@pytest.fixture(scope="module")
def pair(weights_pair):
    """The session's weights pair: the worker keeps its pushes in log_dir/"pushes", under MAX_PUSHED_BYTES,
    with a state file."""
    return weights_pair


@pytest.fixture(scope="module")
def stub(weights_stub):
    return weights_stub


@pytest.fixture(scope="module")
def as_built(stub):
    """The tiny model as built when the module starts (an Init, where one is needed, forgets the pushes kept)."""
    serve_tiny_as_built(stub)
    return stub


def weights_version(stub) -> str:
    """The worker's weights version: a digest of the model's load and of each update applied since."""
    return stub.GetStatus(W.GetStatusRequest(), timeout=10).weights_version


@pytest.fixture
def fresh(as_built):
    """The tiny model as built before and after each test: the module starts from it, and every test
    that may change the weights takes this fixture, whose end loads it again where the test changed
    them (one Init a test at most; a refused push leaves nothing to forget)."""
    before = weights_version(as_built)
    yield as_built
    if weights_version(as_built) != before:
        as_built.Init(W.InitRequest(model="tiny"), timeout=120)


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
    big = {"unet.conv_in.weight": torch.zeros(3 * 1024**2)}  # 12 MiB of float32, past MAX_PUSHED_BYTES
    with pytest.raises(grpc.RpcError) as refused:
        fresh.PushWeights(requests(big, chunk_bytes=1024**2), timeout=120)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pushed-bytes" in \
        refused.value.details()


def test_a_restarted_runner_gets_the_pushed_weights_back(pair, fresh):
    reply = fresh.PushWeights(requests(unet_tensors(noise=0.05)), timeout=120)
    pushed_image = image(fresh)
    first = fresh.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info.instance_id
    pair.restart_runner()
    wait_until(lambda: (runner := fresh.GetStatus(W.GetStatusRequest(), timeout=10).runners[0]).ready
               and runner.info.instance_id != first, 60, "re-applied")
    assert image(fresh) == pushed_image and checksum(fresh) == reply.checksum


def test_a_declared_size_past_the_budget_is_refused_naming_the_tensor_before_anything_is_held(pair, fresh):
    """68 MiB declared with 16 bytes of data, against the worker's MAX_PUSHED_BYTES; then, straight to the
    runner, a declaration no memory could hold. Both refused at the first chunk; both keep serving."""
    before = image(fresh)
    declared = common_pb2.TensorChunk(name="unet.conv_in.weight", dtype="float32", shape=[17 * 1024**2],
                                      data=bytes(16))
    with pytest.raises(grpc.RpcError) as worker_refused:
        fresh.PushWeights(iter([W.PushWeightsRequest(chunk=declared)]), timeout=60)
    assert worker_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "unet.conv_in.weight" in worker_refused.value.details()
    assert "--max-pushed-bytes" in worker_refused.value.details()
    absurd = common_pb2.TensorChunk(name="unet.conv_in.weight", dtype="float64", shape=[2**40] * 3, data=bytes(16))
    with grpc.insecure_channel(pair.runner.target) as channel:
        with pytest.raises(grpc.RpcError) as runner_refused:
            runner_pb2_grpc.RunnerServiceStub(channel).PushWeights(
                iter([runner_pb2.RunnerServicePushWeightsRequest(chunk=absurd)]), timeout=60)
    assert runner_refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "unet.conv_in.weight" in runner_refused.value.details()
    assert image(fresh) == before


def test_non_finite_weights_are_refused_at_push_and_at_load_naming_the_tensor(fresh, tmp_path):
    before_image, before_checksum = image(fresh), checksum(fresh)
    tensors = unet_tensors()
    name = "unet.conv_in.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0, 0, 0] = float("nan")
    with pytest.raises(grpc.RpcError) as pushed:
        fresh.PushWeights(requests(tensors), timeout=120)
    assert pushed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in pushed.value.details()
    tensors[name][0, 0, 0, 0] = float("inf")
    path = tmp_path / "infinite.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(grpc.RpcError) as loaded:
        fresh.LoadWeights(W.LoadWeightsRequest(path=str(path)), timeout=120)
    assert loaded.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in loaded.value.details()
    assert image(fresh) == before_image and checksum(fresh) == before_checksum


def push_files(directory):
    return sorted((directory / "pushes").glob("*.push"))


def test_pushes_that_replace_the_same_tensors_keep_only_the_last(pair, fresh):
    stub, directory = fresh, pair.log_dir
    for noise in (0.01, 0.02, 0.03, 0.04):  # before, the third found both earlier ones still kept
        reply = stub.PushWeights(requests(unet_tensors(noise)), timeout=120)
    assert len(push_files(directory)) == 1
    state = json.loads((directory / "state.json").read_text())
    assert len(state["weight_updates"]) == 1 and state["weight_updates"][0]["pushed"]
    assert checksum(stub) == reply.checksum


def test_a_commit_only_push_records_nothing_and_keeps_no_file(pair, fresh):
    stub, directory = fresh, pair.log_dir
    version = stub.GetStatus(W.GetStatusRequest(), timeout=10).weights_version
    reply = stub.PushWeights(requests({}), timeout=60)
    assert not reply.loaded_names and reply.weights_version == version
    assert push_files(directory) == []
    assert json.loads((directory / "state.json").read_text())["weight_updates"] == []


def test_concurrent_pushes_claim_their_space_so_the_second_is_refused(pair, fresh):
    """The first push holds all its bytes (not yet committed) when the second sends its own; both
    started, with nothing kept, before either sent a byte."""
    stub, directory = fresh, pair.log_dir
    tensors = {**unet_tensors(0.04), **unet_tensors(0.04, "vae")}  # 4.66 MB
    opened = [threading.Event(), threading.Event()]
    go = [threading.Event(), threading.Event()]
    commit = threading.Event()

    def held(index, commit_gate=None):
        opened[index].set()
        go[index].wait()
        for request in requests(tensors):
            if request.HasField("commit") and commit_gate is not None:
                commit_gate.wait()
            yield request

    first = stub.PushWeights.future(held(0, commit), timeout=120)
    wait_until(lambda: opened[0].is_set() and len(push_files(directory)) == 1, 60, "the first push open")
    second = stub.PushWeights.future(held(1), timeout=120)
    wait_until(lambda: opened[1].is_set() and len(push_files(directory)) == 2, 60, "the second push open")
    go[0].set()
    wait_until(lambda: max(p.stat().st_size for p in push_files(directory)) >= 4_600_000, 60,
               "the first push's bytes all received")
    go[1].set()
    with pytest.raises(grpc.RpcError) as refused:
        second.result()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pushed-bytes" in \
        refused.value.details()
    commit.set()
    assert first.result().loaded_names
    assert len(push_files(directory)) == 1 and sum(p.stat().st_size for p in push_files(directory)) < MAX_PUSHED_BYTES


def test_a_push_cut_by_a_killed_worker_leaves_no_file_after_its_restart(pair, fresh):
    gate = threading.Event()

    def cut():
        for count, request in enumerate(requests(unet_tensors(0.05))):
            if count == 20:
                gate.wait()
            yield request

    call = fresh.PushWeights.future(cut(), timeout=120)
    try:
        wait_until(lambda: push_files(pair.log_dir) and push_files(pair.log_dir)[0].stat().st_size > 0, 60,
                   "part of the push written")
        pair.worker.stop(signal.SIGKILL)
    finally:
        gate.set()
    with pytest.raises(grpc.RpcError):
        call.result()
    pair.worker = start_worker(pair.log_dir, pair.runner.target, "--model", "tiny", *weights_worker_args(pair.log_dir),
                               target=pair.worker.target)
    assert push_files(pair.log_dir) == []
    fresh.GetStatus(W.GetStatusRequest(), wait_for_ready=True, timeout=60)  # the module's channel back


def test_a_push_whose_runner_call_ended_first_leaves_no_pending_task(tmp_path):
    """The runner goes away mid-push, then the client's stream ends without a commit. A worker made
    to collect its garbage on SIGUSR1 then logs no "Task was destroyed but it is pending"."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import gc, signal, sys\n"
        "def collect(signum, frame):\n"
        "    gc.collect()\n"
        "    print('garbage collected', file=sys.stderr, flush=True)\n"
        "signal.signal(signal.SIGUSR1, collect)\n")
    runner = start_runner(tmp_path)
    worker = start_worker(tmp_path, runner.target, "--model", "tiny", "--push-dir", str(tmp_path / "pushes"),
                          env={"PYTHONPATH": str(hooks)})
    gate = threading.Event()
    try:
        with worker_stub(worker.target) as stub:
            def cut():
                for count, request in enumerate(requests(unet_tensors(0.05))):
                    if count == 5:
                        gate.wait()
                        return  # no commit
                    yield request

            call = stub.PushWeights.future(cut(), timeout=120)
            wait_until(lambda: push_files(tmp_path) and push_files(tmp_path)[0].stat().st_size > 0, 60,
                       "part of the push relayed")
            runner.stop(signal.SIGKILL)
            wait_until(lambda: not stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].connected, 60,
                       "the runner seen gone")
            gate.set()
            with pytest.raises(grpc.RpcError) as ended:
                call.result()
            assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            worker.process.send_signal(signal.SIGUSR1)
            wait_until(lambda: "garbage collected" in worker.log(), 60, "the worker's garbage collected")
        assert "Task was destroyed" not in worker.log()
    finally:
        gate.set()
        worker.stop()
        runner.stop()
