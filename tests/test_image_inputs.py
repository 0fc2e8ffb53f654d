"""Image inputs through a real worker and runner: image-to-image, inpainting, an edit family, and
bad inputs refused by field with the service going on.

The runner serves ``faithful``: the built-in ``tiny`` SD 1.x with its VAE's posterior made
deterministic and its latents scaled to unit variance. A random VAE's posterior is wide (its
sampling noise, not the input, decides the image), so with the stock ``tiny`` no strength could
stay near its input; with these two config-level changes a small strength stays near what the VAE
makes of the input, as with a trained model. The reference images come from diffusers' own
pipelines on the same saved model, in this process.
"""

from __future__ import annotations

import io
import re
import struct
import threading
import zlib

import grpc
import numpy as np
import pytest
import torch
from diffusers import AutoPipelineForImage2Image, DiffusionPipeline
from PIL import Image

import support
from clients import DiffusionClient
from diffusion.v1 import common_pb2, worker_pb2
from harness.streams import Stream
from runner_service.models.catalog import build_family, ensure_builtin
from runner_service.pipeline_adapter import ImageInputs, ImageRows, adapt
from serving_common.errors import field_violations
from serving_common.generation_params import GenerationParams
from serving_common.protocol import image_seed
from support import cli, pixels

W = worker_pb2
SIZE = 64
MAX_SIZE = 256
pytestmark = [pytest.mark.timeout(300), pytest.mark.process]
BATCH_LINE = re.compile(r"batch of \d+ request\(s\) \(\d+ image\(s\)\) on runner (\S+): (.*)$", re.M)


def encoded(pixels: np.ndarray, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, image_format)
    return buffer.getvalue()


def smooth(seed: int, size: int = SIZE) -> np.ndarray:
    """A smooth random RGB picture: 4x4 random colours, scaled up."""
    colours = np.random.RandomState(seed).randint(0, 255, (4, 4, 3)).astype(np.uint8)
    return np.asarray(Image.fromarray(colours).resize((size, size), Image.Resampling.BICUBIC))


def distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(float) - b.astype(float)).mean() / 255)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-models")
    pipeline = DiffusionPipeline.from_pretrained(ensure_builtin("tiny", root / "cache"))
    vae = pipeline.vae
    with torch.no_grad():
        channels = vae.config.latent_channels
        vae.quant_conv.weight[channels:] = 0  # the log-variance half: a posterior of width e^-15
        vae.quant_conv.bias[channels:] = -30
        latents = vae.encode(torch.rand(1, 3, SIZE, SIZE) * 2 - 1).latent_dist.mode()
    vae.register_to_config(scaling_factor=float(1 / latents.std()))
    pipeline.save_pretrained(root / "faithful")
    build_family("instruct-pix2pix", root / "instruct-pix2pix")
    return root


@pytest.fixture(scope="module")
def reference(model_root):
    pipeline = DiffusionPipeline.from_pretrained(model_root / "faithful")
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def pair(serve, model_root):
    return serve("--model", str(model_root / "faithful"), "--max-size", str(MAX_SIZE), "--max-batch-size", "4",
                 "--max-batch-delay-ms", "300", runner_args=("--model-root", str(model_root)))


def request(**fields) -> W.GenerateRequest:
    """A 10-step "a red fox" (seed 3); ``fields`` replace any of it."""
    return support.request(**{"prompt": "a red fox", "num_inference_steps": 10, "seed": 3, **fields})


def test_the_model_reports_the_tasks_it_serves(stub):
    tasks = stub.GetStatus(W.GetStatusRequest(), timeout=10).model.capabilities.tasks
    assert list(tasks) == [common_pb2.TASK_TEXT_TO_IMAGE, common_pb2.TASK_IMAGE_TO_IMAGE, common_pb2.TASK_INPAINT]


