"""What the ControlNet and IP-Adapter test modules share: fake runners served from a thread of the
test process (so a test reads what each Execute carried), and small images."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from PIL import Image

from diffusion.v1 import common_pb2
from fake_runner import FakeRunner, serve_fake_runner

T = TypeVar("T")
CONTROLNET, IP_ADAPTER = common_pb2.ADAPTER_KIND_CONTROLNET, common_pb2.ADAPTER_KIND_IP_ADAPTER


def png(width: int, height: int, noise: bool = False, mode: str = "RGB") -> bytes:
    """A PNG of ``width`` x ``height``: grey, or noise (which PNG cannot compress: about 3 bytes a pixel)."""
    pixels = (np.random.RandomState(width).randint(0, 256, (height, width, 3), dtype=np.uint8) if noise
              else np.full((height, width, 3), 128, dtype=np.uint8))
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, "PNG")
    return buffer.getvalue()


class FakeRunners:
    """Fake runners served by an event loop on a thread of the test process, by name."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fakes: dict[str, FakeRunner] = {}
        self.servers: dict[str, grpc.aio.Server] = {}

    def target(self, name: str) -> str:
        return f"unix:{self.directory}/{name}.sock"

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def start(self, name: str, adapter_kinds: list[int]) -> FakeRunner:
        """A fresh fake runner at ``name``'s address (the one there before, if any, stopped first)."""
        if name in self.servers:
            self.call(self.servers[name].stop(0))
        fake = FakeRunner(step_s=0.01, adapter_kinds=adapter_kinds)
        self.fakes[name], self.servers[name] = fake, self.call(serve_fake_runner(fake, self.target(name)))
        return fake

    def close(self) -> None:
        for server in self.servers.values():
            self.call(server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
