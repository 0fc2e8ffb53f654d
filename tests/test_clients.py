"""The clients, the CLI and the pod launcher against real processes over loopback gRPC (no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from PIL import Image

from clients import AsyncDiffusionClient, DiffusionClient, Done, Progress, Queued, Started
from diffusion.v1 import runner_pb2, runner_pb2_grpc, worker_pb2
from harness.processes import free_port
from pod_process import NO_HTTP, Pod, gone
from serving_common.errors import field_violations
from support import cli

pytestmark = [pytest.mark.timeout(120), pytest.mark.process, pytest.mark.slow]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def worker(tiny_pair):
    """The session's worker serving tiny (see fixtures_worker.py)."""
    return tiny_pair.worker


@pytest.fixture(scope="module")
def client(worker):
    with DiffusionClient(worker.target, timeout=30) as client:
        yield client


# --- the library --------------------------------------------------------------------------------

def test_generate_png_decodes_at_the_requested_size(client):
    result = client.generate("a fox", width=64, height=48, steps=5, seed=11)
    assert len(result.images) == 1 and result.request_id and result.model
    image = result.images[0]
    assert image.data.startswith(PNG_SIGNATURE) and image.mime_type == "image/png"
    assert (image.width, image.height, image.seed) == (64, 48, 11)
    assert image.to_pil().size == (64, 48)
    pixels = image.to_numpy()
    assert pixels.shape == (48, 64, 3) and pixels.dtype == np.uint8


def test_raw_pixels_equal_the_decoded_png_of_the_same_seed(client):
    raw = client.generate("a fox", steps=5, seed=3, output_format="raw").images[0]
    png = client.generate("a fox", steps=5, seed=3, output_format="png").images[0]
    assert raw.is_raw and not png.is_raw
    assert len(raw.data) == raw.width * raw.height * 3
    np.testing.assert_array_equal(raw.to_numpy(), png.to_numpy())
    assert raw.to_pil().size == png.to_pil().size


def test_several_images_use_consecutive_seeds(client):
    result = client.generate("a fox", steps=2, seed=100, num_images=2)
    assert [image.seed for image in result.images] == [100, 101]


def test_invalid_request_raises_rpc_error_with_field_violations(client):
    with pytest.raises(grpc.RpcError) as caught:
        client.generate("a fox", width=65)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "width" in field_violations(caught.value)


def test_health_and_status(client):
    assert client.health() == "SERVING"
    assert client.health("") == "SERVING"
    status = client.status()
    assert status.state == worker_pb2.WORKER_STATE_READY
    assert status.model.source == "tiny"


def test_async_generate_and_stream_events_in_order(worker):
    steps = 5

    async def scenario():
        async with AsyncDiffusionClient(worker.target, timeout=30) as client:
            assert await client.health() == "SERVING"
            result = await client.generate("a fox", steps=steps, seed=5)
            events = [event async for event in client.stream("a fox", steps=steps, seed=5)]
            return result, events

    result, events = asyncio.run(scenario())
    assert result.images[0].seed == 5
    kinds = [type(event) for event in events]
    first_started = kinds.index(Started)
    assert first_started >= 1 and set(kinds[:first_started]) == {Queued}
    assert events[first_started + 1:-1] == [Progress(step=i, total=steps) for i in range(1, steps + 1)]
    assert isinstance(events[-1], Done)
    done = events[-1].result
    assert done.request_id == events[0].request_id == events[first_started].request_id
    # Same seed, same pixels, whichever call produced them.
    np.testing.assert_array_equal(done.images[0].to_numpy(), result.images[0].to_numpy())


def test_leaving_a_stream_early_cancels_it(client):
    with client.stream("a fox", steps=50) as stream:
        first = next(stream)
    assert isinstance(first, Queued)
    # The worker is still usable afterwards.
    assert client.generate("a fox", steps=2).images


# --- the command line ---------------------------------------------------------------------------

def test_cli_generate_writes_a_png(worker, tmp_path):
    out = tmp_path / "out.png"
    done = cli("--target", worker.target, "generate", "a fox", "-o", str(out), "--seed", "7", "--steps", "5")
    assert done.returncode == 0, done.stderr
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (64, 64)
    assert "seed 7" in done.stdout and "timings" in done.stdout
    assert "5/5" in done.stderr  # the progress bar


def test_cli_generate_several_images_numbers_the_files(worker, tmp_path):
    done = cli("--target", worker.target, "generate", "a fox", "-o", str(tmp_path / "fox.jpg"), "--steps", "2",
               "--num-images", "2", "--format", "jpeg", "--seed", "1")
    assert done.returncode == 0, done.stderr
    for i in range(2):
        with Image.open(tmp_path / f"fox-{i}.jpg") as image:
            assert image.format == "JPEG"


