"""The OpenAI Images API (``--http-port``) through the real ``openai`` SDK, against a real worker and runner.

One worker (``--max-queue 1``, so a full queue is easy to make) serves every test but the token
one, which starts a second worker, with TLS and an inference token, on the same runner (it finds
the model already loaded).
Requests are tiny: 64x64, 1 or 2 steps. The "long" requests of the cancellation tests are never
left to finish: their clients go away and the worker cancels them.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from PIL import Image

from certs import self_signed, wait_serving
from diffusion.v1 import worker_pb2
from harness.processes import REPO, free_port, start_service
from worker_service.http.errors import http_status

pytestmark = pytest.mark.process
GENERATIONS = "http:/v1/images/generations"
EDITS = "http:/v1/images/edits"
# Runs for many seconds on CPU: only ever cancelled.
LONG = {"prompt": "a slow fox", "size": "128x128", "num_inference_steps": 500}


@pytest.fixture(scope="module")
def pair(serve, real_runner):
    return serve("--max-queue", "1", "--max-batch-size", "1",  # one runs, one queues
                 on=real_runner, http=True, metrics=True)


def sdk(base_url: str, api_key: str = "unused", **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60, **options)


def pixels(png: bytes, size: tuple[int, int] = (64, 64)) -> bytes:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.size == size
    return image.convert("RGB").tobytes()


def wait_for(condition, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.05)
    raise TimeoutError("condition not met")


def active(stub) -> list[worker_pb2.ActiveRequest]:
    return list(stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).active_requests)


def http_calls(stub, code: str, method: str = GENERATIONS) -> int:
    requests = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).statistics.requests
    return sum(r.count for r in requests if r.method == method and r.code == code)


def test_sdk_images_match_grpc_generate_pixel_for_pixel(pair, stub):
    result = sdk(pair.base_url).images.generate(prompt="a red fox", n=2, size="64x64",
                                                extra_body={"seed": 7, "num_inference_steps": 2})
    assert result.created > 0 and len(result.data) == 2
    assert [image.model_extra["seed"] for image in result.data] == [7, 8]
    grpc_images = stub.Generate(worker_pb2.GenerateRequest(prompt="a red fox", num_images=2, width=64, height=64,
                                                           seed=7, num_inference_steps=2), timeout=60).images
    assert [pixels(base64.b64decode(i.b64_json)) for i in result.data] == [pixels(i.data) for i in grpc_images]
    assert pixels(base64.b64decode(result.data[0].b64_json)) != pixels(base64.b64decode(result.data[1].b64_json))


def test_models_lists_the_loaded_model(pair):
    models = sdk(pair.base_url).models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [("tiny", "model", "diffusion-serving")]
    assert models[0].created > 0


@pytest.mark.parametrize("fields, param", [
    ({"size": "65x64"}, "size"),
    ({"size": "big"}, "size"),
    ({"n": 9}, "n"),
    ({"response_format": "base64"}, "response_format"),
    ({"quality": "ultra"}, "quality"),
    ({"extra_body": {"seed": -1}}, "seed"),
    ({"extra_body": {"num_inference_steps": 100000}}, "num_inference_steps"),
    ({"extra_body": {"foo": 1}}, "foo"),
    ({"background": "transparent"}, "background"),
])
def test_bad_requests_are_400_naming_the_openai_field(pair, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(pair.base_url).images.generate(prompt="a red fox", **fields)
    error = caught.value
    assert error.status_code == 400 and error.body["param"] == param, error.body
    assert error.body["type"] == "invalid_request_error" and error.body["code"] == "invalid_argument"
    if param == "response_format":
        assert "must be one of b64_json, url" in error.body["message"]


def test_ignored_fields_are_accepted(pair):
    result = sdk(pair.base_url).images.generate(prompt="a red fox", size="auto", quality="high", style="natural",
                                                user="someone", response_format="b64_json",
                                                extra_body={"num_inference_steps": 1, "stream": False})
    assert len(result.data) == 1 and pixels(base64.b64decode(result.data[0].b64_json))


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nothing", 404), ("GET", "/v1/images/generations", 405),
                                                  ("POST", "/v1/models", 405),
                                                  ("POST", "/v1/images/generations/", 404)])  # not a 307
def test_unknown_paths_and_wrong_methods_are_openai_errors(pair, method, path, status):
    request = urllib.request.Request(f"http://127.0.0.1:{pair.http_port}{path}", method=method,
                                     data=b"{}" if method == "POST" else None)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == status
    assert set(json.loads(caught.value.read())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param, words", [
    (b"[" * 100_000, None, "nested too deeply"),
    (b'{"prompt": "a fox", "guidance_scale": 1' + b"0" * 400 + b"}", "guidance_scale", "finite number"),
    (b'{"prompt": "a fox", "guidance_scale": NaN}', None, "NaN is not a JSON value"),
    (b'{"prompt": "\\ud800"}', "prompt", "lone surrogate"),
    (b'{"prompt": "a fox", "negative_prompt": "dull\\udfff"}', "negative_prompt", "lone surrogate"),
    (b'{"prompt": "a fox", "model": "tiny\\u0000x"}', "model", "control characters"),
    (b'{"prompt": "a fox", "\\ud800": 1}', "'\\ud800'", "unknown"),
    (b'{"prompt": "a fox", "n": ' + b"[" * 500 + b"]" * 500 + b"}", "n", "got an array"),
])
def test_hostile_bodies_are_400_naming_the_field(pair, body, param, words):
    """Bodies that were answered 500 (RecursionError, OverflowError, UnicodeEncodeError in
    protobuf) or let a control character into a name; the worker serves on after each."""
    request = urllib.request.Request(f"http://127.0.0.1:{pair.http_port}/v1/images/generations", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    error = json.load(caught.value)["error"]
    assert caught.value.code == 400 and error["code"] == "invalid_argument", error
    assert error["param"] == param and words in error["message"], error
    assert sdk(pair.base_url).models.list().data


def test_tokens_follow_the_grpc_policy_over_https(real_runner, tmp_path):
    """With --tls-cert the HTTP port is HTTPS with the same certificate; tokens as for gRPC Generate."""
    cert, key = self_signed(tmp_path, "worker")
    (tmp_path / "inference.token").write_text("openai-secret\n")
    target, port = f"127.0.0.1:{free_port()}", free_port()
    guarded = start_service("worker", "worker_service.main", [
        "--listen", target, "--runner", real_runner.target, "--model", "tiny", "--metrics-port", "0",
        "--http-port", str(port),
        "--tls-cert", str(cert), "--tls-key", str(key), "--inference-token-file", str(tmp_path / "inference.token"),
    ], tmp_path, target)
    try:
        wait_serving(guarded, grpc.ssl_channel_credentials(cert.read_bytes()), "diffusion.v1.WorkerService")

        def client(api_key: str = "unused") -> openai.OpenAI:
            return sdk(f"https://127.0.0.1:{port}/v1", api_key, http_client=openai.DefaultHttpxClient(
                verify=ssl.create_default_context(cafile=str(cert))))

        small = {"prompt": "a red fox", "size": "64x64", "extra_body": {"num_inference_steps": 1}}
        with pytest.raises(openai.AuthenticationError) as missing:
            client().images.generate(**small, extra_headers={"Authorization": openai.omit})
        assert missing.value.status_code == 401 and missing.value.body["code"] == "unauthenticated"
        with pytest.raises(openai.AuthenticationError):
            client().models.list(extra_headers={"Authorization": openai.omit})
        with pytest.raises(openai.PermissionDeniedError) as wrong:
            client("not-the-token").images.generate(**small)
        assert wrong.value.status_code == 403 and wrong.value.body["code"] == "permission_denied"
        allowed = client("openai-secret")
        assert len(allowed.images.generate(**small).data) == 1
        assert [m.id for m in allowed.models.list().data] == ["tiny"]
        with pytest.raises(openai.AuthenticationError):  # edits as Generate
            client().images.edit(image=("fox.png", picture(), "image/png"), prompt="a red fox",
                                 extra_headers={"Authorization": openai.omit})
        https = ssl.create_default_context(cafile=str(cert))
        for path in ("/health", "/metrics"):  # open, as gRPC health and the metrics port are
            with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", timeout=10, context=https) as response:
                assert response.status == 200
        with pytest.raises(OSError):  # no plaintext beside HTTPS (the TLS server hangs up)
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    finally:
        guarded.stop()


def open_raw(port: int, body: dict, request_id: str = "") -> socket.socket:
    """A generation request (under the caller's ``x-request-id``, if given) whose client stays until
    the socket is closed."""
    data = json.dumps(body).encode()
    header = f"x-request-id: {request_id}\r\n".encode() if request_id else b""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"%sContent-Length: %d\r\n\r\n%s" % (header, len(data), data))
    return sock


def answer_head(sock: socket.socket) -> str:
    """The status line and headers of the answer on ``sock``."""
    head = b""
    while b"\r\n\r\n" not in head:
        received = sock.recv(4096)
        assert received, head
        head += received
    return head.split(b"\r\n\r\n")[0].decode().lower()


def test_a_callers_x_request_id_names_its_generation_until_it_ends(pair, stub):
    """A gateway's id is the request's in the worker (its queue, Cancel) and its answer's; another
    request under it while it runs is refused naming the header."""
    running = open_raw(pair.http_port, LONG, request_id="mesh-7f3a")
    try:
        wait_for(lambda: [r for r in active(stub) if r.request_id == "mesh-7f3a" and r.state == "running"])
        with pytest.raises(openai.BadRequestError) as taken:
            sdk(pair.base_url).images.generate(prompt="a fox", size="64x64",
                                               extra_headers={"x-request-id": "mesh-7f3a"})
        assert taken.value.body["param"] == "x-request-id", taken.value.body
        assert "already queued or running" in taken.value.body["message"]
        stub.Cancel(worker_pb2.CancelRequest(request_id="mesh-7f3a"), timeout=10)
        head = answer_head(running)
        assert head.startswith("http/1.1 499") and "x-request-id: mesh-7f3a" in head.splitlines(), head
    finally:
        running.close()
    wait_for(lambda: not active(stub))


def test_full_queue_is_429_and_disconnected_clients_cancel(pair, stub):
    cancelled = http_calls(stub, "CANCELLED")
    running = open_raw(pair.http_port, LONG)
    wait_for(lambda: [r for r in active(stub) if r.state == "running"])
    queued = open_raw(pair.http_port, {**LONG, "size": "136x136"})  # not batched with the running one
    wait_for(lambda: [r for r in active(stub) if r.state == "queued"])
    try:
        with pytest.raises(openai.RateLimitError) as full:
            sdk(pair.base_url).images.generate(prompt="one too many", size="64x64")
        assert full.value.status_code == 429 and full.value.body["code"] == "resource_exhausted"
        assert full.value.response.headers["retry-after"] == "1"
    finally:
        queued.close()
        running.close()
    wait_for(lambda: not active(stub))
    wait_for(lambda: http_calls(stub, "CANCELLED") == cancelled + 2)


def test_sdk_timeout_cancels_its_request(pair, stub):
    cancelled = http_calls(stub, "CANCELLED")
    with pytest.raises(openai.APITimeoutError):
        sdk(pair.base_url).with_options(timeout=1.0).images.generate(prompt=LONG["prompt"], size=LONG["size"],
                                                                     extra_body={"num_inference_steps": 500})
    wait_for(lambda: http_calls(stub, "CANCELLED") == cancelled + 1)
    wait_for(lambda: not active(stub))


def test_request_timeout_header_is_a_deadline(pair, stub):
    """500 steps cannot finish in the header's 0.5 s by the runner's measured costs: refused at once,
    naming the field, not run to be abandoned."""
    with pytest.raises(openai.APIStatusError) as late:
        sdk(pair.base_url).images.generate(prompt=LONG["prompt"], size=LONG["size"],
                                           extra_headers={"X-Request-Timeout": "0.5"},
                                           extra_body={"num_inference_steps": 500})
    assert late.value.status_code == 400 and late.value.body["code"] == "invalid_argument", late.value.body
    assert "s left before the deadline" in str(late.value.body)
    assert not active(stub)


def test_one_mapping_from_grpc_codes_to_http():
    code = grpc.StatusCode
    expected = {code.INVALID_ARGUMENT: 400, code.UNAUTHENTICATED: 401, code.PERMISSION_DENIED: 403,
                code.RESOURCE_EXHAUSTED: 429, code.UNAVAILABLE: 503, code.FAILED_PRECONDITION: 503,
                code.DEADLINE_EXCEEDED: 504, code.INTERNAL: 500, code.UNKNOWN: 500}
    assert {c: http_status(c)[0] for c in expected} == expected


def readme_blocks(language: str, marker: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"^ *```(\w*)\n(.*?)^ *```", text, flags=re.S | re.M)
    return [block for lang, block in blocks if lang == language and marker in block]


def test_readme_curl_and_sdk_examples_run_as_written(pair, stub, tmp_path):
    """The README's curl lines run in bash (``localhost:8000`` becomes this worker), then its SDK example."""
    [shell] = readme_blocks("sh", "localhost:8000")
    lines = [line for line in shell.splitlines() if line.strip()]
    assert lines and all(line.startswith(("curl ", "python3 ")) for line in lines), lines
    script = "set -euo pipefail\n" + shell.replace("localhost:8000", f"127.0.0.1:{pair.http_port}")
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert '"id":"tiny"' in done.stdout and '"param":"size"' in done.stdout
    pixels((tmp_path / "circle.png").read_bytes())

    [python] = readme_blocks("python", "from openai import OpenAI")
    code = python.replace("http://localhost:8000/v1", pair.base_url)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert pixels((tmp_path / "triangle-0.png").read_bytes()) != pixels((tmp_path / "triangle-1.png").read_bytes())


# --- POST /v1/images/edits -------------------------------------------------------------------------------------------


def png(image: Image.Image) -> bytes:
    encoded = io.BytesIO()
    image.save(encoded, "PNG")
    return encoded.getvalue()


def picture(size: int = 64) -> bytes:
    """A smooth RGB picture (noise would make every image-to-image comparison trivially pass)."""
    ramp = bytes(range(0, 256, 256 // size))[:size]
    red = Image.frombytes("L", (size, 1), ramp).resize((size, size))
    return png(Image.merge("RGB", (red, red.rotate(90), Image.new("L", (size, size), 96))))


def openai_mask(size: int = 64) -> bytes:
    """OpenAI's convention: opaque pixels are kept, transparent ones (alpha 0, the right half) repainted."""
    mask = Image.new("RGBA", (size, size), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (size // 2, 0, size, size))
    return png(mask)


def decoded(item) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB")


def test_sdk_edit_inpaints_where_the_mask_is_transparent(pair, stub):
    """The transparent half is repainted, the opaque half is the input's own pixels, and the image is
    the one a gRPC Generate gives with this worker's mask (white: repaint)."""
    image = picture()
    result = sdk(pair.base_url).images.edit(image=("fox.png", image, "image/png"),
                                            mask=("mask.png", openai_mask(), "image/png"), prompt="a red fox",
                                            size="64x64",
                                            extra_body={"seed": 7, "num_inference_steps": 2, "strength": 1.0})
    painted, original = decoded(result.data[0]), Image.open(io.BytesIO(image))
    kept, repainted = (0, 0, 32, 64), (32, 0, 64, 64)
    assert painted.crop(kept).tobytes() == original.crop(kept).tobytes()
    assert painted.crop(repainted).tobytes() != original.crop(repainted).tobytes()
    white_right = Image.new("L", (64, 64))
    white_right.paste(255, repainted)
    grpc_image = stub.Generate(worker_pb2.GenerateRequest(prompt="a red fox", image=image, mask_image=png(white_right),
                                                          seed=7, num_inference_steps=2, strength=1.0), timeout=60)
    assert painted.tobytes() == pixels(grpc_image.images[0].data)


def test_sdk_edit_without_a_mask_is_image_to_image(pair, stub):
    """No size: the image's; n, seed, steps, strength and resize_mode as for gRPC, pixel for pixel."""
    image = picture(72)
    result = sdk(pair.base_url).images.edit(image=("fox.png", image, "image/png"), prompt="a red fox at night", n=2,
                                            extra_body={"seed": 3, "num_inference_steps": 2, "strength": 0.5})
    assert [item.model_extra["seed"] for item in result.data] == [3, 4]
    grpc_images = stub.Generate(worker_pb2.GenerateRequest(prompt="a red fox at night", image=image, num_images=2,
                                                           seed=3, num_inference_steps=2, strength=0.5),
                                timeout=60).images
    assert [decoded(item).tobytes() for item in result.data] == [pixels(i.data, (72, 72)) for i in grpc_images]
    fitted = sdk(pair.base_url).images.edit(image=("fox.png", image, "image/png"), prompt="a red fox", size="64x64",
                                            extra_body={"num_inference_steps": 2, "resize_mode": "crop"})
    assert decoded(fitted.data[0]).size == (64, 64)


def l_mask(size: int) -> bytes:
    return png(Image.new("L", (size, size), 255))


@pytest.mark.parametrize("fields, param, words", [
    ({"image": openai.omit}, "image", "is required"),
    ({"mask": ("mask.png", openai_mask(32), "image/png")}, "mask", "the image is 64x64"),
    ({"mask": ("mask.png", l_mask(64), "image/png")}, "mask", "no alpha channel"),
    ({"image": ("fox.png", b"not an image", "image/png")}, "image", "not a PNG"),
    ({"size": "64x72"}, "image", "resize_mode"),
    ({"extra_body": {"strength": "strong"}}, "strength", "(0, 1]"),
    ({"extra_body": {"strength": 1.5}}, "strength", "(0, 1]"),
    ({"extra_body": {"seed": "x"}}, "seed", "integer"),
    ({"extra_body": {"resize_mode": "stretch"}}, "resize_mode", "resize, crop"),
    ({"extra_body": {"image_url": "http://x"}}, "image_url", "unknown"),
])
def test_bad_edits_are_400_naming_the_field(pair, fields, param, words):
    arguments = {"image": ("fox.png", picture(), "image/png"), "prompt": "a red fox", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(pair.base_url).images.edit(**arguments)
    error = caught.value.body
    assert error["param"] == param and words in error["message"] and error["code"] == "invalid_argument", error


def test_a_model_not_served_is_404_naming_the_served_one(pair):
    for call in (lambda: sdk(pair.base_url).images.generate(prompt="a red fox", model="dall-e-3"),
                 lambda: sdk(pair.base_url).images.edit(image=("fox.png", picture(), "image/png"), prompt="a red fox",
                                                        model="dall-e-2")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        error = caught.value.body
        assert error["param"] == "model" and error["code"] == "not_found", error
        assert "is not served here; this worker serves 'tiny'" in error["message"], error


def test_a_malformed_multipart_body_is_400_and_leaves_no_log_line(pair):
    """The parser's warning would be one log line per bad body, which a flood would turn into a full disk."""
    request = urllib.request.Request(f"http://127.0.0.1:{pair.http_port}/v1/images/edits",
                                     data=b"garbage, no boundary\r\n",
                                     headers={"Content-Type": "multipart/form-data; boundary=abc"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    error = json.load(caught.value)["error"]
    assert caught.value.code == 400 and "not valid multipart/form-data" in error["message"], error
    assert sdk(pair.base_url).models.list().data  # served after it, and its log written by then
    assert "python_multipart" not in pair.worker.log() and "boundary character" not in pair.worker.log()


def post_multipart(pair, parts: list[tuple[str, str | None, bytes]]) -> tuple[int, dict]:
    """POSTs ``parts`` (name, file name or None for a text field, content) to /v1/images/edits as they
    are, repeated names too (an SDK would not send these)."""
    boundary = "fox-boundary"
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'.encode()
        + (f'; filename="{filename}"\r\nContent-Type: image/png'.encode() if filename else b"")
        + b"\r\n\r\n" + content + b"\r\n" for name, filename, content in parts) + f"--{boundary}--\r\n".encode()
    request = urllib.request.Request(f"{pair.base_url}/images/edits", data=body,
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)["error"]


@pytest.mark.parametrize("parts, param, words", [
    ([("prompt", None, b"a fox"), ("prompt", None, b"a hen")], "prompt", "more than once"),
    ([("prompt", None, b"a fox"), ("mask", None, b"transparent")], "mask", "must be a file part"),
    ([("prompt", "prompt.png", b"a fox")], "prompt", "must be a text field"),
])
def test_parts_of_the_wrong_kind_or_given_twice_are_400_naming_them(pair, parts, param, words):
    status, error = post_multipart(pair, [("image", "fox.png", picture()), *parts])
    assert status == 400 and error["param"] == param and words in error["message"], error

def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_an_upload_past_the_body_budget_is_413_and_the_worker_does_not_grow(pair, stub):
    """32 MiB (--http-max-body-bytes-in-flight) is the most one body may be: one past it is refused
    from its Content-Length, before it is read (a retry cannot help, so 413, not 429)."""
    before = rss_bytes(pair.worker.pid)
    refused = http_calls(stub, "RESOURCE_EXHAUSTED", EDITS)
    huge = b"\0" * (32 * 2**20 + 1)
    with pytest.raises(openai.APIStatusError) as caught:
        sdk(pair.base_url).images.edit(image=("huge.png", huge, "image/png"), prompt="a red fox")
    assert caught.value.status_code == 413 and "--http-max-body-bytes-in-flight" in caught.value.body["message"]
    assert "retry-after" not in caught.value.response.headers
    assert http_calls(stub, "RESOURCE_EXHAUSTED", EDITS) == refused + 1
    assert rss_bytes(pair.worker.pid) - before < len(huge) // 8
    assert len(sdk(pair.base_url).images.edit(image=("fox.png", picture(), "image/png"), prompt="a red fox",
                                              extra_body={"num_inference_steps": 1, "strength": 1.0}).data) == 1


# --- vLLM's and SGLang's habits: /health, /metrics, model aliases ---------------------------------------------------


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers["content-type"], response.read().decode()


def test_health_and_metrics_on_the_http_port_are_those_of_the_metrics_port(pair):
    base = f"http://127.0.0.1:{pair.http_port}"
    assert get(f"{base}/health")[0] == 200
    sdk(pair.base_url).models.list()
    status, content_type, served = get(f"{base}/metrics")
    _, scraped_type, scraped = get(f"http://127.0.0.1:{pair.metrics_port}/metrics")
    assert status == 200 and content_type == scraped_type and content_type.startswith("text/plain")

    def families(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if line.startswith("# TYPE"))

    def models_calls(text: str) -> list[str]:  # neither /health nor /metrics counts: both read the same count
        return [line for line in text.splitlines() if line.startswith("diffusion_requests_total{")
                and 'method="http:/v1/models"' in line and 'code="OK"' in line]

    assert len(families(served)) > 10 and families(served) == families(scraped)
    assert models_calls(served) and models_calls(served) == models_calls(scraped)


def test_model_names_the_loaded_model_by_its_source_or_directory_name(pair, stub, tmp_path):
    directory = tmp_path / "fox-model"
    directory.symlink_to(Path(os.environ["DIFFUSION_MODEL_CACHE"]) / "tiny", target_is_directory=True)
    small = {"prompt": "a red fox", "size": "64x64", "extra_body": {"num_inference_steps": 1}}
    assert len(sdk(pair.base_url).images.generate(model="tiny", **small).data) == 1
    stub.Init(worker_pb2.InitRequest(model=str(directory)), timeout=120)
    try:
        assert [m.id for m in sdk(pair.base_url).models.list().data] == [str(directory)]
        for name in (str(directory), "fox-model"):
            assert len(sdk(pair.base_url).images.generate(model=name, **small).data) == 1
        with pytest.raises(openai.NotFoundError) as other:
            sdk(pair.base_url).images.generate(model="tiny", **small)
        assert other.value.body["param"] == "model"
    finally:
        stub.Init(worker_pb2.InitRequest(model="tiny"), timeout=120)
