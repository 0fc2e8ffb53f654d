"""``response_format: "url"`` of the OpenAI Images API: the real ``openai`` SDK against a real worker
and runner, whose answers point at ``GET /v1/images/{id}/content``; and the image store
(``worker_service/http/image_store.py``) in-process, with a clock of the test's.

One worker (tiny, an inference token, ``--max-image-urls 3``) serves the process tests but the
expiry one, which starts a second worker with a TTL of 50 ms on the same runner and polls until
its URL answers 410. Requests are tiny: 64x64, 1 or 2 steps.
"""

from __future__ import annotations

import base64
import io
import json
import re
import urllib.error
import urllib.request

import grpc
import httpx2
import openai
import pytest
from PIL import Image

from harness.processes import free_port, start_worker, wait_until
from serving_common.errors import ServiceError
from worker_service.http.image_store import ImageGone, ImageStore
from worker_service.main import parse_args

TOKEN = "image-secret"
MAX_URLS = 3
SMALL = {"prompt": "a red fox", "size": "64x64", "extra_body": {"seed": 7, "num_inference_steps": 1}}
ID = re.compile(r"img_[0-9a-f]{56}")


# -- the store, in-process -------------------------------------------------------------------------

class Clock:
    """Seconds that move only when the test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store_from_flags(clock: Clock, *flags: str) -> ImageStore:
    """The store the worker builds from its command line (``app.build``), on ``clock``."""
    limits = parse_args(["--model", "", *flags])[0].image_urls
    return ImageStore(limits.max_image_urls, limits.max_image_url_bytes, limits.image_url_ttl_s, clock)


def kept(store: ImageStore, image_id: str) -> bool:
    """Whether ``store`` serves ``image_id``; an id it gave out and dropped must say it is gone."""
    try:
        store.get(image_id)
    except ImageGone:
        return False
    return True


@pytest.mark.unit
def test_an_image_is_served_until_its_ttl_then_gone():
    clock = Clock()
    store = store_from_flags(clock, "--image-url-ttl-s", "30")
    [image_id] = store.keep([(b"png bytes", "image/png")])
    clock.now += 29.9
    image = store.get(image_id)
    assert (image.data, image.media_type) == (b"png bytes", "image/png")
    clock.now += 0.1
    with pytest.raises(ImageGone) as gone:
        store.get(image_id)
    assert gone.value.code == grpc.StatusCode.NOT_FOUND and "--image-url-ttl-s" in gone.value.message
    assert store.held_bytes == 0


@pytest.mark.unit
def test_ids_are_unguessable_and_ids_never_given_out_are_not_found():
    store, other = store_from_flags(Clock()), store_from_flags(Clock())
    ids = store.keep([(b"a", "image/png"), (b"b", "image/png")])
    assert all(ID.fullmatch(image_id) for image_id in ids) and ids[0] != ids[1]
    [foreign] = other.keep([(b"c", "image/png")])  # another process's key
    tampered = ids[0][:-1] + ("0" if ids[0][-1] != "0" else "1")
    for unknown in (foreign, tampered, "img_" + "0" * 56, "img_", "img_ü" + "0" * 55, "", ids[0] + "0"):
        with pytest.raises(ServiceError) as caught:
            store.get(unknown)
        assert type(caught.value) is ServiceError and caught.value.code == grpc.StatusCode.NOT_FOUND, unknown


@pytest.mark.unit
def test_keeping_past_the_count_or_the_bytes_drops_the_oldest():
    store = store_from_flags(Clock(), "--max-image-urls", "3", "--max-image-url-bytes", "100")
    first, second = store.keep([(b"a" * 40, "image/png"), (b"b" * 40, "image/png")])
    [third] = store.keep([(b"c" * 10, "image/png")])
    assert store.held_bytes == 90 and all(kept(store, i) for i in (first, second, third))
    [fourth] = store.keep([(b"d" * 10, "image/png")])  # a fourth image: the oldest goes
    assert not kept(store, first) and all(kept(store, i) for i in (second, third, fourth))
    [fifth] = store.keep([(b"e" * 85, "image/png")])  # 60 + 85 > 100 bytes: the two oldest (40, 10) go
    assert [kept(store, i) for i in (second, third, fourth, fifth)] == [False, False, True, True]
    assert store.held_bytes == 95


@pytest.mark.unit
def test_a_response_larger_than_the_store_is_refused_and_drops_nothing():
    store = store_from_flags(Clock(), "--max-image-urls", "2", "--max-image-url-bytes", "100")
    [held] = store.keep([(b"h" * 60, "image/png")])
    for images, flag in (([(b"x" * 101, "image/png")], "--max-image-url-bytes"),
                         ([(b"x", "image/png")] * 3, "--max-image-urls")):
        with pytest.raises(ServiceError) as refused:
            store.keep(images)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and flag in refused.value.message
        assert "b64_json" in refused.value.message
    assert kept(store, held) and store.held_bytes == 60


# -- the API, against a real worker and runner -----------------------------------------------------

@pytest.fixture(scope="module")
def pair(serve, real_runner, tmp_path_factory):
    token = tmp_path_factory.mktemp("image-urls") / "inference.token"
    token.write_text(TOKEN + "\n")
    return serve("--inference-token-file", str(token), "--max-image-urls", str(MAX_URLS), on=real_runner, http=True)


def sdk(pair, api_key: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=pair.base_url, api_key=api_key, max_retries=0, timeout=60)


def fetch(client: openai.OpenAI, url: str) -> httpx2.Response:
    """``url`` fetched through the SDK's own client (its token, its errors: APIStatusError past 2xx)."""
    return client.get(url, cast_to=httpx2.Response)


