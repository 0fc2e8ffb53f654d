"""The OpenAI Videos API (``/v1/videos`` on ``--http-port``) through the real ``openai`` SDK's
``videos`` resource, against a real worker and runner serving the built-in ``tiny-wan``; and its
job store (``worker_service/video_jobs.py``) in-process, with a clock of the test's.

One worker (``--max-video-jobs 3``) serves the process tests, which delete the jobs they make.
Videos are tiny: 32x32, 5 frames, 2 steps. The "long" jobs (500 steps) are never left to finish:
they are deleted, which cancels them. The drain test starts a second worker on the same runner (it
ends that worker); the last test loads ``tiny-wan-i2v`` for image-to-video.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import signal
import urllib.error
import urllib.request
from fractions import Fraction

import av
import grpc
import numpy as np
import openai
import pytest
from PIL import Image

from clients import DiffusionClient
from diffusion.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from harness.processes import free_port, start_worker, wait_until, worker_stub
from serving_common.errors import ServiceError
from support import cli
from worker_service.http.openai_videos import frames_for
from worker_service.main import parse_args
from worker_service.video_jobs import COMPLETED, FAILED, IN_PROGRESS, QUEUED, JobError, VideoJob, VideoJobStore

MAX_JOBS = 3
SMALL = {"prompt": "a paper boat", "size": "32x32",
         "extra_body": {"num_frames": 5, "fps": 8, "seed": 3, "num_inference_steps": 2}}
# Runs for many seconds on CPU: only ever deleted.
LONG = {"prompt": "a slow river", "size": "32x32", "extra_body": {"num_frames": 9, "num_inference_steps": 500}}
WAN_GRID = common_pb2.VideoCapabilities(frame_step=4, min_frames=5, max_frames=81, default_frames=81, min_fps=1,
                                        max_fps=60, default_fps=16)


# -- the job store, in-process ---------------------------------------------------------------------

class Clock:
    """Unix seconds that move only when the test moves them."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def store_from_flags(clock: Clock, *flags: str) -> VideoJobStore:
    """The store the worker builds from its command line (``app.build``), on ``clock``."""
    limits = parse_args(["--model", "", *flags])[0].video_jobs
    return VideoJobStore(limits.max_video_jobs, limits.max_video_bytes, limits.video_job_ttl_s, clock)


def job(number: int) -> VideoJob:
    return VideoJob(id=f"video_{number}", model="tiny-wan", prompt="a fox", size="32x32", seconds="0.625",
                    num_frames=5, fps=8, created_at=0)


@pytest.mark.unit
def test_finished_jobs_expire_after_the_ttl_and_free_their_bytes():
    clock = Clock()
    store = store_from_flags(clock, "--video-job-ttl-s", "30", "--max-video-jobs", "2")
    done, failed = job(1), job(2)
    store.add(done)
    store.add(failed)
    store.complete(done, b"m" * 100)
    store.fail(failed, JobError("internal", "broken"))
    assert (done.status, done.progress, failed.status) == (COMPLETED, 100, FAILED)
    assert done.expires_at == done.completed_at + 30 and store.held_bytes == 100
    clock.now += 29.5
    assert store.get(done.id) is done and store.get(failed.id) is failed
    clock.now += 0.5
    for gone in (done.id, failed.id):
        with pytest.raises(ServiceError) as caught:
            store.get(gone)
        assert caught.value.code == grpc.StatusCode.NOT_FOUND and "expired" in caught.value.message
    assert store.held_bytes == 0 and done.content == b"" and store.jobs() == []
    store.add(job(3))  # room again