def test_image_to_image_at_a_small_strength_stays_near_its_input(stub, reference):
    picture, other = smooth(1), smooth(2)
    near = pixels(stub.Generate(request(image=encoded(picture), strength=0.1), timeout=60))
    far = pixels(stub.Generate(request(image=encoded(picture), strength=1.0), timeout=60))
    with torch.no_grad():
        sample = torch.tensor(picture / 127.5 - 1, dtype=torch.float32).permute(2, 0, 1)[None]
        decoded = reference.vae.decode(reference.vae.encode(sample).latent_dist.mode()).sample
    round_trip = ((decoded[0].permute(1, 2, 0).numpy() + 1) * 127.5).round().clip(0, 255)
    other_near = pixels(stub.Generate(request(image=encoded(other), strength=0.1), timeout=60))
    assert near.shape == (SIZE, SIZE, 3)
    # Near what the VAE makes of its input; a strength of 1 (or another input) is far from it.
    assert distance(near, round_trip) < 0.05
    assert distance(far, round_trip) > 2 * distance(near, round_trip)
    assert distance(other_near, round_trip) > 2 * distance(near, round_trip)


def test_image_to_image_is_diffusers_own_and_deterministic_for_a_seed(stub, reference):
    picture = smooth(5)
    served = stub.Generate(request(image=encoded(picture, "JPEG"), strength=0.5, seed=11, num_images=2), timeout=60)
    again = stub.Generate(request(image=encoded(picture, "JPEG"), strength=0.5, seed=11, num_images=2), timeout=60)
    assert [image.data for image in served.images] == [image.data for image in again.images]
    assert served.images[0].data != served.images[1].data  # per-image seeds
    sent = Image.open(io.BytesIO(encoded(picture, "JPEG"))).convert("RGB")
    own = AutoPipelineForImage2Image.from_pipe(reference)(
        ["a red fox"] * 2, image=[sent] * 2, strength=0.5, num_inference_steps=10, guidance_scale=7.5,
        negative_prompt=[""] * 2, generator=[torch.Generator("cpu").manual_seed(image_seed(11, i)) for i in range(2)],
        output_type="np").images
    for index in range(2):
        expected = (own[index] * 255).round().clip(0, 255)
        assert np.abs(pixels(served, index).astype(float) - expected).max() <= 1


def test_progress_reports_the_steps_a_strength_runs(stub):
    stream = Stream(stub, request(image=encoded(smooth(1)), strength=0.3, num_inference_steps=10))
    events = stream.finish()
    progress = [event.progress for event in events if event.HasField("progress")]
    assert [(p.step, p.total_steps) for p in progress] == [(1, 3), (2, 3), (3, 3)]


