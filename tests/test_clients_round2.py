"""The clients and the CLI agree (issue 36, items 6 to 8), against real workers and runners over loopback.

- A value the worker refuses whatever its flags and model is refused by the clients before anything
  is sent, sync and asyncio alike: ``InvalidArgument`` naming the field as the worker names it.
- ``generate`` and ``generate-video`` take the same size flags (``--width/--height`` or ``--size``) and
  ``--resize``; ``--timeout`` is taken after the command too, and a timeout says what it waited for.
- ``diffusion status`` is a summary of at most 30 lines; ``--json`` prints the whole message.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from PIL import Image

from clients import AsyncDiffusionClient, DiffusionClient, InvalidArgument, field_violations
from clients.status_summary import MAX_LINES, status_summary
from diffusion.v1 import common_pb2, worker_pb2
from harness.processes import worker_stub
from support import Pair, cli, start_pair

pytestmark = [pytest.mark.timeout(300), pytest.mark.process]
NOBODY = "127.0.0.1:1"  # nothing listens on port 1


@pytest.fixture(scope="module")
def worker(tiny_pair: Pair) -> Any:
    """The session's worker serving tiny (see fixtures_worker.py); only requests are sent to it."""
    return tiny_pair.worker


@pytest.fixture(scope="module")
def client(worker: Any) -> Iterator[DiffusionClient]:
    with DiffusionClient(worker.target, timeout=60) as client:
        yield client


def generate_calls(client: DiffusionClient) -> list[worker_pb2.RequestCount]:
    """The worker's counts of finished Generate and GenerateStream calls, by outcome."""
    return [count for count in client.status().statistics.requests if count.method.startswith("Generate")]


# --- item 6: the clients refuse what the worker would, before sending it ----------------------------

# (options, the field named): each refused by the worker whatever its flags and model.
REFUSED = [
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"steps": 0}, "num_inference_steps"),
    ({"steps": -3}, "num_inference_steps"),
    ({"num_images": 0}, "num_images"),
    ({"width": 0}, "width"),
    ({"height": -64}, "height"),
    ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"guidance_scale": math.nan}, "guidance_scale"),
    ({"true_cfg_scale": math.inf}, "true_cfg_scale"),
    ({"cache_threshold": -0.5}, "cache_threshold"),
    ({"strength": 1.5}, "strength"),
    ({"strength": 0.1, "steps": 4}, "strength"),  # 0.1 of 4 steps runs none
    ({"adapters": ["no.dots"]}, "adapters[0].name"),
    ({"adapters": {"style": math.nan}}, "adapters[0].scale"),
    ({"request_id": "has a space"}, "request_id"),
    ({"num_frames": 0}, "num_frames"),
]


@pytest.mark.parametrize("options, field", REFUSED, ids=[f"{field}={options}" for options, field in REFUSED])
def test_generate_refuses_before_sending_naming_the_field(client, options, field):
    before = generate_calls(client)
    with pytest.raises(InvalidArgument) as caught:
        client.generate("a fox", **options)
    assert field in caught.value.violations, caught.value.violations
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and isinstance(caught.value, grpc.RpcError)
    assert field_violations(caught.value) == caught.value.violations  # read as the worker's refusals are
    assert str(caught.value).startswith(f"INVALID_ARGUMENT: {field}: ")
    assert generate_calls(client) == before  # nothing reached the worker


def test_every_way_to_generate_refuses_the_same(worker, client):
    """Sync and asyncio, whole or streamed, images or a video: one check, one refusal."""
    sync: list[Callable[..., Any]] = [client.generate, client.stream, client.generate_video, client.stream_video]
    for call in sync:
        for options, field in (({"seed": -1}, "seed"), ({"steps": 0}, "num_inference_steps")):
            with pytest.raises(InvalidArgument) as caught:
                call("a fox", **options)
            assert set(caught.value.violations) == {field}, (call, caught.value.violations)

    async def refusals() -> list[dict[str, str]]:
        found = []
        async with AsyncDiffusionClient(worker.target, timeout=60) as aio:
            for call in (aio.generate, aio.generate_video):
                for options in ({"seed": -1}, {"steps": 0}):
                    with pytest.raises(InvalidArgument) as caught:
                        await call("a fox", **options)
                    found.append(caught.value.violations)
            for streaming in (aio.stream, aio.stream_video):
                with pytest.raises(InvalidArgument) as caught:
                    streaming("a fox", seed=2**64)
                found.append(caught.value.violations)
        return found

    assert [set(v) for v in asyncio.run(refusals())] == [{"seed"}, {"num_inference_steps"}] * 2 + [{"seed"}] * 2