@pytest.mark.unit
def test_a_full_store_and_a_video_past_the_byte_budget_are_refused():
    store = store_from_flags(Clock(), "--max-video-jobs", "2", "--max-video-bytes", "150")
    first, second = job(1), job(2)
    store.add(first)
    store.add(second)
    with pytest.raises(ServiceError) as full:
        store.add(job(3))
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-video-jobs" in full.value.message
    assert [kept.id for kept in store.jobs()] == [first.id, second.id]
    store.complete(first, b"m" * 100)
    store.complete(second, b"m" * 100)  # 200 > 150: not kept
    assert second.status == FAILED and second.content == b"" and store.held_bytes == 100
    assert second.error is not None and second.error.code == "resource_exhausted"
    assert "--max-video-bytes" in second.error.message


@pytest.mark.unit
def test_a_failed_job_stays_readable_but_frees_its_place():
    """A burst of jobs that fail must not block creates for the TTL: failed jobs count no more, and
    at most --max-video-jobs of them are kept, the oldest dropped first."""
    store = store_from_flags(Clock(), "--max-video-jobs", "2")
    first, second = job(1), job(2)
    store.add(first)
    store.add(second)
    store.fail(first, JobError("unavailable", "the runner went away"))
    third = job(3)
    store.add(third)  # the failed one holds no place
    assert store.get(first.id) is first and first.status == FAILED
    with pytest.raises(ServiceError) as full:  # two live jobs: full
        store.add(job(4))
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for failing in (second, third):
        store.fail(failing, JobError("unavailable", "the runner went away"))
    assert [kept.id for kept in store.jobs()] == [second.id, third.id]  # the oldest failed one went


@pytest.mark.unit
def test_deleting_a_running_job_cancels_its_task_before_it_answers():
    async def scenario() -> None:
        store = VideoJobStore(4, 1000, 60.0)
        running = job(1)
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def request() -> None:
            started.set()
            try:
                await asyncio.Event().wait()  # a request that never ends by itself
            except asyncio.CancelledError:
                cancelled.set()
                raise

        store.add(running)
        running.task = asyncio.create_task(request())
        await started.wait()
        assert await store.delete(running.id) is running
        assert cancelled.is_set() and running.task.cancelled()
        store.complete(running, b"late")  # a result that arrives after the delete is dropped
        assert store.jobs() == [] and store.held_bytes == 0

    asyncio.run(scenario())


@pytest.mark.unit
def test_progress_maps_denoising_decoding_and_encoding_onto_0_to_100():
    progress = job(1)
    seen = [progress.progress]
    for phase, total in ((common_pb2.PROGRESS_PHASE_DENOISING, 4), (common_pb2.PROGRESS_PHASE_DECODING, 2),
                         (common_pb2.PROGRESS_PHASE_ENCODING, 5)):
        for step in range(1, total + 1):
            progress.on_progress(worker_pb2.ProgressEvent(step=step, total_steps=total, phase=phase))
            seen.append(progress.progress)
    assert progress.status == IN_PROGRESS
    assert seen[:5] == [0, 20, 40, 60, 80] and seen[5:7] == [87, 95] and seen[-1] == 99
    assert seen == sorted(seen)
    progress.on_progress(worker_pb2.ProgressEvent(step=1, total_steps=4))  # unset phase: denoising; never back
    assert progress.progress == 99


@pytest.mark.unit
@pytest.mark.parametrize("seconds, fps, frames", [(0.5, 16, 9), (1.0, 16, 17), (0.3, 16, 5), (0.01, 16, 1),
                                                  (5.0, 16, 81), (5.1, 16, None), (1e308, 16, None)])
def test_seconds_become_frames_on_the_models_grid(seconds, fps, frames):
    assert frames_for(seconds, fps, WAN_GRID) == frames


# -- the API, against a real worker and runner -----------------------------------------------------

@pytest.fixture(scope="module")
def pair(serve, real_runner):
    return serve("--model", "tiny-wan", "--max-video-jobs", str(MAX_JOBS), "--max-queue", "4", "--max-batch-size", "1",
                 "--runner-keepalive", "0",  # a test freezes the runner: not taken for lost
                 on=real_runner, http=True)


@pytest.fixture(scope="module")
def stub(pair):
    """Not warmed, unlike the shared ``stub``: its warm-up is a default GenerateRequest, and this
    worker serves a video model."""
    with worker_stub(pair.worker.target, warm=False) as stub:
        yield stub


