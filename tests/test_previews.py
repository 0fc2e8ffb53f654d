"""Streamed partial images: latent previews at evenly spaced steps, through the real OpenAI SDK
(``stream=True, partial_images=N``), gRPC GenerateStream and the CLI's ``--previews``, against a
real worker and runner serving ``tiny`` (SD 1.x latents: 64x64 images give 8x8 previews); and the
runner's previews in process, on its request-level path and for Flux's packed latents."""

from __future__ import annotations

import base64
import io
import re
import subprocess
import threading

import grpc
import numpy as np
import openai
import pytest
from openai.types import (
    ImageEditCompletedEvent,
    ImageEditPartialImageEvent,
    ImageGenCompletedEvent,
    ImageGenPartialImageEvent,
)
from PIL import Image

from diffusion.v1 import worker_pb2
from harness.processes import free_port, wait_until, worker_stub
from support import cli_command, cli_env, running_pair

STEPS = 4  # with 2 previews: after steps 1 and 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    port = free_port()
    with running_pair(tmp_path_factory.mktemp("previews"), "--http-port", str(port)) as pair:
        pair.worker.extra.update(base_url=f"http://127.0.0.1:{port}/v1")
        yield pair


@pytest.fixture(scope="module")
def stub(pair):
    with worker_stub(pair.worker.target) as stub:
        yield stub


def sdk(pair) -> openai.OpenAI:
    return openai.OpenAI(base_url=pair.worker.extra["base_url"], api_key="unused", max_retries=0, timeout=120)


def decoded(data: bytes, size: int) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.format == "PNG" and image.size == (size, size)
    return image


def picture() -> bytes:
    encoded = io.BytesIO()
    Image.radial_gradient("L").resize((64, 64)).convert("RGB").save(encoded, "PNG")
    return encoded.getvalue()


def check_stream(events, partial_type, completed_type, kind: str) -> None:
    """Partial images 0 and 1 (8x8 previews), then the 64x64 image, as the SDK parsed them."""
    assert [type(event) for event in events] == [partial_type, partial_type, completed_type], events
    *partials, completed = events
    assert [event.partial_image_index for event in partials] == [0, 1]
    assert all(event.type == f"{kind}.partial_image" and event.size == "8x8" and event.output_format == "png"
               for event in partials)
    previews = [decoded(base64.b64decode(event.b64_json), 8) for event in partials]
    assert previews[0].tobytes() != previews[1].tobytes()  # the latents moved between the two steps
    assert completed.type == f"{kind}.completed" and completed.size == "64x64"
    assert completed.usage.total_tokens == 0
    decoded(base64.b64decode(completed.b64_json), 64)


@pytest.mark.process
def test_sdk_streams_partial_images_of_a_generation(pair):
    stream = sdk(pair).images.generate(prompt="a red fox", size="64x64", stream=True, partial_images=2,
                                       extra_body={"num_inference_steps": STEPS, "seed": 1})
    check_stream(list(stream), ImageGenPartialImageEvent, ImageGenCompletedEvent, "image_generation")


@pytest.mark.process
def test_sdk_streams_partial_images_of_an_edit(pair):
    # Image-to-image at strength 0.8: 4 of 5 steps.
    stream = sdk(pair).images.edit(image=("fox.png", picture(), "image/png"), prompt="a red fox", stream=True,
                                   partial_images=2, extra_body={"num_inference_steps": 5, "seed": 1})
    check_stream(list(stream), ImageEditPartialImageEvent, ImageEditCompletedEvent, "image_edit")


@pytest.mark.process
def test_sdk_stream_without_partial_images_is_the_image_alone_with_its_seed(pair):
    events = list(sdk(pair).images.generate(prompt="a red fox", size="64x64", stream=True, n=2,
                                            extra_body={"num_inference_steps": 2, "seed": 5}))
    assert [type(event) for event in events] == [ImageGenCompletedEvent] * 2
    assert [(event.model_extra["image_index"], event.model_extra["seed"]) for event in events] == [(0, 5), (1, 6)]


@pytest.mark.process
def test_a_client_that_leaves_a_stream_cancels_its_request(pair):
    """Gone after its first preview (step 100 of 400), the request stops at the runner's next step."""
    stream = sdk(pair).images.generate(prompt="a slow fox", size="64x64", stream=True, partial_images=3,
                                       extra_body={"num_inference_steps": 400})
    request_id = stream.response.headers["x-request-id"]
    assert isinstance(next(iter(stream)), ImageGenPartialImageEvent)
    stream.close()
    stopped = re.compile(rf"stopped {request_id} after step (\d+): the call ended")
    found = wait_until(lambda: stopped.search(pair.runner.log_path.read_text()), 60,
                       "the runner to log where it stopped")
    assert 100 <= int(found[1]) < 400


@pytest.mark.process
@pytest.mark.parametrize("fields, words", [
    ({"stream": True, "partial_images": 4}, "must be 0 to 3, got 4"),
    ({"stream": False, "partial_images": 1}, "set stream to true"),
])
def test_bad_partial_images_are_400_naming_it(pair, fields, words):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(pair).images.generate(prompt="a red fox", size="64x64", **fields)
    error = caught.value.body
    assert error["param"] == "partial_images" and words in error["message"], error


