"""``response_format: "url"`` of the Images API: the URLs a generation or an edit answers with,
and ``GET /v1/images/{image_id}/content``, which serves the images they point at from the
``image_store``.

A URL is absolute, made of the scheme and the ``Host`` header the request came with (Starlette's
``url_for``), so it points where the client reached the worker, through whatever name or port
forward it used; OpenAI SDK users fetch it as it is. Fetching takes the generation's token
(gRPC Generate's rule, as for the generation itself): an image is the caller's output. The answer
is the image's bytes with its content type (``image/png``, ``image/jpeg`` or ``image/webp``);
410 once it is gone (expired or dropped for newer images), 404 for an id never given out. Calls
count in ``diffusion_requests_total`` as ``http:GET /v1/images/{image_id}/content``; they do not
count as activity for the idle timer (a download needs no model).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from diffusion.v1 import worker_pb2
from serving_common.auth import TokenPolicy
from serving_common.errors import ServiceError
from worker_service.http.errors import OpenAIError, from_service_error
from worker_service.http.image_store import ImageGone, ImageStore
from worker_service.http.openai_images import authorize
from worker_service.http.params import openai_param
from worker_service.metrics import WorkerMetrics

CONTENT = "/v1/images/{image_id}/content"
CONTENT_NAME = "image_content"


class ImageUrls:
    """Keeps images in ``store`` and serves them, under ``policy``'s tokens."""

    def __init__(self, store: ImageStore, policy: TokenPolicy | None, metrics: WorkerMetrics) -> None:
        self._store = store
        self._policy = policy
        self._metrics = metrics

    def keep(self, request: Request, images: Sequence[worker_pb2.Image]) -> list[str]:
        """Keeps ``images`` and returns their URLs, as the client that sent ``request`` reaches them;
        RESOURCE_EXHAUSTED when they alone are more than the store holds."""
        ids = self._store.keep([(image.data, image.mime_type) for image in images])
        return [str(request.url_for(CONTENT_NAME, image_id=image_id)) for image_id in ids]

    def routes(self) -> list[Route]:
        return [Route(CONTENT, self.content, methods=["GET"], name=CONTENT_NAME)]

    async def content(self, request: Request) -> Response:
        code = grpc.StatusCode.UNKNOWN
        try:
            authorize(self._policy, request, "Generate", f"GET {CONTENT}")
            image = self._store.get(request.path_params["image_id"])
            code = grpc.StatusCode.OK
            return Response(image.data, media_type=image.media_type)
        except ImageGone as gone:
            code = gone.code
            return OpenAIError(410, "not_found_error", gone.message, param="image_id",
                               code=gone.code.name.lower()).response()
        except ServiceError as error:
            code = error.code
            return from_service_error(error, openai_param).response()
        finally:
            self._metrics.record_call(f"http:GET {CONTENT}", code)