@pytest.fixture
def sdk(pair):
    client = openai.OpenAI(base_url=pair.base_url, api_key="unused", max_retries=0, timeout=60)
    yield client
    for left in client.videos.list(limit=100).data:  # a failed test leaves the store as it found it
        client.videos.delete(left.id)


def decoded(mp4: bytes) -> tuple[int, tuple[int, int], Fraction, list[bytes]]:
    """Frame count, size, frame rate and the RGB frames of an MP4, decoded back with PyAV."""
    with av.open(io.BytesIO(mp4)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        rate = stream.average_rate
    return len(frames), (frames[0].shape[1], frames[0].shape[0]), rate, [frame.tobytes() for frame in frames]


def png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(out, "PNG")
    return out.getvalue()


@pytest.mark.process
def test_sdk_creates_polls_and_downloads_the_mp4(sdk):
    created = sdk.videos.create(**SMALL)
    assert (created.object, created.status, created.progress) == ("video", QUEUED, 0)
    assert (created.size, created.seconds, created.model) == ("32x32", "0.625", "tiny-wan")
    assert created.model_extra["num_frames"] == 5 and created.model_extra["fps"] == 8
    done = sdk.videos.poll(created.id, poll_interval_ms=50)
    assert (done.status, done.progress, done.error) == (COMPLETED, 100, None), done
    assert done.completed_at >= done.created_at and done.expires_at > done.completed_at
    content = sdk.videos.download_content(created.id)
    assert content.response.headers["content-type"] == "video/mp4"
    count, size, rate, frames = decoded(content.content)
    assert (count, size, rate) == (5, (32, 32), 8)
    assert len(set(frames)) > 1  # a video, not one frame repeated

    again = sdk.videos.create_and_poll(**{**SMALL, "size": "48x32"}, poll_interval_ms=50)
    assert (again.status, again.size) == (COMPLETED, "48x32"), again
    assert decoded(sdk.videos.download_content(again.id).content)[:3] == (5, (48, 32), 8)
    listed = sdk.videos.list(order="asc")
    assert [video.id for video in listed.data] == [created.id, again.id] and listed.has_more is False

    deleted = sdk.videos.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "video.deleted", True)
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        sdk.videos.download_content(created.id)


@pytest.mark.process
def test_seconds_are_snapped_onto_the_frame_grid(sdk):
    video = sdk.videos.create(prompt="a kite", size="32x32", seconds="0.5",
                              extra_body={"fps": 16, "num_inference_steps": 2})
    assert video.model_extra["num_frames"] == 9 and video.seconds == "0.5625"  # round(0.5 x 16) = 8 -> 4k+1


