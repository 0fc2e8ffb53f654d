"""Generation parameters in every image (issue 36 item 3): A1111's "parameters" text, its quoting
and optional settings; the text in a PNG's text chunk and a JPEG's or WebP's EXIF UserComment, read
back with Pillow; the same values as ``Image.parameters`` from a real worker and runner, over gRPC
and the OpenAI HTTP API; and ``--no-image-parameters`` leaving all three out."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from google.protobuf import json_format
from PIL import Image

from diffusion.v1 import common_pb2, runner_pb2
from diffusion.v1 import worker_pb2 as W
from diffusion.v1.worker_pb2_grpc import WorkerServiceStub as Stub
from harness.processes import ServiceProcess, free_port, start_worker, worker_stub
from serving_common.generation_params import Control, ImagePrompt
from worker_service.encoding import encode_image
from worker_service.image_parameters import ImageParameters, sampler_name
from worker_service.pixel_encoders import FASTEST, PILLOW, PixelEncoder
from worker_service.validation import NormalizedRequest

ENCODER_SETS = {"fastest": FASTEST, "pillow": PILLOW}
EXIF_FORMATS = {"jpeg": W.OUTPUT_FORMAT_JPEG, "webp": W.OUTPUT_FORMAT_WEBP}
FOX = ImageParameters(prompt="a red fox", negative_prompt="blurry", steps=20, sampler="Euler", cfg_scale=7.0,
                      seed=1234, width=512, height=512, model="tiny")


def float32(value: float) -> float:
    """``value`` as a request's float field holds it."""
    return float(np.float32(value))


def user_comment(data: bytes) -> str | None:
    """The EXIF UserComment of an image as A1111 writes it (``UNICODE\\0`` and UTF-16BE), read with
    Pillow; None without one."""
    with Image.open(io.BytesIO(data)) as image:
        comment = image.getexif().get_ifd(0x8769).get(0x9286)
    if comment is None:
        return None
    assert comment[:8] == b"UNICODE\0"
    return str(comment[8:].decode("utf-16-be"))


def png_text(data: bytes) -> dict[str, str]:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG"
        return dict(image.text)


def raw_image(pixels: np.ndarray) -> runner_pb2.RawImage:
    return runner_pb2.RawImage(pixels=pixels.tobytes(), width=pixels.shape[1], height=pixels.shape[0],
                               channels=1 if pixels.ndim == 2 else pixels.shape[2])


def picture(height: int, width: int, channels: int) -> np.ndarray:
    values = np.random.default_rng(height * width).integers(0, 256, (height, width, channels), np.uint8)
    return values[..., 0] if channels == 1 else values


# The text and the JSON object.

@pytest.mark.unit
def test_the_text_is_a1111s() -> None:
    assert FOX.as_text() == ("a red fox\nNegative prompt: blurry\n"
                             "Steps: 20, Sampler: Euler, CFG scale: 7, Seed: 1234, Size: 512x512, Model: tiny")


@pytest.mark.unit
def test_an_empty_negative_prompt_and_an_unknown_sampler_are_left_out() -> None:
    text = ImageParameters(prompt="a fox", negative_prompt="", steps=4, sampler="", cfg_scale=float32(7.3), seed=9,
                           width=64, height=48, model="tiny").as_text()
    assert text == "a fox\nSteps: 4, CFG scale: 7.3, Seed: 9, Size: 64x48, Model: tiny"


@pytest.mark.unit
def test_adapters_strength_and_true_cfg_where_used() -> None:
    described = ImageParameters(prompt="a fox", negative_prompt="", steps=4, sampler="Euler", cfg_scale=3.5,
                                seed=2**64 - 1, width=64, height=64, model="tiny-flux",
                                adapters=(("style", float32(0.8)), ("ink", 1.0)), strength=float32(0.75),
                                true_cfg_scale=4.0)
    assert described.as_text() == (
        "a fox <lora:style:0.8> <lora:ink:1>\nSteps: 4, Sampler: Euler, CFG scale: 3.5, "
        f"Seed: {2**64 - 1}, Size: 64x64, Model: tiny-flux, Denoising strength: 0.75, True CFG scale: 4")
    assert described.as_json() == {
        "prompt": "a fox", "negative_prompt": "", "steps": 4, "sampler": "Euler", "cfg_scale": 3.5,
        "seed": str(2**64 - 1), "width": 64, "height": 64, "model": "tiny-flux",
        "adapters": [{"name": "style", "scale": 0.8}, {"name": "ink", "scale": 1.0}], "strength": 0.75,
        "true_cfg_scale": 4.0}


