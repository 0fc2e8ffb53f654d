"""The images an OpenAI Images API response points at with ``response_format: "url"``, kept in the
worker's memory until they are fetched (``image_urls`` serves them).

SGLang and OpenAI's older models answer with URLs rather than base64; a URL is only as good as
what stands behind it, so the images stay here, bounded three ways (``--max-image-urls``,
``--max-image-url-bytes``, ``--image-url-ttl-s``):

- count and bytes: keeping a response's images drops the oldest kept ones until the new ones fit,
  so a busy worker never refuses for want of room; an image not fetched by then is gone early
  (clients fetch their URLs as soon as they have them). A response whose images alone are more
  than either bound could never be kept: it is refused RESOURCE_EXHAUSTED and nothing is dropped;
- time: an image is dropped ``ttl_s`` after it was kept, when the store is next used.

An id is ``img_``, 32 random hex digits (``secrets``: unguessable) and 24 hex digits of their
HMAC under a key of this process. The MAC tells an id this store gave out, whose image is gone
(expired or dropped for newer ones: ``ImageGone``, 410), from one it never gave out (NOT_FOUND,
404) without remembering gone ids, so memory is bounded by what is kept. A restarted worker has
another key: its predecessor's ids are unknown to it. The clock is a dependency, so that expiry
is tested without waiting.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from serving_common.errors import ServiceError
from worker_service.http.errors import HttpRefusal

GONE = (410, "not_found_error")  # the HTTP status and OpenAI error type of an image gone

ID_PREFIX = "img_"
NONCE_BYTES = 16
MAC_BYTES = 12


@dataclass(frozen=True)
class StoredImage:
    data: bytes
    media_type: str  # image/png, image/jpeg or image/webp, as the worker encoded it
    expires_at: float  # by the store's clock


class ImageGone(HttpRefusal):
    """An id this store gave out whose image it no longer keeps (410 Gone over HTTP). NOT_FOUND
    for metrics and logs, as gRPC would say it."""

    def __init__(self, image_id: str, ttl_s: float) -> None:
        super().__init__(grpc.StatusCode.NOT_FOUND, f"image {image_id} is gone: it expired {ttl_s:g} s after it was "
                                                    "made (--image-url-ttl-s), or newer images took its place "
                                                    "(--max-image-urls, --max-image-url-bytes)",
                         GONE, param="image_id")


class ImageStore:
    """At most ``max_images`` images and ``max_bytes`` bytes, each kept ``ttl_s`` seconds by
    ``clock`` (seconds, never going back)."""

    def __init__(self, max_images: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_images = max_images
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._key = secrets.token_bytes(32)
        self._images: dict[str, StoredImage] = {}  # oldest first, which is also soonest to expire
        self.held_bytes = 0

    def keep(self, images: Sequence[tuple[bytes, str]]) -> list[str]:
        """Keeps each (data, media type), dropping the oldest images for room; their ids, in order.
        RESOURCE_EXHAUSTED, with nothing dropped, when they alone are more than the store holds."""
        size = sum(len(data) for data, _ in images)
        if len(images) > self.max_images or size > self.max_bytes:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the {len(images)} images ({size} bytes) are more than this worker keeps for "
                               f"response_format url ({self.max_images} images, {self.max_bytes} bytes: "
                               "--max-image-urls, --max-image-url-bytes); ask for b64_json, or fewer or smaller "
                               "images")
        self._expire()
        while len(self._images) + len(images) > self.max_images or self.held_bytes + size > self.max_bytes:
            self._drop(next(iter(self._images)))
        expires_at = self._clock() + self.ttl_s
        ids = []
        for data, media_type in images:
            image_id = self._new_id()
            self._images[image_id] = StoredImage(data, media_type, expires_at)
            ids.append(image_id)
        self.held_bytes += size
        return ids

    def get(self, image_id: str) -> StoredImage:
        """The image; ImageGone for an id this store gave out but no longer keeps, NOT_FOUND for
        any other."""
        self._expire()
        image = self._images.get(image_id)
        if image is not None:
            return image
        if self._gave_out(image_id):
            raise ImageGone(image_id, self.ttl_s)
        raise ServiceError(grpc.StatusCode.NOT_FOUND, f"no image {image_id[:80]!r}")

    def _new_id(self) -> str:
        nonce = secrets.token_hex(NONCE_BYTES)
        return f"{ID_PREFIX}{nonce}{self._mac(nonce)}"

    def _mac(self, nonce: str) -> str:
        return hmac.new(self._key, nonce.encode(), hashlib.sha256).hexdigest()[: 2 * MAC_BYTES]

    def _gave_out(self, image_id: str) -> bool:
        body = image_id.removeprefix(ID_PREFIX)
        if body == image_id or len(body) != 2 * (NONCE_BYTES + MAC_BYTES) or not body.isascii():
            return False
        nonce, mac = body[: 2 * NONCE_BYTES], body[2 * NONCE_BYTES:]
        return hmac.compare_digest(mac, self._mac(nonce))

    def _drop(self, image_id: str) -> None:
        self.held_bytes -= len(self._images.pop(image_id).data)

    def _expire(self) -> None:
        now = self._clock()
        while self._images:
            oldest = next(iter(self._images))
            if self._images[oldest].expires_at > now:
                return
            self._drop(oldest)
