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