@pytest.mark.unit
def test_controls_and_an_image_prompt_are_named_with_their_numbers_never_their_images() -> None:
    model = common_pb2.ModelInfo(source="tiny", scheduler="DDIMScheduler")
    request = NormalizedRequest(
        request_id="r", prompt="a fox", width=64, height=64, num_inference_steps=4, guidance_scale=7.0, seed=5,
        output_format=W.OUTPUT_FORMAT_PNG, controls=(Control("edges", float32(0.8), 0.0, 0.5),
                                                     Control("depth", 1.0, float32(0.2), 1.0)),
        ip_adapter=ImagePrompt("look", float32(0.6), images=2),
        control_images=(raw_image(picture(64, 64, 3)),) * 2, prompt_images=(raw_image(picture(8, 8, 3)),) * 2)
    described = ImageParameters.of(request, model, seed=5)
    assert described.as_text() == (
        "a fox\nSteps: 4, Sampler: DDIM, CFG scale: 7, Seed: 5, Size: 64x64, Model: tiny, "
        'ControlNet 0: "Model: edges, Weight: 0.8, Guidance Start: 0, Guidance End: 0.5", '
        'ControlNet 1: "Model: depth, Weight: 1, Guidance Start: 0.2, Guidance End: 1", '
        'IP-Adapter: "Model: look, Weight: 0.6, Images: 2"')
    assert described.as_json() == {
        "prompt": "a fox", "negative_prompt": "", "steps": 4, "sampler": "DDIM", "cfg_scale": 7.0, "seed": "5",
        "width": 64, "height": 64, "model": "tiny",
        "controls": [{"name": "edges", "conditioning_scale": 0.8, "guidance_start": 0.0, "guidance_end": 0.5},
                     {"name": "depth", "conditioning_scale": 1.0, "guidance_start": 0.2, "guidance_end": 1.0}],
        "ip_adapter": {"name": "look", "scale": 0.6, "images": 2}}
    assert "controls" not in FOX.as_json() and "ControlNet" not in FOX.as_text()


@pytest.mark.unit
def test_a_value_with_a_comma_colon_or_newline_is_quoted_as_a1111_does() -> None:
    described = ImageParameters(prompt="a fox, at night", negative_prompt="", steps=1, sampler="", cfg_scale=1,
                                seed=1, width=8, height=8, model='/models/sd:1,5 "base"')
    assert described.as_text().splitlines() == [
        "a fox, at night", 'Steps: 1, CFG scale: 1, Seed: 1, Size: 8x8, Model: "/models/sd:1,5 \\"base\\""']


@pytest.mark.unit
def test_a_request_and_its_model_give_the_parameters() -> None:
    model = common_pb2.ModelInfo(source="tiny", scheduler="EulerAncestralDiscreteScheduler")
    request = NormalizedRequest(request_id="r", prompt="a fox", negative_prompt="dull", width=64, height=32,
                                num_inference_steps=6, guidance_scale=float32(7.5), seed=10, num_images=2,
                                output_format=W.OUTPUT_FORMAT_PNG, adapters=(("style", 0.5),),
                                task=common_pb2.TASK_IMAGE_TO_IMAGE, strength=float32(0.6))
    assert ImageParameters.of(request, model, seed=11) == ImageParameters(
        prompt="a fox", negative_prompt="dull", steps=6, sampler="Euler a", cfg_scale=7.5, seed=11, width=64,
        height=32, model="tiny", adapters=(("style", 0.5),), strength=float32(0.6))
    text_to_image = ImageParameters.of(NormalizedRequest(
        request_id="r", prompt="a fox", negative_prompt="", width=64, height=64, num_inference_steps=6,
        guidance_scale=7.5, seed=10, num_images=1, output_format=W.OUTPUT_FORMAT_PNG, strength=0.0), None, seed=10)
    assert text_to_image.strength is None and text_to_image.model == "" and text_to_image.sampler == ""


