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

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from diffusion.v1 import worker_pb2
from serving_common.auth import TokenPolicy
from worker_service.http.image_store import ImageStore
from worker_service.http.route_calls import Endpoint, RouteCall, RouteCalls
from worker_service.metrics import WorkerMetrics

CONTENT = "/v1/images/{image_id}/content"
CONTENT_NAME = "image_content"
# An image is the caller's output: fetched under gRPC Generate's token rule; no model needed, so
# no activity for the idle timer.
CONTENT_ENDPOINT = Endpoint(f"http:GET {CONTENT}", f"GET {CONTENT}", "Generate")


class ImageUrls:
    """Keeps images in ``store`` and serves them, under ``policy``'s tokens."""

    def __init__(self, store: ImageStore, policy: TokenPolicy | None, metrics: WorkerMetrics) -> None:
        self._store = store
        self._calls = RouteCalls(metrics, policy)

    def keep(self, request: Request, images: Sequence[worker_pb2.Image]) -> list[str]:
        """Keeps ``images`` and returns their URLs, as the client that sent ``request`` reaches them;
        RESOURCE_EXHAUSTED when they alone are more than the store holds."""
        ids = self._store.keep([(image.data, image.mime_type) for image in images])
        return [str(request.url_for(CONTENT_NAME, image_id=image_id)) for image_id in ids]

    def routes(self) -> list[Route]:
        return [Route(CONTENT, self.content, methods=["GET"], name=CONTENT_NAME)]

    async def content(self, request: Request) -> Response:
        async def served(call: RouteCall) -> Response:
            image = self._store.get(request.path_params["image_id"])  # ImageGone: 410
            return Response(image.data, media_type=image.media_type)

        return await self._calls.call(request, CONTENT_ENDPOINT, served)