def test_cli_status_prints_json(worker):
    done = cli("--target", worker.target, "status", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "WORKER_STATE_READY"


def test_cli_invalid_request_names_the_field(worker, tmp_path):
    done = cli("--target", worker.target, "generate", "a fox", "-o", str(tmp_path / "x.png"), "--width", "65")
    assert done.returncode != 0
    assert done.stderr.startswith("error: INVALID_ARGUMENT: ")
    assert "width" in done.stderr and "Traceback" not in done.stderr


def test_cli_unreachable_worker_is_a_clean_error():
    done = cli("--target", f"127.0.0.1:{free_port()}", "--timeout", "2", "status")
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr


def test_cli_sleep_and_wake_drive_readiness(worker):
    try:
        assert cli("--target", worker.target, "sleep", "--level", "1").returncode == 0
        health = cli("--target", worker.target, "health")
        assert health.returncode == 1 and health.stdout.strip() == "NOT_SERVING"
    finally:
        woke = cli("--target", worker.target, "wake")
    assert woke.returncode == 0, woke.stderr
    health = cli("--target", worker.target, "health")
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"


# --- deploy/pod.py ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pods():
    """The pods of the tests below, in order: the first is killed with SIGKILL; the next one, started
    then by ``make run`` (it removes the token directory the first left), ends when make is killed
    with SIGKILL. Two pods for the three ways a pod ends: each pod start costs a runner's and a
    worker's imports in fresh interpreters. Neither takes the worker's default metrics and HTTP ports,
    which a pod of another test module, or of another checkout's suite on the machine, may hold."""
    started = [Pod("--", *NO_HTTP)]
    yield started
    for pod in started:
        pod.kill_all()


@pytest.fixture
def pod(pods):
    """The pod started last."""
    return pods[-1]


def test_pod_restarts_a_killed_runner(pod):
    pod.wait_ready()
    pod.wait_for(lambda: "grpcurl -plaintext" in pod.output(), "commands to try", 5)
    assert f"diffusion --target {pod.worker} generate" in pod.output()
    [first_runner] = pod.pids("runner")

    os.kill(first_runner, signal.SIGKILL)
    pod.wait_for(lambda: pod.pids("runner")[1:], "restarted runner", 20)
    assert "restarting in 0.5s" in pod.output()

    def generates() -> bool:
        try:
            with DiffusionClient(pod.worker, timeout=10) as client:
                return bool(client.generate("a fox", steps=2).images)
        except grpc.RpcError:
            return False

    pod.wait_for(generates, "generation after the runner restart", 120)  # a runner start on a loaded machine
    pod.wait_ready(10)


def pod_token_file(pod: Pod) -> Path:
    [path] = [line.split(" in ", 1)[1] for line in pod.lines if line.startswith("[pod] runner token generated in ")]
    return Path(path)


def test_pod_runner_accepts_only_the_generated_token(pod):
    pod.wait_ready()
    token_file = pod_token_file(pod)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token not in pod.output()
    with grpc.insecure_channel(pod.runner) as channel:
        stub = runner_pb2_grpc.RunnerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetInfo(runner_pb2.GetInfoRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = stub.GetInfo(runner_pb2.GetInfoRequest(), timeout=10,
                            metadata=[("authorization", f"Bearer {token}")])
        assert info.info.instance_id


@pytest.mark.timeout(300)
def test_a_pod_killed_with_sigkill_takes_its_children_and_the_next_start_removes_its_token_dir(pods):
    killed = pods[-1]
    killed.wait_ready(120)
    token_dir = pod_token_file(killed).parent
    children = [killed.pids("worker")[-1], killed.pids("runner")[-1]]
    killed.process.kill()  # no cleanup can run
    killed.process.wait()
    assert all(gone(pid, 90) for pid in children), f"orphans left serving:\n{killed.output()}"
    assert token_dir.exists()
    # The next start is make run's, whose worker flags (after --) turn off its HTTP API and metrics.
    pods.append(second := Pod("--", *NO_HTTP, make=True))
    second.wait_for(lambda: any(line.startswith("[pod] runner token generated in ") for line in second.lines),
                    "the second pod's token", 60)
    assert not token_dir.exists() and f"[pod] removed {token_dir}, left by a pod that was killed" in second.lines
    assert pod_token_file(second).exists()


PR_SET_CHILD_SUBREAPER = 36


@contextlib.contextmanager
def adopting_orphans() -> Iterator[None]:
    """This process as the reaper of its descendants orphaned in the block (Linux's child subreaper),
    instead of init: the exit status of a process whose parent died is then ours to read."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def test_make_run_killed_with_sigkill_stops_the_pod_as_sigterm_does_worker_then_runner(pod):
    """The pod is make's child: it asks for SIGTERM when make dies, as its children ask when it dies.
    That SIGTERM stops the worker, then the runner, removes the generated token and exits 0; this
    process adopts the orphaned pod to read its exit code."""
    make = pod.process.pid
    pod.wait_ready(120)  # the pod the test before started
    [pod_pid] = [int(pid) for pid in Path(f"/proc/{make}/task/{make}/children").read_text().split()]
    token_dir = pod_token_file(pod).parent
    children = [pod.pids("worker")[-1], pod.pids("runner")[-1]]
    status: int | None = None
    try:
        with adopting_orphans():
            pod.process.kill()  # make: no cleanup can run
            pod.process.wait()
            assert all(gone(pid, 90) for pid in [pod_pid, *children]), pod.output()
        _, status = os.waitpid(pod_pid, 0)  # its zombie, ours since make died
    finally:
        if status is None:  # not reaped: it may still run
            with contextlib.suppress(ProcessLookupError):
                os.kill(pod_pid, signal.SIGKILL)
    assert os.waitstatus_to_exitcode(status) == 0, pod.output()
    pod.reader.join(5)
    assert "[pod] SIGTERM: stopping" in pod.lines, pod.output()
    stopped = [line.split()[1] for line in pod.lines
               if re.fullmatch(r"\[pod\] (worker|runner) stopped.*", line)]
    assert stopped == ["worker", "runner"], pod.output()
    assert not token_dir.exists(), "the generated runner token outlived the pod"