def test_inpainting_keeps_the_unmasked_pixels(stub):
    picture = smooth(7)
    mask = np.zeros((SIZE, SIZE), dtype=np.uint8)
    mask[:, SIZE // 2:] = 255  # repaint the right half
    response = stub.Generate(request(image=encoded(picture), mask_image=encoded(mask), strength=1.0), timeout=60)
    painted = pixels(response)
    assert np.array_equal(painted[:, : SIZE // 2], picture[:, : SIZE // 2])
    assert distance(painted[:, SIZE // 2:], picture[:, SIZE // 2:]) > 0.02
    explicit = stub.Generate(request(image=encoded(picture), mask_image=encoded(mask), strength=1.0,
                                     task=common_pb2.TASK_INPAINT), timeout=60)
    assert explicit.images[0].data == response.images[0].data


def test_an_image_of_another_size_is_fitted_only_when_asked(stub):
    wide = encoded(smooth(3, size=96)[:48])  # 96 x 48
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(request(image=wide, width=SIZE, height=SIZE), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "image" in field_violations(error.value)
    as_given = stub.Generate(request(image=wide, strength=0.5), timeout=60)  # unset size: the image's
    assert (as_given.images[0].width, as_given.images[0].height) == (96, 48)
    for mode in (W.RESIZE_MODE_RESIZE, W.RESIZE_MODE_CROP):
        fitted = stub.Generate(request(image=wide, width=SIZE, height=SIZE, resize_mode=mode), timeout=60)
        assert (fitted.images[0].width, fitted.images[0].height) == (SIZE, SIZE)


def bomb() -> bytes:
    """A PNG whose header claims 100000 x 100000 pixels (a few hundred bytes)."""
    small = encoded(np.zeros((8, 8, 3), dtype=np.uint8))
    header = struct.pack(">IIBBBBB", 100000, 100000, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + header
    ihdr = struct.pack(">I", len(header)) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return small[:8] + ihdr + small[8 + 25:]


BAD = [
    ({"image": b"not an image"}, "image", "not a PNG"),
    ({"image": encoded(smooth(1), "GIF")}, "image", "not a PNG"),
    ({"image": encoded(smooth(1))[:200]}, "image", "does not decode"),
    ({"image": encoded(smooth(1, size=MAX_SIZE + 8))}, "image", "--max-size"),
    ({"image": bomb()}, "image", "--max-size"),
    ({"image": encoded(smooth(1)), "mask_image": encoded(np.zeros((32, 32), dtype=np.uint8))}, "mask_image",
     "the image is"),
    ({"image": encoded(smooth(1)), "strength": 0.0}, "strength", "(0, 1]"),
    ({"image": encoded(smooth(1)), "strength": 1.5}, "strength", "(0, 1]"),
    ({"image": encoded(smooth(1)), "strength": 0.05}, "strength", "runs none"),
    ({"strength": 0.5}, "strength", "takes no strength"),
    ({"mask_image": encoded(np.zeros((SIZE, SIZE), dtype=np.uint8))}, "image", "needs an image"),
    ({"task": common_pb2.TASK_IMAGE_TO_IMAGE}, "image", "needs an image"),
    ({"task": common_pb2.TASK_EDIT, "image": encoded(smooth(1))}, "task", "serves"),
    ({"image": encoded(smooth(1)), "resize_mode": 7}, "resize_mode", "unknown"),
]


@pytest.mark.parametrize(("fields", "field", "says"), BAD, ids=[f"{b[1]}-{b[2]}" for b in BAD])
def test_bad_inputs_are_invalid_argument_naming_the_field(stub, fields, field, says):
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(request(**fields), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = field_violations(error.value)
    assert field in violations and says in violations[field], violations


def test_the_service_goes_on_after_bad_inputs(stub):
    for fields, _, _ in BAD[:5]:
        with pytest.raises(grpc.RpcError):
            stub.Generate(request(**fields), timeout=30)
    assert len(stub.Generate(request(num_inference_steps=2), timeout=60).images) == 1
    status = stub.GetStatus(W.GetStatusRequest(), timeout=10)
    assert status.state == W.WORKER_STATE_READY and status.queue_depth == 0


def test_image_requests_join_the_step_batch_and_keep_their_seeds(pair, stub):
    """The model steps image-to-image (ModelCapabilities.step_batching_tasks): the worker sends each
    request its own Execute, without waiting to fill a batch, and the runner steps them together."""
    pictures = [smooth(20 + i) for i in range(3)]
    alone = [pixels(stub.Generate(request(image=encoded(p), strength=0.5, seed=30 + i), timeout=60))
             for i, p in enumerate(pictures)]
    results: dict[int, np.ndarray] = {}

    def call(index: int) -> None:
        response = stub.Generate(request(image=encoded(pictures[index]), strength=0.5, seed=30 + index,
                                         request_id=f"together-{index}"), timeout=60)
        results[index] = pixels(response)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(3):  # as with text-to-image batches: within 2 levels of the image alone
        assert np.abs(results[index].astype(int) - alone[index]).max() <= 2
    assert common_pb2.TASK_IMAGE_TO_IMAGE in stub.GetStatus(W.GetStatusRequest(), timeout=10).model.capabilities \
        .step_batching_tasks
    batches = [m.group(2).split() for m in BATCH_LINE.finditer(pair.worker.log())]
    together = sorted(batch for batch in batches if batch[0].startswith("together"))
    assert together == [[f"together-{i}"] for i in range(3)]


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_deriving_image_pipelines_shares_the_modules_and_no_memory(model_root):
    pipeline = DiffusionPipeline.from_pretrained(ensure_builtin("small", model_root / "cache"))
    modules = {name: m for name, m in pipeline.components.items() if isinstance(m, torch.nn.Module)}
    storage = {t.data_ptr() for m in modules.values() for t in [*m.parameters(), *m.buffers()]}
    weights = sum(t.numel() * t.element_size() for m in modules.values() for t in m.parameters())
    adapter = adapt(pipeline)
    before = resident_bytes()
    derived = [adapter.for_task(task).pipeline for task in ("IMAGE_TO_IMAGE", "INPAINT")]
    grown = resident_bytes() - before
    print(f"deriving image-to-image and inpainting from {weights / 2**20:.0f} MiB of weights: "
          f"resident memory {grown / 2**20:+.1f} MiB")
    assert grown < 0.05 * weights  # no second copy: a copy would add 100%
    for pipe in derived:
        assert type(pipe).__name__ != type(pipeline).__name__
        for name, module in pipe.components.items():
            if isinstance(module, torch.nn.Module):
                assert module is modules[name], name
                assert {t.data_ptr() for t in [*module.parameters(), *module.buffers()]} <= storage


@pytest.fixture
def edit_stub(stub, model_root):
    """The module's worker serving the instruct-pix2pix build for the test, then ``faithful`` again."""
    stub.Init(W.InitRequest(model=str(model_root / "instruct-pix2pix")), timeout=120)
    yield stub
    stub.Init(W.InitRequest(model=str(model_root / "faithful")), timeout=120)


def test_an_edit_model_serves_image_and_instruction_and_needs_the_image(edit_stub, model_root):
    model = edit_stub.GetStatus(W.GetStatusRequest(), timeout=10).model
    assert model.pipeline_class == "StableDiffusionInstructPix2PixPipeline"
    assert list(model.capabilities.tasks) == [common_pb2.TASK_EDIT]
    with pytest.raises(grpc.RpcError) as error:
        edit_stub.Generate(request(prompt="make it snowy", num_inference_steps=2), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "image" in field_violations(error.value)
    picture = encoded(smooth(9, size=32))
    stream = Stream(edit_stub, request(prompt="make it snowy", image=picture, num_inference_steps=3))
    events = stream.finish()
    assert [event.progress.step for event in events if event.HasField("progress")] == [1, 2, 3]
    edited = stream.done
    assert edited is not None and (edited.images[0].width, edited.images[0].height) == (32, 32)
    assert model.capabilities.step_batching and list(model.capabilities.step_batching_tasks) == [common_pb2.TASK_EDIT]
    pipeline = DiffusionPipeline.from_pretrained(model_root / "instruct-pix2pix")
    pipeline.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        own = adapt(pipeline).generate(ImageRows.of("make it snowy", "", [image_seed(3, 0)]),
                                       GenerationParams(width=32, height=32, num_inference_steps=3, guidance_scale=7.5),
                                       lambda done, total: None, ImageInputs([Image.fromarray(smooth(9, size=32))]))[0]
    own = (own.float().numpy() * 255).round().clip(0, 255).astype(np.uint8)
    assert int(np.abs(pixels(edited).astype(int) - own.astype(int)).max()) <= 1
    again = edit_stub.Generate(request(prompt="make it snowy", image=picture, num_inference_steps=3), timeout=60)
    assert again.images[0].data == edited.images[0].data
    other = edit_stub.Generate(request(prompt="make it snowy", image=encoded(smooth(10, size=32)),
                                       num_inference_steps=3), timeout=60)
    assert other.images[0].data != edited.images[0].data
    with pytest.raises(grpc.RpcError) as error:
        edit_stub.Generate(request(prompt="x", image=picture, strength=0.5), timeout=30)
    assert "strength" in field_violations(error.value)


def test_the_python_client_takes_bytes_a_path_a_pil_image_or_an_array(pair, tmp_path):
    picture = smooth(12)
    path = tmp_path / "in.png"
    path.write_bytes(encoded(picture))
    mask = np.zeros((SIZE, SIZE), dtype=np.uint8)
    mask[SIZE // 2:] = 255
    with DiffusionClient(pair.worker.target) as client:
        results = [client.generate("a red fox", image=image, mask=mask, strength=0.5, steps=4, seed=2,
                                   output_format="raw").images[0].data
                   for image in (encoded(picture), path, str(path), Image.fromarray(picture), picture)]
        assert len(set(results)) == 1
        with pytest.raises(ValueError, match="unknown resize mode"):
            client.generate("a red fox", image=path, resize_mode="stretch")


def test_the_cli_generates_from_an_image(pair, tmp_path):
    source = tmp_path / "fox.png"
    source.write_bytes(encoded(smooth(13)))
    output = tmp_path / "snowy.png"
    done = cli("--target", pair.worker.target, "generate", "a red fox in the snow", "-o", str(output), "--image",
               str(source), "--strength", "0.6", "--steps", "5")
    assert done.returncode == 0, done.stderr
    assert Image.open(output).size == (SIZE, SIZE)
    missing = cli("--target", pair.worker.target, "generate", "x", "-o", str(output), "--image",
                  str(tmp_path / "none.png"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


# The bounded worker (the session's serial pair): one request runs, two queue, and image inputs
# hold fixtures_runner.SERIAL_INPUT_BYTES (250 kB) in all.
UNIT = 100_000  # bytes of each image input sent to it: two fit, a third does not
LONG = 500  # steps of a request held in flight (cancelled once it has served its purpose)


def padded(png: bytes, size: int) -> bytes:
    """``png`` grown to ``size`` bytes by a private ancillary chunk after its header (decoders skip it)."""
    extra = size - len(png) - 12
    data = b"prVt" + bytes(extra)
    chunk = struct.pack(">I", extra) + data + struct.pack(">I", zlib.crc32(data))
    return png[:33] + chunk + png[33:]


def undecodable(size: int) -> bytes:
    """A PNG of ``size`` bytes whose header is sound and whose pixels are cut off: only decoding it fails."""
    return padded(encoded(smooth(1))[:200], size)


@pytest.fixture(scope="module")
def bounded(serial_stub):
    return serial_stub


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def held(stub, request_id: str, kind: str, **fields) -> tuple[str, Stream]:
    """A LONG request in flight, once its stream has shown ``kind`` (progress: running; queued)."""
    stream = Stream(stub, request(request_id=request_id, num_inference_steps=LONG, **fields))
    stream.wait_for(kind)
    return request_id, stream


def cancel(stub, *requests: tuple[str, Stream]) -> None:
    for request_id, stream in requests:
        stub.Cancel(W.CancelRequest(request_id=request_id), timeout=10)
        stream.finish()
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED


def test_a_full_queue_refuses_an_image_before_decoding_it(bounded):
    streams = [held(bounded, "full-running", "progress"), held(bounded, "full-queued-1", "queued"),
               held(bounded, "full-queued-2", "queued")]
    broken = request(image=undecodable(UNIT), strength=0.5)
    refused = refusal(lambda: bounded.Generate(broken, timeout=30))
    # Decoded, it would be INVALID_ARGUMENT: refused first, nothing was decoded.
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in refused.details()
    cancel(bounded, *streams)
    again = refusal(lambda: bounded.Generate(broken, timeout=30))  # with room, it is decoded and named
    assert again.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode" in field_violations(again)["image"]


def test_image_inputs_are_bounded_in_bytes_and_given_back_on_every_path(bounded):
    alone = refusal(lambda: bounded.Generate(request(image=undecodable(3 * UNIT), strength=0.5), timeout=30))
    assert alone.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-input-bytes" in alone.details()
    picture = padded(encoded(smooth(1)), UNIT)
    running = held(bounded, "bytes-running", "progress", image=picture, strength=1.0)
    # Requests that fail (bad pixels, a deadline in the queue) give their bytes back: had any of
    # these four kept them, the next request's would not fit.
    for _ in range(3):
        bad = refusal(lambda: bounded.Generate(request(image=undecodable(UNIT), strength=0.5), timeout=30))
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    late = refusal(lambda: bounded.Generate(request(image=picture, strength=1.0, num_inference_steps=2),
                                            timeout=2))  # its own two steps fit: it expires in the queue
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    queued = held(bounded, "bytes-queued", "queued", image=picture, strength=1.0)
    over = refusal(lambda: bounded.Generate(request(image=picture, strength=1.0), timeout=30))
    assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "do not fit" in over.details(), over.details()
    cancel(bounded, queued, running)
    mask = np.zeros((SIZE, SIZE), dtype=np.uint8)
    mask[:, SIZE // 2:] = 255
    # Two inputs' worth fits again only if the cancelled requests gave theirs back too.
    both = bounded.Generate(request(image=picture, mask_image=padded(encoded(mask), UNIT), strength=1.0,
                                    num_inference_steps=2), timeout=60)
    assert len(both.images) == 1