def test_several_bad_values_are_named_together(client):
    with pytest.raises(InvalidArgument) as caught:
        client.generate("a fox", seed=-1, steps=0, width=0, guidance_scale=-2.0)
    assert set(caught.value.violations) == {"seed", "num_inference_steps", "width", "guidance_scale"}


@pytest.mark.parametrize("options, field", [
    ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"cache_threshold": -0.5}, "cache_threshold"),
    ({"strength": 1.5}, "strength"),
    ({"adapters": ["no.dots"]}, "adapters[0].name"),
    ({"request_id": "has a space"}, "request_id"),
])
def test_the_worker_refuses_the_same_values_naming_the_same_fields(client, worker, options, field):
    """What the client refuses locally and the wire can carry, the worker refuses too, by the same name."""
    with pytest.raises(InvalidArgument) as local:
        client.generate("a fox", **options)
    request = worker_pb2.GenerateRequest(prompt="a fox", num_inference_steps=1)
    for name, value in options.items():
        if name == "adapters":
            request.adapters.add(name=value[0])
        else:
            setattr(request, name, value)
    with worker_stub(worker.target, warm=False) as stub, pytest.raises(grpc.RpcError) as remote:
        stub.Generate(request, timeout=60)
    assert remote.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in field_violations(remote.value) and field in local.value.violations


def test_the_edges_of_the_ranges_are_sent(client):
    result = client.generate("a fox", seed=2**64 - 1, steps=1, num_images=2, width=64, height=64,
                             guidance_scale=0.0, output_format="raw")
    assert [image.seed for image in result.images] == [2**64 - 1, 0]  # the second wraps around


# --- item 7: one set of flags ---------------------------------------------------------------------

def test_generate_takes_size(worker, tmp_path):
    out = tmp_path / "fox.png"
    done = cli("--target", worker.target, "generate", "a fox", "-o", str(out), "--size", "64x48", "--steps", "1")
    assert done.returncode == 0, done.stderr
    with Image.open(out) as image:
        assert image.size == (64, 48)


@pytest.mark.unit
@pytest.mark.parametrize("command, out", [("generate", "x.png"), ("generate-video", "x.mp4")])
def test_size_and_width_together_are_refused(command, out, tmp_path):
    done = cli("--target", NOBODY, command, "a fox", "-o", str(tmp_path / out), "--size", "64x64", "--width", "32")
    assert done.returncode == 2 and "--size 64x64 and --width/--height both give the size" in done.stderr


@pytest.fixture(scope="module")
def i2v(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A runner and a worker serving tiny-wan-i2v (image-to-video), for this module."""
    pair = start_pair(tmp_path_factory.mktemp("i2v-pair"), "--model", "tiny-wan-i2v")
    yield pair
    pair.stop()


def test_generate_video_takes_width_height_and_resize(i2v, tmp_path):
    first = tmp_path / "first.png"
    Image.new("RGB", (48, 40), (200, 30, 30)).save(first)
    flags = ["--target", i2v.worker.target, "generate-video", "a fox", "-o", str(tmp_path / "fox.mp4"),
             "--frames", "5", "--width", "32", "--height", "32", "--steps", "1", "--image", str(first)]
    refused = cli(*flags)
    assert refused.returncode == 1 and "is 48x40, not the 32x32 asked for" in refused.stderr, refused.stderr
    done = cli(*flags, "--resize", "crop")
    assert done.returncode == 0, done.stderr
    assert "(5 frames of 32x32 at" in done.stdout


@pytest.mark.unit
def test_a_timeout_after_the_command_counts_and_says_what_it_waited_for(tmp_path):
    # Without the --timeout after it, --wait would wait for the worker that never comes.
    done = cli("--target", NOBODY, "generate", "a fox", "-o", str(tmp_path / "x.png"), "--wait", "--timeout", "0.5")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (f"error: DEADLINE_EXCEEDED: timed out after 0.5 s waiting for the "
                                            f"worker at {NOBODY} to be ready"), done.stderr


@pytest.mark.unit
def test_a_timeout_after_the_command_is_checked_as_before_it():
    done = cli("--target", NOBODY, "status", "--timeout", "nan")
    assert done.returncode == 2 and "--timeout" in done.stderr, done.stderr


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A worker on the torch-free fake runner, to freeze."""
    pair = start_pair(tmp_path_factory.mktemp("fake-pair"), fake_step_s=0.01)
    yield pair
    pair.stop()


@pytest.mark.parametrize("args, awaited", [
    (["status"], "the worker at {target} to answer GetStatus"),
    (["adapters", "list"], "the worker at {target} to answer ListAdapters"),
    (["generate", "a fox", "-o", "OUT"], "the images from the worker at {target}"),
])
def test_a_timeout_names_the_call_it_waited_for(fake, args, awaited, tmp_path):
    """A frozen worker answers nothing, however fast the machine: every call reaches its deadline."""
    args = [str(tmp_path / "x.png") if arg == "OUT" else arg for arg in args]
    with fake.worker.frozen():
        done = cli("--target", fake.worker.target, *args, "--timeout", "0.5")
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == ("error: DEADLINE_EXCEEDED: timed out after 0.5 s waiting for "
                                            + awaited.format(target=fake.worker.target)), done.stderr


# --- item 8: diffusion status ---------------------------------------------------------------------

def test_status_is_a_short_summary(worker, tiny_pair):
    done = cli("--target", worker.target, "status")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) <= MAX_LINES, done.stdout
    labels = [line.split()[0] for line in lines if not line.startswith(" ")]
    assert labels == ["state", "model", "sizes", "tasks", "sleep", "runners", "queue", "acceleration", "parallel"]
    assert lines[0].split() == ["state", "ready"]
    assert lines[1].startswith("model         tiny (StableDiffusionPipeline, float32), weights ")
    assert done.stdout.count("StableDiffusionPipeline") == 1  # the model once, not once per runner
    runner = next(i for i, line in enumerate(lines) if line.startswith(f"  {tiny_pair.runner.target}  ready, cpu"))
    assert lines[runner + 1].startswith("    devices 0: ")
    assert any(line.startswith("sleep         awake") for line in lines), done.stdout


