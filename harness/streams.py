"""A worker's GenerateStream read on a thread, for tests that act while a request runs."""

from __future__ import annotations

import queue
import threading
import time

import grpc

from diffusion.v1 import worker_pb2, worker_pb2_grpc


class Stream:
    """Calls GenerateStream for ``request`` and reads it on a daemon thread.

    Keeps every event in order (``events``, ``kinds``), the monotonic time of each progress event
    (``progress_times``), the final ``error`` (None when the stream ended with OK) and when it ended
    (``ended_at``). ``wait_for``/``wait_step`` block on the events not yet waited for, ``join`` waits
    for the end, ``finish`` also returns what no wait consumed. ``call`` is the call itself (to cancel).

    No deadline unless ``timeout`` is given: the worker refuses a request its measured costs say
    cannot finish in the time left, so a long request a test holds in flight under a deadline would
    be refused on a slow or loaded machine. The waits here are bounded themselves.
    """

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub, request: worker_pb2.GenerateRequest,
                 timeout: float | None = None) -> None:
        self.call = stub.GenerateStream(worker_pb2.GenerateStreamRequest(request=request), timeout=timeout)
        self.events: list[worker_pb2.GenerateStreamResponse] = []
        self.progress_times: list[float] = []
        self.error: grpc.RpcError | None = None
        self.ended_at: float | None = None
        self._unread: queue.Queue[worker_pb2.GenerateStreamResponse | None] = queue.Queue()  # None: the end
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for event in self.call:
                self.events.append(event)
                if event.HasField("progress"):
                    self.progress_times.append(time.monotonic())
                self._unread.put(event)
        except grpc.RpcError as error:
            self.error = error
        self.ended_at = time.monotonic()
        self._unread.put(None)

    def _next(self, deadline: float, waiting_for: str) -> worker_pb2.GenerateStreamResponse:
        event = self._unread.get(timeout=max(0.01, deadline - time.monotonic()))
        assert event is not None, f"stream ended before {waiting_for}: {self.error}"
        return event

    def wait_for(self, kind: str, timeout: float = 60) -> worker_pb2.GenerateStreamResponse:
        """Consumes events up to the next one of ``kind`` (queued, started, progress, done) and returns it."""
        deadline = time.monotonic() + timeout
        while True:
            event = self._next(deadline, kind)
            if event.WhichOneof("event") == kind:
                return event

    def wait_step(self, step: int, timeout: float = 60) -> None:
        """Consumes events up to a progress event at ``step`` or later."""
        deadline = time.monotonic() + timeout
        while True:
            event = self._next(deadline, f"step {step}")
            if event.HasField("progress") and event.progress.step >= step:
                return

    def join(self, timeout: float = 60) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream hangs"

    def finish(self, timeout: float = 60) -> list[worker_pb2.GenerateStreamResponse]:
        """Joins, then returns the events no wait consumed, in order."""
        self.join(timeout)
        rest = []
        while (event := self._unread.get_nowait()) is not None:
            rest.append(event)
        return rest

    @property
    def kinds(self) -> list[str | None]:
        """Which event each event is, in order."""
        return [event.WhichOneof("event") for event in self.events]

    @property
    def done(self) -> worker_pb2.GenerateResponse | None:
        """The response, when the last event is ``done``."""
        return self.events[-1].done if self.events and self.events[-1].HasField("done") else None

    def step_time(self) -> float:
        """The mean time between progress events so far."""
        times = self.progress_times
        return (times[-1] - times[0]) / max(1, len(times) - 1)