@pytest.mark.unit
@pytest.mark.parametrize("scheduler, sampler", [("EulerDiscreteScheduler", "Euler"),
                                                ("DPMSolverMultistepScheduler", "DPM++ 2M"),
                                                ("FlowMatchEulerDiscreteScheduler", "Euler"),
                                                ("TCDScheduler", "TCDScheduler")])
def test_the_sampler_is_a1111s_name_of_the_scheduler_else_its_class(scheduler: str, sampler: str) -> None:
    assert sampler_name(common_pb2.ModelInfo(scheduler=scheduler)) == sampler
    assert sampler_name(common_pb2.ModelInfo()) == ""


# The text in the files.

@pytest.mark.unit
@pytest.mark.parametrize("encoders", ENCODER_SETS.values(), ids=ENCODER_SETS.keys())
@pytest.mark.parametrize("text", ["a fox\nSteps: 4, Seed: 1", "un renard, été\nSteps: 4", "狐 🦊\nSteps: 4"],
                         ids=["ascii", "latin-1", "unicode"])
@pytest.mark.parametrize("channels", [3, 1])
def test_a_png_holds_the_text_and_the_same_pixels(encoders: dict[int, PixelEncoder], text: str,
                                                   channels: int) -> None:
    pixels = picture(37, 53, channels)
    data = encode_image(raw_image(pixels), W.OUTPUT_FORMAT_PNG, encoders, parameters=text)
    assert png_text(data) == {"parameters": text}
    with Image.open(io.BytesIO(data)) as image:
        np.testing.assert_array_equal(np.asarray(image), pixels)


@pytest.mark.unit
def test_a_nul_of_the_text_is_written_as_a_replacement_character_in_a_png() -> None:
    """A PNG text chunk separates its keyword from its text by a NUL and may hold no other."""
    data = encode_image(raw_image(picture(8, 8, 3)), W.OUTPUT_FORMAT_PNG, parameters="a\0fox\nSteps: 4")
    length = int.from_bytes(data[33:37], "big")
    assert data[37:41] == b"iTXt" and data[41:41 + length].count(b"\0") == 5  # the keyword's and iTXt's 4 fields
    assert png_text(data) == {"parameters": "a\ufffdfox\nSteps: 4"}


@pytest.mark.unit
@pytest.mark.parametrize("output_format", EXIF_FORMATS.values(), ids=EXIF_FORMATS.keys())
@pytest.mark.parametrize("channels", [3, 1])
def test_jpeg_and_webp_hold_the_text_as_exif_user_comment(output_format: int, channels: int) -> None:
    pixels = picture(37, 53, channels)
    text = "狐 🦊, a fox\nNegative prompt: dull\nSteps: 4, Seed: 1"
    data = encode_image(raw_image(pixels), output_format, parameters=text)
    assert user_comment(data) == text
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (53, 37)
        if output_format == W.OUTPUT_FORMAT_WEBP:  # still lossless
            np.testing.assert_array_equal(np.asarray(image.convert("L" if channels == 1 else "RGB")), pixels)


@pytest.mark.unit
def test_a_text_too_long_for_a_jpeg_segment_is_left_out_of_the_jpeg() -> None:
    raw = raw_image(picture(16, 16, 3))
    data = encode_image(raw, W.OUTPUT_FORMAT_JPEG, parameters="fox " * 8200)  # 65,600 bytes in UTF-16
    assert data == encode_image(raw, W.OUTPUT_FORMAT_JPEG) and user_comment(data) is None


# Served by a real worker and runner.

@pytest.fixture(scope="module")
def workers(real_runner: ServiceProcess,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServiceProcess]]:
    """Two workers serving tiny on the session's runner, with the OpenAI API: ``on`` with the
    default flags, ``off`` with --no-image-parameters."""
    started: dict[str, ServiceProcess] = {}
    try:
        for name, flags in (("on", ()), ("off", ("--no-image-parameters",))):
            port = free_port()
            started[name] = start_worker(tmp_path_factory.mktemp(f"parameters-{name}"), real_runner.target,
                                         "--model", "tiny", "--http-port", str(port), *flags)
            started[name].extra["base_url"] = f"http://127.0.0.1:{port}/v1"
        yield started
    finally:
        for worker in started.values():
            worker.stop()


@pytest.fixture(scope="module")
def on(workers: dict[str, ServiceProcess]) -> Iterator[Stub]:
    with worker_stub(workers["on"].target) as stub:
        yield stub


