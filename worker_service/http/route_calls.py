"""What every metered route of the HTTP API does around its own work (``RouteCalls.call``), as the
gRPC interceptors do around a gRPC method:

- Tokens: ``Authorization: Bearer`` is checked against the worker's one token policy, the route as
  the gRPC method whose rule it follows (``Endpoint.rule``: Generate, GetStatus).
- Metrics: the call counts in ``diffusion_requests_total`` under the endpoint's ``method``, code
  the gRPC status name; a generation counts in ``diffusion_requests_active`` while it runs; an
  endpoint that is ``activity`` tells the idle timer when it starts and when it ends.
- A request id for every call: the caller's own ``x-request-id`` header where it sent one (what a
  gateway or a service mesh sets, so one id follows a request from its log through the worker's to
  the runner's, as vLLM takes it), else a new one; the ``x-request-id`` header of its error answers
  (and of whatever answer the route gives it to), and the id a 500 names. A caller's id must be one
  a gRPC request may carry (``request_id_problem``), else the call is a 400 naming the header; a
  generation's id must also be free (validation refuses one already queued or running).
- Errors in OpenAI's JSON shape (``errors``): a ServiceError as ``from_service_error`` says it, the
  fields named by the endpoint's ``param_of``; a client that disconnected (while it sent the body,
  or while its request waited or ran) is CANCELLED, answered to nobody; anything else is a bug: a
  short 500 with the request id, the details in the log.

A call ends when its route returns, unless the route hands its end over (``RouteCall.hand_over``)
to an answer that goes on after it, a stream, which ends the call when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from serving_common.auth import TokenPolicy, refusal
from serving_common.errors import ServiceError, invalid_argument
from serving_common.input_rules import request_id_problem
from serving_common.logs import REQUEST_ID_METADATA
from serving_common.protocol import WORKER_SERVICE
from worker_service.http.errors import from_service_error, http_status, internal_error
from worker_service.http.params import openai_param
from worker_service.metrics import WorkerMetrics

logger = logging.getLogger(__name__)

# A call's end: counted with its code, once.
End = Callable[[grpc.StatusCode], None]


@dataclass(frozen=True)
class Endpoint:
    """One metered route, as ``RouteCalls`` treats it."""

    method: str  # in diffusion_requests_total: "http:/v1/images/generations", "http:POST /v1/videos"
    label: str  # how a token refusal names the call: "POST /v1/images/generations"
    rule: str  # the gRPC method whose token rule it follows: "Generate" or "GetStatus"
    activity: bool = False  # tells the idle timer when it starts and ends
    generation: bool = False  # counts in diffusion_requests_active while it runs
    param_of: Callable[[str], tuple[str, str]] = openai_param  # a GenerateRequest field's OpenAI name


class RouteCall:
    """One call of an endpoint, as its route sees it: the request id, and its end."""

    def __init__(self, request_id: str, end: End) -> None:
        self.request_id = request_id
        self._end = end
        self.handed_over = False

    def hand_over(self) -> End:
        """The call's end, for an answer that goes on after the route returns (a stream) to call
        once, when it ends; the route no longer ends the call."""
        self.handed_over = True
        return self._end


@dataclass(frozen=True)
class RouteCalls:
    """Runs the routes' work as the module says."""

    metrics: WorkerMetrics
    policy: TokenPolicy | None  # the same object the gRPC BearerTokenInterceptor asks
    on_activity: Callable[[str, bool], None] | None = None  # the idle timer's on_call

    async def call(self, request: Request, endpoint: Endpoint,
                   work: Callable[[RouteCall], Awaitable[Response]]) -> Response:
        """``work``'s answer to ``request``, or the error it raised as OpenAI's."""
        caller_id = request.headers.get(REQUEST_ID_METADATA, "")
        problem = request_id_problem(caller_id, self.metrics.limits.max_request_id_chars) if caller_id else None
        call = RouteCall(caller_id if caller_id and problem is None else uuid.uuid4().hex,
                         lambda code: self._end(endpoint, code))
        code = grpc.StatusCode.UNKNOWN
        self._begin(endpoint)
        try:
            _authorize(self.policy, request, endpoint.rule, endpoint.label)
            if problem is not None:
                raise invalid_argument({REQUEST_ID_METADATA: problem})
            response = await work(call)
            code = grpc.StatusCode.OK
            return response
        except ServiceError as error:
            code = error.code
            return from_service_error(error, endpoint.param_of, call.request_id).response(call.request_id)
        except ClientDisconnect:
            code = grpc.StatusCode.CANCELLED
            logger.info("request %s cancelled: the HTTP client disconnected", call.request_id)
            return Response(status_code=http_status(code)[0])  # nobody reads it
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:  # noqa: BLE001 - a bug: a short 500 here, the details in the log
            code = grpc.StatusCode.INTERNAL
            logger.exception("%s %s failed unexpectedly (request id %s)", request.method, request.url.path,
                             call.request_id)
            return internal_error(call.request_id).response(call.request_id)
        finally:
            if not call.handed_over:
                self._end(endpoint, code)

    def _begin(self, endpoint: Endpoint) -> None:
        if endpoint.generation:
            self.metrics.active += 1
        if endpoint.activity and self.on_activity is not None:
            self.on_activity(endpoint.method, False)

    def _end(self, endpoint: Endpoint, code: grpc.StatusCode) -> None:
        if endpoint.generation:
            self.metrics.active -= 1
        self.metrics.record_call(endpoint.method, code)
        if endpoint.activity and self.on_activity is not None:
            self.on_activity(endpoint.method, code == grpc.StatusCode.OK)


def _authorize(policy: TokenPolicy | None, request: Request, method: str, label: str) -> None:
    """Raises UNAUTHENTICATED or PERMISSION_DENIED as the gRPC ``method`` (``Generate``,
    ``GetStatus``) would; ``label`` names the call in the message."""
    if policy is None:
        return
    refused = refusal(policy(f"/{WORKER_SERVICE}/{method}"), _bearer(request.headers), label)
    if refused is not None:
        raise ServiceError(*refused)


def _bearer(headers: Headers) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