@pytest.mark.process
@pytest.mark.parametrize("fields, param", [
    ({"extra_body": {"num_frames": 6}}, "num_frames"),  # off the 4k+1 grid
    ({"extra_body": {"num_frames": 4001}}, "num_frames"),  # above the model's limit
    ({"extra_body": {"fps": 0}}, "fps"),
    ({"seconds": "60"}, "seconds"),  # 960 frames at 16 fps
    ({"seconds": "soon"}, "seconds"),
    ({"size": "33x32"}, "size"),
    ({"extra_body": {"n": 2}}, "n"),
    ({"extra_body": {"num_inference_steps": 100000}}, "num_inference_steps"),
])
def test_bad_fields_are_400_naming_them_and_make_no_job(sdk, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.videos.create(**{"prompt": "a kite", "size": "32x32", **fields})
    error = caught.value
    assert error.status_code == 400 and error.body["param"] == param, error.body
    assert error.body["code"] == "invalid_argument"
    assert sdk.videos.list().data == []


@pytest.mark.process
def test_a_model_not_served_is_404_naming_the_served_one_and_makes_no_job(sdk):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.videos.create(prompt="a kite", size="32x32", model="sora-2")
    assert caught.value.body["param"] == "model" and "this worker serves 'tiny-wan'" in caught.value.body["message"]
    assert sdk.videos.list().data == []


def call(base_url: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None,
         method: str | None = None) -> tuple[int, dict]:
    """An HTTP call to ``base_url`` + ``path`` as it is, bytes for bytes: the answer's status and JSON body."""
    request = urllib.request.Request(f"{base_url}{path}", data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def post_json(base_url: str, body: dict) -> tuple[int, dict]:
    """POST /v1/videos with a JSON body (the SDK always sends multipart): the answer's status and body."""
    return call(base_url, "/videos", json.dumps(body).encode(), {"Content-Type": "application/json"})


def multipart(fields: dict[str, bytes], files: dict[str, bytes] | None = None) -> tuple[bytes, dict[str, str]]:
    """A multipart/form-data body of text ``fields`` and PNG ``files``, their bytes as given (an SDK
    would send valid UTF-8), and its Content-Type header."""
    boundary = "kite-boundary"
    parts = [(f'name="{name}"', value) for name, value in fields.items()]
    parts += [(f'name="{name}"; filename="{name}.png"\r\nContent-Type: image/png', value)
              for name, value in (files or {}).items()]
    body = b"".join(f"--{boundary}\r\nContent-Disposition: form-data; {disposition}\r\n\r\n".encode() + value
                    + b"\r\n" for disposition, value in parts) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


KITE = {"prompt": "a kite", "size": "32x32", "num_inference_steps": 2}
KITE_FORM = {name: str(value).encode() for name, value in KITE.items()}


@pytest.mark.process
@pytest.mark.parametrize("path, send, param", [
    ("/videos", {**KITE, "seconds": "1e10"}, "seconds"),  # frames past any uint32
    ("/videos", {**KITE, "seconds": "1e308"}, "seconds"),  # seconds x fps is infinite
    ("/videos", {**KITE, "seconds": 1e300}, "seconds"),
    ("/videos", {**KITE, "seconds": "0_1", "fps": 8}, "seconds"),  # float() reads 1 s
    ("/videos", {**KITE, "seconds": "4", "fps": 4294967295}, "fps"),
    ("/videos", multipart({**KITE_FORM, "seconds": b"1e300"}), "seconds"),
    ("/videos", multipart({**KITE_FORM, "fps": "\u0668".encode()}), "fps"),  # Arabic-Indic 8: int() reads 8
    ("/videos", multipart({**KITE_FORM, "num_frames": "\u0665".encode()}), "num_frames"),
    ("/videos", multipart({**KITE_FORM, "prompt": b"a \xff kite"}), "prompt"),  # not UTF-8
    ("/images/edits", multipart({"prompt": b"a kite", "n": "\u0663".encode()}, {"image": png((200, 30, 30))}), "n"),
    ("/images/edits", multipart({"prompt": b"a \xc3\x28 kite"}, {"image": png((200, 30, 30))}), "prompt"),
    ("/images/generations", (json.dumps({"prompt": "a kite"}).encode(), {"X-Request-Timeout": "1_0"}),
     "X-Request-Timeout"),
    ("/videos?limit=%C2%B2", None, "limit"),  # "\u00b2".isdigit(), and int() refuses it
    ("/videos?limit=" + "1" * 5000, None, "limit"),  # int() refuses 4,300 digits
])
def test_numbers_are_ascii_decimal_and_text_parts_utf8_else_400_naming_the_field(pair, sdk, path, send, param):
    """Every number an HTTP caller writes as text (a multipart field, a JSON string, a query
    parameter, a header) is ASCII decimal, and every text part UTF-8, or the call is 400 naming it:
    none is 500, none read as another number, none decoded as other characters."""
    if isinstance(send, dict):
        status, answer = call(pair.base_url, path, json.dumps(send).encode(), {"Content-Type": "application/json"})
    elif send is None:
        status, answer = call(pair.base_url, path)
    else:
        status, answer = call(pair.base_url, path, *send)
    error = answer.get("error") or {}
    assert status == 400 and error["param"] == param and error["code"] == "invalid_argument", (status, answer)
    assert sdk.videos.list().data == []


@pytest.mark.process
def test_image_calls_on_a_video_model_name_the_model_not_output_format(sdk):
    """The caller never set output_format: an Images API call on a model that makes only videos says so."""
    with pytest.raises(openai.BadRequestError) as generation:
        sdk.images.generate(prompt="a kite", size="32x32")
    with pytest.raises(openai.BadRequestError) as edit:
        sdk.images.edit(image=("red.png", png((200, 30, 30)), "image/png"), prompt="a kite")
    for caught in (generation, edit):
        error = caught.value.body
        assert error["param"] == "model" and "POST /v1/videos" in error["message"], error
        assert "output_format" not in error["message"], error


@pytest.mark.process
def test_a_create_while_the_model_sleeps_is_refused_and_makes_no_job(stub, sdk):
    """Without --auto-wake nothing would run: the create is refused as the Images API refuses a
    generation then (503, failed_precondition), rather than making a job that fails at once."""
    stub.Sleep(worker_pb2.SleepRequest(level=1), timeout=60)
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            sdk.videos.create(**SMALL)
        error = caught.value.body
        assert caught.value.status_code == 503 and error["code"] == "failed_precondition", error
        assert "WakeUp" in error["message"], error
        assert sdk.videos.list().data == []
    finally:
        stub.WakeUp(worker_pb2.WakeUpRequest(), timeout=60)
    assert sdk.videos.create(**SMALL).status == QUEUED  # awake: created again


@pytest.mark.process
def test_a_create_while_the_worker_drains_is_503_and_makes_no_job(real_runner, tmp_path):
    """A second worker on the module's runner drains on SIGTERM while a job of its runs (the runner
    frozen, so it is still running however fast the machine): a create then is 503 and makes no job;
    the job in flight is deleted, and the worker exits."""
    port = free_port()
    draining = start_worker(tmp_path, real_runner.target, "--model", "tiny-wan", "--http-port", str(port),
                            "--runner-keepalive", "0", "--grace", "300")
    base_url = f"http://127.0.0.1:{port}/v1"
    long = {"prompt": "a slow river", "size": "32x32", "num_frames": 9, "num_inference_steps": 500}
    try:
        status, running = post_json(base_url, long)
        assert status == 200, running
        wait_until(lambda: call(base_url, f"/videos/{running['id']}")[1]["status"] == IN_PROGRESS, 60,
                   "the job in progress")
        with real_runner.frozen(), grpc.insecure_channel(draining.target) as channel:
            draining.process.send_signal(signal.SIGTERM)
            status_of = worker_pb2_grpc.WorkerServiceStub(channel).GetStatus
            wait_until(lambda: status_of(worker_pb2.GetStatusRequest(), timeout=5).state
                       == worker_pb2.WORKER_STATE_DRAINING, 30, "DRAINING")
            status, refused = post_json(base_url, {**long, "num_inference_steps": 2})
            assert status == 503 and refused["error"]["code"] == "unavailable", refused
            assert "draining" in refused["error"]["message"], refused
            assert [job["id"] for job in call(base_url, "/videos")[1]["data"]] == [running["id"]]
        assert call(base_url, f"/videos/{running['id']}", method="DELETE")[1]["deleted"]
        assert draining.process.wait(60) == 0
    finally:
        draining.stop()


@pytest.mark.process
def test_json_bodies_and_their_input_reference(pair, sdk):
    status, created = post_json(pair.base_url, {"prompt": "a kite", "size": "32x32", "num_frames": 5,
                                                "num_inference_steps": 2})
    assert status == 200 and created["object"] == "video" and created["size"] == "32x32", created
    assert sdk.videos.retrieve(created["id"]).model_extra["num_frames"] == 5
    for reference in ({"image_url": "https://example.com/a.png"}, {"file_id": "file-1"},
                      {"image_url": "data:image/png;base64,not base64!"}):
        status, refused = post_json(pair.base_url, {"prompt": "a kite", "input_reference": reference})
        assert status == 400 and refused["error"]["param"] == "input_reference", refused
    data_url = "data:image/png;base64," + base64.b64encode(png((9, 9, 9))).decode()
    status, refused = post_json(pair.base_url, {"prompt": "a kite", "input_reference": {"image_url": data_url}})
    assert status == 400 and refused["error"]["param"] == "input_reference", refused
    assert refused["error"]["message"] == "input_reference: 'tiny-wan' makes videos from text only: it takes no " \
                                          "input_reference", refused  # nothing of output_format or num_frames


@pytest.mark.process
def test_a_full_store_is_429(sdk):
    kept = [sdk.videos.create(**LONG) for _ in range(MAX_JOBS)]
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.videos.create(**SMALL)
    assert caught.value.status_code == 429 and caught.value.body["code"] == "resource_exhausted"
    assert "--max-video-jobs" in caught.value.body["message"]
    assert caught.value.response.headers["retry-after"] == "1"
    assert [video.id for video in sdk.videos.list(order="asc").data] == [video.id for video in kept]


@pytest.mark.process
def test_deleting_a_running_job_cancels_its_request(pair, stub, sdk):
    video = sdk.videos.create(**LONG)
    running = wait_until(lambda: (found := sdk.videos.retrieve(video.id)).status == IN_PROGRESS and found, 60,
                         "the job in progress")
    assert 0 <= running.progress < 80
    with pytest.raises(openai.ConflictError) as early:  # nothing to download yet
        sdk.videos.download_content(video.id)
    assert early.value.status_code == 409 and early.value.body["param"] == "video_id"
    assert sdk.videos.delete(video.id).deleted
    # The delete is answered once the request has ended on the worker: nothing of it runs on.
    assert list(stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).active_requests) == []
    request_id = video.id.removeprefix("video_")
    assert f"request {request_id} done" not in pair.worker.log()
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(video.id)


@pytest.mark.process
def test_image_to_video_from_an_uploaded_image(pair, stub, sdk, tmp_path):
    """Last: it loads tiny-wan-i2v in place of tiny-wan; image-to-video through HTTP, the Python
    client and the CLI, on the same worker."""
    with pytest.raises(openai.BadRequestError) as text_model:  # tiny-wan takes no image
        sdk.videos.create(**SMALL, input_reference=("red.png", png((200, 30, 30)), "image/png"))
    assert text_model.value.body["param"] == "input_reference"
    assert "from text only" in text_model.value.body["message"]
    stub.Init(worker_pb2.InitRequest(model="tiny-wan-i2v"), timeout=300)
    video = sdk.videos.create_and_poll(**SMALL, input_reference=("red.png", png((200, 30, 30)), "image/png"),
                                       poll_interval_ms=50)
    assert video.status == COMPLETED and video.model == "tiny-wan-i2v", video
    count, size, rate, _ = decoded(sdk.videos.download_content(video.id).content)
    assert (count, size, rate) == (5, (32, 32), 8)
    with DiffusionClient(pair.worker.target) as client:
        red, blue = (client.generate_video("a fox", image=png(color), num_frames=5, fps=8, width=32, height=32,
                                           steps=2, seed=3) for color in ((200, 30, 30), (30, 30, 200)))
    assert red.frames.shape == (5, 32, 32, 3) and not np.array_equal(red.frames, blue.frames)
    (tmp_path / "red.png").write_bytes(png((200, 30, 30)))
    done = cli("--target", pair.worker.target, "generate-video", "a fox", "--image", str(tmp_path / "red.png"),
               "-o", str(tmp_path / "fox.raw"), "--frames", "5", "--fps", "8", "--size", "32x32", "--steps", "2",
               "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "fox.raw").read_bytes() == red.frames.tobytes()  # the same request, the same frames

