"""A request with image inputs holds one copy of them while it waits to be decoded (issue 35 item 11):
``--max-input-bytes`` counts each admitted request's inputs once, but the servicer read each image
out of its message (a copy: protobuf keeps the message's own bytes until the call ends) before
waiting for a decoding thread, so 60 concurrent 2048x2048 inputs took the worker to 648 MB against
the 600 MB the budget is meant to keep.

The worker's own parts in this process (``worker_service.app.build``) on a real gRPC server, with
the in-process fake runner, called by a client process; the test holds the decoding threads busy,
so the requests wait for them, and ``tracemalloc`` (which sees every Python bytes object, not the
messages' own memory) finds what the waiting requests hold beside their messages. The fake
runner's model takes no image: once their headers are read the requests are refused, naming it."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from diffusion.v1 import worker_pb2
from fake_runner import FakeRunner, serve_fake_runner
from worker_service import image_inputs
from worker_service.app import build
from worker_service.main import parse_args

pytestmark = pytest.mark.process  # the caller is a process of its own
W = worker_pb2
REQUESTS = 3
IMAGE_BYTES = 1200 * 1200 * 3  # about: the image is 1200x1200 noise, which PNG cannot compress
# The caller, in a process of its own (tracemalloc then sees only the worker's memory): REQUESTS
# concurrent Generates, each with the image, and how each ended.
CLIENT = """
import io, sys
import grpc, numpy as np
from PIL import Image
from diffusion.v1 import worker_pb2 as W, worker_pb2_grpc
from serving_common.errors import field_violations
buffer = io.BytesIO()
Image.fromarray(np.random.RandomState(1).randint(0, 256, (1200, 1200, 3), dtype=np.uint8)).save(buffer, "PNG")
request = W.GenerateRequest(prompt="held", image=buffer.getvalue(), width=64, height=64, strength=0.5,
                            resize_mode=W.RESIZE_MODE_RESIZE, num_inference_steps=2)
with grpc.insecure_channel(sys.argv[1]) as channel:
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    for call in [stub.Generate.future(request, timeout=60) for _ in range(int(sys.argv[2]))]:
        error = call.exception()
        print(f"{error.code().name}:{','.join(field_violations(error))}" if error else "OK")
"""


async def until(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_requests_waiting_for_a_decoding_thread_hold_no_copy_of_their_image(tmp_path: Path) -> None:
    async def main() -> None:
        runner_target = f"unix:{tmp_path}/runner.sock"
        runner = await serve_fake_runner(FakeRunner(0.0), runner_target)
        config, _, _ = parse_args(["--listen", f"unix:{tmp_path}/worker.sock", "--runner", runner_target,
                                   "--model", "tiny", "--metrics-port", "0", "--http-port", "0"])
        worker = build(config)
        await worker.server.start()
        dispatching = asyncio.create_task(worker.dispatcher.run())
        worker.controller.start()
        release = threading.Event()
        loop = asyncio.get_running_loop()
        busy = [loop.run_in_executor(image_inputs._DECODERS, release.wait)
                for _ in range(image_inputs.DECODE_THREADS)]
        try:
            await until(lambda: worker.lifecycle.state == W.WORKER_STATE_READY, "the worker ready")
            tracemalloc.start()
            try:
                client = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", CLIENT, config.listen, str(REQUESTS), stdout=asyncio.subprocess.PIPE)
                # Each admitted request's header check is queued for a decoding thread.
                await until(lambda: image_inputs._DECODERS._work_queue.qsize() == REQUESTS,
                            "the requests waiting for a decoding thread")
                held = [trace.size for trace in tracemalloc.take_snapshot().traces if trace.size >= IMAGE_BYTES]
            finally:
                tracemalloc.stop()
                release.set()
            ended, _ = await client.communicate()
            assert held == [], f"{len(held)} copies of an image held beside the messages of {REQUESTS} requests"
            # Read at last: the fake runner's model serves text-to-image only, so each names its image.
            assert ended.decode().split() == ["INVALID_ARGUMENT:image"] * REQUESTS, ended
        finally:
            release.set()
            await asyncio.gather(*busy)
            dispatching.cancel()
            await worker.server.stop(0)
            await worker.pool.close()
            await runner.stop(0)

    asyncio.run(main())
