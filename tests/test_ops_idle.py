"""--sleep-after-idle puts the model to sleep when no request comes; --auto-wake brings it back for
the next one, which generates the same image as before, bit for bit."""

from __future__ import annotations

import time
import urllib.request

import pytest

from diffusion.v1 import worker_pb2
from harness.processes import worker_stub
from support import request

pytestmark = pytest.mark.process
W = worker_pb2
IDLE_S = 1.5
REQUEST = request(prompt="a sleepy owl", num_inference_steps=3, seed=21)


@pytest.fixture(scope="module")
def pair(serve):
    """A worker that sleeps after IDLE_S without requests and wakes on the next, on the fake runner
    (the sleep and the wake themselves are tested on a real runner in test_worker_lifecycle)."""
    return serve("--sleep-after-idle", str(IDLE_S), "--auto-wake", fake_step_s=0.0, metrics=True)


@pytest.fixture(scope="module")
def stub(pair):
    """Not warmed (unlike the shared ``stub``): a warm-up request would start the idle clock before the test."""
    with worker_stub(pair.worker.target, warm=False) as stub:
        yield stub


def wait_for_state(stub, state, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
        if status.state == state:
            return status
        time.sleep(0.1)
    raise AssertionError(f"state {W.WorkerState.Name(status.state)} after {timeout}s, not {W.WorkerState.Name(state)}")


def metric(url, name):
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name}")


def test_idle_sleep_then_auto_wake_gives_the_same_image(pair, stub):
    before = stub.Generate(REQUEST, timeout=120).images[0].data
    busy = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert busy.state == W.WORKER_STATE_READY and busy.idle_sleep_after_s == IDLE_S
    asleep = wait_for_state(stub, W.WORKER_STATE_SLEEPING, timeout=IDLE_S + 15)
    assert asleep.last_sleep_idle and asleep.sleep_level == 1
    assert set(asleep.sleeping_components) == {"unet", "vae", "text_encoder"}
    assert asleep.statistics.idle_sleeps == 1
    assert metric(pair.metrics_url, "diffusion_sleep_level") == 1
    assert metric(pair.metrics_url, "diffusion_idle_sleeps_total") == 1
    assert "after" in pair.worker.log() and "without requests" in pair.worker.log()

    after = stub.Generate(REQUEST, timeout=60).images[0].data
    assert after == before
    awake = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert awake.state == W.WORKER_STATE_READY and awake.last_sleep_idle  # the last sleep was the idle one


def test_requests_keep_it_awake_and_an_explicit_sleep_is_not_idle(stub):
    wait_for_state(stub, W.WORKER_STATE_SLEEPING, timeout=IDLE_S + 15)
    stub.WakeUp(W.WakeUpRequest(), timeout=30)
    # A manual wake counts as activity: the model stays awake for a while after it.
    assert stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_READY
    for _ in range(3):
        stub.Generate(W.GenerateRequest(prompt="keep awake", num_inference_steps=1, seed=1), timeout=60)
        time.sleep(IDLE_S / 3)
        assert stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_READY
    stub.Sleep(W.SleepRequest(level=1), timeout=30)
    status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert status.state == W.WORKER_STATE_SLEEPING and not status.last_sleep_idle
    stub.WakeUp(W.WakeUpRequest(), timeout=30)