def status_of(url: str, token: str | None = None) -> tuple[int, dict]:
    """The status and the JSON error body of a plain GET of ``url``, with ``token`` if given."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return response.status, {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def pixels(data: bytes) -> tuple[str | None, bytes]:
    image = Image.open(io.BytesIO(data))
    return image.format, image.convert("RGB").tobytes()


@pytest.mark.process
def test_sdk_url_answers_fetch_the_same_images_with_the_token(pair):
    client = sdk(pair)
    by_url = client.images.generate(**SMALL, n=2, response_format="url")
    by_b64 = client.images.generate(**SMALL, n=2)
    assert [image.model_extra["seed"] for image in by_url.data] == [7, 8]
    for url_image, b64_image in zip(by_url.data, by_b64.data, strict=True):
        assert url_image.b64_json is None and url_image.url is not None
        prefix, image_id = url_image.url.rsplit("/images/", 1)
        assert prefix == pair.base_url and ID.fullmatch(image_id.removesuffix("/content")), url_image.url
        fetched = fetch(client, url_image.url)
        assert fetched.headers["content-type"] == "image/png"
        assert pixels(fetched.content) == pixels(base64.b64decode(b64_image.b64_json))
    url = by_url.data[0].url
    assert status_of(url, TOKEN)[0] == 200
    missing, body = status_of(url)
    assert missing == 401 and body["error"]["code"] == "unauthenticated", body
    with pytest.raises(openai.PermissionDeniedError):
        fetch(sdk(pair, "not-the-token"), url)


@pytest.mark.process
def test_urls_follow_the_host_and_scheme_the_client_used(pair):
    """Behind a proxy (here on 127.0.0.1, which uvicorn trusts) the URL is the proxy's."""
    [image] = sdk(pair).images.generate(**SMALL, response_format="url", extra_headers={
        "Host": "images.example:8443", "X-Forwarded-Proto": "https"}).data
    assert image.url is not None and image.url.startswith("https://images.example:8443/v1/images/img_"), image.url


@pytest.mark.process
def test_an_edit_answers_urls_in_its_output_format(pair):
    picture = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(picture, "PNG")
    client = sdk(pair)
    result = client.images.edit(image=("fox.png", picture.getvalue(), "image/png"), prompt="a red fox",
                                response_format="url", output_format="jpeg",
                                extra_body={"num_inference_steps": 2, "strength": 0.5})
    fetched = fetch(client, result.data[0].url)
    assert fetched.headers["content-type"] == "image/jpeg" and pixels(fetched.content)[0] == "JPEG"


@pytest.mark.process
def test_the_oldest_urls_make_room_and_a_response_past_the_store_is_refused(pair):
    client = sdk(pair)
    older = [image.url for image in client.images.generate(**SMALL, n=2, response_format="url").data]
    newer = [image.url for image in client.images.generate(**SMALL, n=2, response_format="url").data]
    with pytest.raises(openai.APIStatusError) as gone:  # 4 images, 3 kept: the oldest went
        fetch(client, older[0])
    assert gone.value.status_code == 410 and gone.value.body["param"] == "image_id", gone.value.body
    for url in (older[1], *newer):
        assert fetch(client, url).status_code == 200
    with pytest.raises(openai.RateLimitError) as refused:  # 4 images could never be kept together
        client.images.generate(**SMALL, n=MAX_URLS + 1, response_format="url")
    assert refused.value.body["code"] == "resource_exhausted" and "--max-image-urls" in refused.value.body["message"]
    for url in (older[1], *newer):  # nothing was dropped for it
        assert fetch(client, url).status_code == 200


@pytest.mark.process
def test_ids_never_given_out_are_404(pair):
    client = sdk(pair)
    for image_id in ("img_" + "0" * 56, "nothing"):
        with pytest.raises(openai.NotFoundError) as unknown:
            fetch(client, f"{pair.base_url}/images/{image_id}/content")
        assert unknown.value.body["code"] == "not_found", unknown.value.body


@pytest.mark.process
def test_an_expired_url_answers_410(real_runner, tmp_path):
    port = free_port()
    short = start_worker(tmp_path, real_runner.target, "--model", "tiny", "--http-port", str(port),
                         "--image-url-ttl-s", "0.05")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        [image] = client.images.generate(**SMALL, response_format="url").data
        assert image.url is not None
        seen: list[int] = []

        def expired() -> bool:
            seen.append(status_of(image.url)[0])
            return seen[-1] == 410

        wait_until(expired, 30, "the image URL to expire")
        assert set(seen) <= {200, 410}, seen  # served, then gone: never unknown
        status, body = status_of(image.url)
        assert status == 410 and "expired" in body["error"]["message"], body
    finally:
        short.stop()