def test_status_json_is_the_whole_message(worker):
    done = cli("--target", worker.target, "status", "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["state"] == "WORKER_STATE_READY" and shown["runners"][0]["info"]["model"]["source"] == "tiny"


@pytest.mark.unit
def test_status_of_many_runners_stays_within_its_lines():
    model = common_pb2.ModelInfo(
        source="tiny-flux", pipeline_class="FluxPipeline", dtype=common_pb2.DTYPE_BFLOAT16, size_multiple=16,
        min_size=16, max_size=2048, acceleration=common_pb2.Acceleration(
            cache="first_block_cache", cache_threshold=0.2, compile=True, quantization="int8-weight-only"),
        parallel=common_pb2.Parallelism(cfg=True, ulysses_degree=2))
    devices = [common_pb2.DeviceInfo(rank=rank, device_name="NVIDIA H100", memory=common_pb2.MemoryInfo(
        used_bytes=10 * 1024**3, total_bytes=80 * 1024**3)) for rank in range(8)]
    runners = [worker_pb2.RunnerStatus(target=f"10.0.0.{i}:50052", connected=i != 3, ready=i % 2 == 0,
                                       info=common_pb2.RunnerInfo(platform="cuda", devices=devices) if i != 3 else None)
               for i in range(20)]
    status = worker_pb2.GetStatusResponse(
        state=worker_pb2.WORKER_STATE_SLEEPING, model=model, sleep_level=1, sleeping_components=["transformer"],
        last_sleep_idle=True, idle_sleep_after_s=300, runners=runners, queue_depth=4, requests_in_flight=2)
    text = status_summary(status)
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, text
    assert lines[0].split() == ["state", "sleeping"]
    assert "sleep         level 1 (transformer), by the idle timer; sleeps after 300 s idle" in lines
    assert "runners       10 of 20 ready" in lines and "  and 12 more (diffusion status --json)" in lines
    assert "  10.0.0.3:50052  unreachable, restarts 0" in lines
    assert "queue         4 queued, 2 in flight (diffusion requests)" in lines
    assert any(line.startswith("acceleration  first_block_cache (threshold 0.2, warmup 0), compiled, "
                               "int8-weight-only") for line in lines), text
    assert "parallel      cfg, ulysses 2" in lines
    assert lines[[line.split()[0] for line in lines].index("runners") + 2].startswith(
        "    devices 0: NVIDIA H100 10.0/80.0 GiB; 1: NVIDIA H100")


@pytest.mark.unit
def test_status_without_a_model_says_so():
    text = status_summary(worker_pb2.GetStatusResponse(state=worker_pb2.WORKER_STATE_STARTING,
                                                       message="no runner reachable yet"))
    assert text.splitlines()[:2] == ["state         starting: no runner reachable yet", "model         none loaded"]
