"""Message size limits and the options every channel and server is built with."""

from __future__ import annotations

# Sized for the largest image the default bounds allow (2048 x 2048 x 3 raw bytes, 4 images),
# well above gRPC's 4 MiB default, which a 1448 x 1448 RGB image already exceeds.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

Options = list[tuple[str, int]]


def message_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Options:
    """Explicit message size limits, for channels and servers alike."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# HTTP/2 keepalive: a channel pings its server every ``keepalive_s`` seconds, even without calls,
# and closes the connection when a ping is not answered within ``KEEPALIVE_TIMEOUT_S``, so a
# peer that hangs (SIGSTOP, a frozen host) is noticed as unreachable instead of waited on.
DEFAULT_KEEPALIVE_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
# Servers accept pings this often; below it they answer GOAWAY "too_many_pings". It must not
# exceed any client's keepalive interval.
MIN_PING_INTERVAL_MS = 1000


def keepalive_options(keepalive_s: float = DEFAULT_KEEPALIVE_S) -> Options:
    """Channel options that ping the server every ``keepalive_s`` seconds (0: no keepalive)."""
    if keepalive_s <= 0:
        return []
    return [
        ("grpc.keepalive_time_ms", max(int(keepalive_s * 1000), MIN_PING_INTERVAL_MS)),
        ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        # Newer gRPC cores time an unanswered keepalive ping with this one (default one minute).
        ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def keepalive_server_options() -> Options:
    """Server options that accept the pings of ``keepalive_options`` channels."""
    return [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
    ]