@pytest.fixture(scope="module")
def off(workers: dict[str, ServiceProcess]) -> Iterator[Stub]:
    with worker_stub(workers["off"].target) as stub:
        yield stub


def generate(stub: Stub, **fields: object) -> W.GenerateResponse:
    fields = {"prompt": "a red fox", "negative_prompt": "blurry", "num_inference_steps": 2, "width": 64,
              "height": 64, "guidance_scale": 5.5, "seed": 7, **fields}
    response: W.GenerateResponse = stub.Generate(W.GenerateRequest(**fields), timeout=60)
    return response


def fox(seed: int, **settings: object) -> tuple[str, dict[str, object]]:
    """The text and the object of the fox ``generate`` makes by default on tiny, image-to-image with
    a ``strength`` setting."""
    text = (f"a red fox\nNegative prompt: blurry\nSteps: 2, Sampler: DDIM, CFG scale: 5.5, Seed: {seed}, "
            "Size: 64x64, Model: tiny")  # tiny's scheduler is a DDIMScheduler
    expected: dict[str, object] = {"prompt": "a red fox", "negative_prompt": "blurry", "steps": 2.0, "sampler": "DDIM",
                                   "cfg_scale": 5.5, "seed": str(seed), "width": 64.0, "height": 64.0, "model": "tiny"}
    if "strength" in settings:
        text += f", Denoising strength: {settings['strength']}"
        expected["strength"] = settings["strength"]
    return text, expected


@pytest.mark.process
def test_each_png_holds_its_parameters_and_the_response_the_same_object(on: Stub) -> None:
    response = generate(on, num_images=2)
    for image, seed in zip(response.images, (7, 8), strict=True):
        text, expected = fox(seed)
        assert png_text(image.data) == {"parameters": text}
        assert json_format.MessageToDict(image.parameters) == expected


@pytest.mark.process
@pytest.mark.parametrize("output_format", EXIF_FORMATS.values(), ids=EXIF_FORMATS.keys())
def test_jpeg_and_webp_hold_them_as_exif_user_comment(on: Stub, output_format: int) -> None:
    image = generate(on, output_format=output_format).images[0]
    text, expected = fox(7)
    assert user_comment(image.data) == text
    assert json_format.MessageToDict(image.parameters) == expected


@pytest.mark.process
def test_raw_pixels_come_with_the_object(on: Stub) -> None:
    image = generate(on, output_format=W.OUTPUT_FORMAT_RAW).images[0]
    assert len(image.data) == 64 * 64 * 3
    assert json_format.MessageToDict(image.parameters) == fox(7)[1]


@pytest.mark.process
def test_image_to_image_writes_its_strength(on: Stub) -> None:
    source = io.BytesIO()
    Image.fromarray(picture(64, 64, 3)).save(source, "PNG")
    image = generate(on, image=source.getvalue(), strength=0.5).images[0]
    text, expected = fox(7, strength=0.5)
    assert png_text(image.data) == {"parameters": text}
    assert json_format.MessageToDict(image.parameters) == expected


def http_png(worker: ServiceProcess) -> bytes:
    client = openai.OpenAI(base_url=worker.extra["base_url"], api_key="unused", max_retries=0, timeout=60)
    result = client.images.generate(prompt="a red fox", size="64x64",  # type: ignore[arg-type]
                                    extra_body={"negative_prompt": "blurry", "seed": 7, "num_inference_steps": 2,
                                                "guidance_scale": 5.5})
    assert result.data is not None and result.data[0].b64_json is not None
    return base64.b64decode(result.data[0].b64_json)


@pytest.mark.process
def test_the_http_api_images_hold_them(workers: dict[str, ServiceProcess]) -> None:
    assert png_text(http_png(workers["on"])) == {"parameters": fox(7)[0]}


@pytest.mark.process
def test_no_image_parameters_leaves_them_out_of_files_and_responses(off: Stub,
                                                                    workers: dict[str, ServiceProcess]) -> None:
    png = generate(off).images[0]
    assert png_text(png.data) == {} and not png.HasField("parameters")
    for output_format in EXIF_FORMATS.values():
        image = generate(off, output_format=output_format).images[0]
        assert user_comment(image.data) is None and not image.HasField("parameters")
    assert png_text(http_png(workers["off"])) == {}
