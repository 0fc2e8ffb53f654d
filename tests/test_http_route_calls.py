"""``RouteCalls``, the one wrapper of every metered HTTP route (images, edits, models, image URLs,
videos), driven through a real Starlette app over ASGI with the worker's real metrics: what a
route's work answers or raises becomes OpenAI's answer, counted once, with its request id.

The routes themselves are tested served (test_openai_api, test_openai_videos, test_http_image_urls)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import grpc
import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from serving_common.errors import invalid_argument
from worker_service.config import Limits
from worker_service.http.errors import HttpRefusal
from worker_service.http.route_calls import Endpoint, RouteCall, RouteCalls
from worker_service.metrics import Sources, WorkerMetrics

pytestmark = pytest.mark.unit

GENERATION = Endpoint("http:/gen", "POST /gen", "Generate", activity=True, generation=True)
POLL = Endpoint("http:GET /poll", "GET /poll", "GetStatus")
TOKEN = "secret"


class Served:
    """An app of one route at ``/``, whose work is ``work``, under a token policy."""

    def __init__(self, endpoint: Endpoint, work: Any) -> None:
        self.metrics = WorkerMetrics(Limits(), Sources(*[lambda: 0] * 4, runners=lambda: (), receiving=lambda: 0,
                                                       waiting_to_receive=lambda: 0))
        self.activity: list[tuple[str, bool]] = []
        calls = RouteCalls(self.metrics, lambda method: (TOKEN,), lambda method, ok: self.activity.append((method, ok)))

        async def route(request: Request) -> Response:
            return await calls.call(request, endpoint, work)

        self.app = Starlette(routes=[Route("/", route, methods=["GET"])])

    def get(self, token: str | None = TOKEN, request_id: str | None = None) -> tuple[int, dict[str, str], bytes]:
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        headers += [(b"x-request-id", request_id.encode())] if request_id is not None else []
        scope = {"type": "http", "method": "GET", "path": "/", "raw_path": b"/", "root_path": "", "scheme": "http",
                 "query_string": b"", "headers": headers, "server": ("test", 80), "http_version": "1.1"}
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        asyncio.run(self.app(scope, receive, send))
        start, body = sent[0], b"".join(message.get("body", b"") for message in sent[1:])
        return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body

    def counted(self, endpoint: Endpoint) -> dict[str, int]:
        requests = self.metrics.stats.requests
        return {code: count for (method, code), count in requests.items() if method == endpoint.method}


def test_an_answer_is_counted_ok_and_told_to_the_idle_timer() -> None:
    async def work(call: RouteCall) -> Response:
        return Response(call.request_id)

    served = Served(GENERATION, work)
    status, _, body = served.get()
    assert status == 200 and len(body) == 32
    assert served.counted(GENERATION) == {"OK": 1} and served.metrics.active == 0
    assert served.activity == [("http:/gen", False), ("http:/gen", True)]


def test_a_refusal_is_openais_error_with_the_request_id() -> None:
    async def work(call: RouteCall) -> Response:
        raise invalid_argument({"n": "must be 1 to 4, got 9"})

    served = Served(POLL, work)
    status, headers, body = served.get()
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "n" and error["code"] == "invalid_argument"
    assert len(headers["x-request-id"]) == 32
    assert served.counted(POLL) == {"INVALID_ARGUMENT": 1} and served.activity == []  # a poll is quiet


def test_the_callers_request_id_names_the_call_and_its_answers() -> None:
    async def work(call: RouteCall) -> Response:
        if call.request_id == "gateway-7f3a":
            return Response(call.request_id)
        raise invalid_argument({"n": "must be 1 to 4, got 9"})

    served = Served(GENERATION, work)
    assert served.get(request_id="gateway-7f3a")[2] == b"gateway-7f3a"
    status, headers, _ = served.get(request_id="gateway-7f3b")
    assert status == 400 and headers["x-request-id"] == "gateway-7f3b"
    status, headers, body = served.get(request_id="")  # an empty header is no id
    assert status == 400 and len(headers["x-request-id"]) == 32


@pytest.mark.parametrize("request_id, words", [("two words", "printable ASCII without spaces"),
                                               ("x" * 129, "at most 128 characters")])
def test_a_request_id_no_request_may_carry_is_400_naming_the_header(request_id: str, words: str) -> None:
    ran: list[bool] = []

    async def work(call: RouteCall) -> Response:
        ran.append(True)
        return Response()

    served = Served(GENERATION, work)
    status, headers, body = served.get(request_id=request_id)
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "x-request-id" and words in error["message"] and not ran
    assert len(headers["x-request-id"]) == 32  # a new id answers: the caller's cannot name anything
    assert served.counted(GENERATION) == {"INVALID_ARGUMENT": 1} and served.metrics.active == 0
    assert served.get(None, request_id=request_id)[0] == 401  # the token first, as over gRPC


def test_a_wrong_token_is_refused_before_the_work_runs() -> None:
    ran: list[bool] = []

    async def work(call: RouteCall) -> Response:
        ran.append(True)
        return Response()

    served = Served(POLL, work)
    status, headers, body = served.get("wrong")
    assert status == 403 and json.loads(body)["error"]["code"] == "permission_denied" and not ran
    status, headers, _ = served.get(None)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert served.counted(POLL) == {"PERMISSION_DENIED": 1, "UNAUTHENTICATED": 1}


def test_a_refusal_with_its_own_http_status_keeps_it() -> None:
    async def work(call: RouteCall) -> Response:
        raise HttpRefusal(grpc.StatusCode.NOT_FOUND, "gone", (410, "not_found_error"), param="image_id")

    served = Served(POLL, work)
    status, _, body = served.get()
    assert status == 410 and json.loads(body)["error"] == {"message": "gone", "type": "not_found_error",
                                                           "param": "image_id", "code": "not_found"}
    assert served.counted(POLL) == {"NOT_FOUND": 1}


def test_a_bug_is_a_short_500_naming_the_request_id_with_the_details_in_the_log(caplog) -> None:
    async def work(call: RouteCall) -> Response:
        raise RuntimeError("a path on the server")

    served = Served(GENERATION, work)
    with caplog.at_level(logging.ERROR, "worker_service.http.route_calls"):
        status, headers, body = served.get()
    error = json.loads(body)["error"]
    assert status == 500 and error["code"] == "internal" and headers["x-request-id"] in error["message"]
    assert "a path on the server" not in error["message"] and "a path on the server" in caplog.text
    assert served.counted(GENERATION) == {"INTERNAL": 1} and served.metrics.active == 0
    assert served.activity[-1] == ("http:/gen", False)


def test_a_client_that_disconnected_is_cancelled() -> None:
    async def work(call: RouteCall) -> Response:
        raise ClientDisconnect()

    served = Served(GENERATION, work)
    assert served.get()[0] == 499
    assert served.counted(GENERATION) == {"CANCELLED": 1} and served.metrics.active == 0


def test_a_call_handed_over_ends_when_its_answer_ends_it_once() -> None:
    ends: list[Any] = []

    async def work(call: RouteCall) -> Response:
        ends.append(call.hand_over())
        return Response("streaming")

    served = Served(GENERATION, work)
    assert served.get()[0] == 200
    assert served.counted(GENERATION) == {} and served.metrics.active == 1  # still running
    ends[0](grpc.StatusCode.OK)
    assert served.counted(GENERATION) == {"OK": 1} and served.metrics.active == 0
    assert served.activity == [("http:/gen", False), ("http:/gen", True)]
