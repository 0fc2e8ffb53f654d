"""Whose is a listening port: free to bind before a start, and held by which process after it.

For a supervisor (``deploy/pod.py``) that starts a server on an address and then waits for it to
answer there: another process answering on that address (a second ``make run`` beside a first)
must not be mistaken for its own child, and a taken address is best reported before anything
starts. Addresses are the services' ``--listen`` values; ``unix:`` paths are not checked.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

_TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"  # the kernel's TCP_LISTEN, as /proc/net/tcp writes a socket's state
PORT_IN_USE = "the port is in use"


def _host_port(listen: str) -> tuple[str, int] | None:
    """``host:port`` split (``[::1]:port`` too); None for a ``unix:`` path or anything else."""
    host, _, port = listen.rpartition(":")
    if not host or listen.startswith("unix:") or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def bind_error(listen: str) -> str | None:
    """Why ``listen`` cannot be bound now (:data:`PORT_IN_USE`, an OS error's text), or None when it can.

    Binds it the way gRPC's servers do (SO_REUSEADDR, so a closed connection's TIME_WAIT does not
    count) without listening, then lets it go."""
    address = _host_port(listen)
    if address is None:
        return None
    try:
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(sockaddr)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return PORT_IN_USE
        return error.strerror or str(error)
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in _TCP_TABLES:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def listens_on(pid: int, listen: str) -> bool:
    """Whether process ``pid`` holds the listening socket of ``listen``'s port (Linux's /proc).

    True where that cannot be read (no /proc, a ``unix:`` path): there the caller has only the
    answer of whatever serves the address to go by."""
    address = _host_port(listen)
    if address is None or not _TCP_TABLES[0].exists():
        return True
    inodes = _listening_inodes(address[1])
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process is gone
        return False
    for descriptor in descriptors:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{descriptor}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[len("socket:["):-1] in inodes:
            return True
    return False