@pytest.mark.process
def test_grpc_stream_sends_previews_in_progress_events(stub):
    """Three previews of each of two images, after steps 1, 2 and 3; PNG for a raw request."""
    request = worker_pb2.GenerateRequest(prompt="a red fox", width=64, height=64, num_inference_steps=STEPS,
                                         num_images=2, seed=3, partial_images=3,
                                         output_format=worker_pb2.OUTPUT_FORMAT_RAW)
    events = list(stub.GenerateStream(worker_pb2.GenerateStreamRequest(request=request), timeout=120))
    progress = [event.progress for event in events if event.HasField("progress")]
    with_previews = [(p.step, p.partial_image_index) for p in progress if p.previews]
    assert with_previews == [(1, 0), (2, 1), (3, 2)]
    for event in progress:
        assert [(image.seed, image.mime_type, image.width) for image in event.previews] in (
            [], [(3, "image/png", 8), (4, "image/png", 8)])
        for image in event.previews:
            decoded(image.data, 8)
    assert events[-1].done.images[0].mime_type == "application/octet-stream"


@pytest.mark.process
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_partial_images_refused_naming_the_field(stub, method):
    """Over 3 on a stream; any on a unary Generate, which has no progress events to carry them."""
    count, field, words = (4, "request.partial_images", "must be 0 to 3") if method == "GenerateStream" else (
        1, "partial_images", "GenerateStream")
    request = worker_pb2.GenerateRequest(prompt="a red fox", num_inference_steps=2, partial_images=count)
    with pytest.raises(grpc.RpcError) as caught:
        if method == "Generate":
            stub.Generate(request, timeout=60)
        else:
            list(stub.GenerateStream(worker_pb2.GenerateStreamRequest(request=request), timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details() and words in caught.value.details(), caught.value.details()


@pytest.mark.process
def test_cli_writes_previews_into_the_directory(pair, tmp_path):
    previews = tmp_path / "previews"
    done = subprocess.run(cli_command("--target", pair.worker.target, "generate", "a red fox", "-o",
                                      str(tmp_path / "fox.png"), "--width", "64", "--height", "64", "--steps",
                                      str(STEPS), "--previews", str(previews), "--partial-images", "2"),
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in previews.iterdir()) == ["fox-partial0.png", "fox-partial1.png"]
    for path in previews.iterdir():
        decoded(path.read_bytes(), 8)
    decoded((tmp_path / "fox.png").read_bytes(), 64)


# -- in process ---------------------------------------------------------------------------------------

@pytest.mark.unit
def test_preview_steps_are_evenly_spaced_and_never_the_last():
    from runner_service.previews import preview_steps

    assert preview_steps(4, 2) == (1, 3)
    assert preview_steps(4, 3) == (1, 2, 3)
    assert preview_steps(30, 2) == (10, 20)
    assert preview_steps(2, 3) == (1,)  # too short to space three: fewer
    assert preview_steps(1, 3) == ()


@pytest.mark.unit
def test_a_preview_map_applies_to_its_channels_only():
    import torch

    from runner_service.families import FAMILIES

    sd = FAMILIES["sd"].preview
    assert sd is not None
    latents = torch.zeros(2, 4, 3, 5)
    latents[:, 0] = 1.0  # channel 0 alone: its row of factors
    pixels = sd.pixels(latents)
    assert pixels is not None and pixels.shape == (2, 3, 5, 3) and pixels.dtype == np.uint8
    assert tuple(pixels[0, 0, 0]) == tuple(round((1 + f) * 127.5) for f in sd.factors[0])
    assert sd.pixels(torch.zeros(1, 16, 3, 5)) is None  # another VAE's latents: no preview


@pytest.fixture(scope="module")
def tiny(cpu_platform):
    from runner_service.loaded_model import check_source, load_model
    from runner_service.model_roots import ModelRoots
    from runner_service.model_sources import HubCache

    return load_model(check_source("tiny", None, ModelRoots(), HubCache()), None, cpu_platform)


@pytest.mark.process
def test_a_request_level_batch_takes_previews_at_its_steps(tiny):
    """The pipeline-call path (``--batching request``, and families without a step loop): each
    image's previews come with the progress of their step; another item of the batch asked none."""
    from runner_service.execution import run_batch
    from tests.runner_calls import item

    seen = []
    run_batch(tiny, [item(seed=1, steps=STEPS, partial_images=3, num_images=2), item(seed=9, steps=STEPS)],
              seen.append, threading.Event())
    taken = [[(p.request_id, p.image_index, p.partial_image_index, p.pixels.shape) for p in event.previews]
             for event in seen]
    assert taken == [[("req-1", image, index, (8, 8, 3)) for image in (0, 1)] for index in range(3)] + [[]]


@pytest.mark.process
def test_flux_latents_are_unpacked_for_their_preview(family_pipeline):
    """Flux packs its latents in 2x2 patches inside its call: the adapter hands previews the image's
    latent grid, n x C x h x w, as the pipeline's own unpacking gives it."""
    import torch

    from runner_service.pipeline_adapter import ImageRows, adapt
    from serving_common.generation_params import GenerationParams

    adapter = adapt(family_pipeline("flux"))
    seen = []
    with torch.inference_mode():
        adapter.generate(ImageRows.of("a fox", "", [0]),
                         GenerationParams(width=16, height=24, num_inference_steps=2, guidance_scale=3.5),
                         lambda done, total: None,
                         on_latents=lambda done, total, latents: seen.append((done, total, latents.shape)))
    channels = adapter.pipeline.transformer.config.in_channels // 4
    assert seen == [(1, 2, (1, channels, 24, 16)), (2, 2, (1, channels, 24, 16))]  # VAE x1: the image's grid
    latents = torch.randn(1, channels, 24, 16)
    packed = adapter.pipeline._pack_latents(latents, 1, channels, 24, 16)
    assert torch.equal(adapter.unpacked_latents(packed, 16, 24), latents)
