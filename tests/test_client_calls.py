"""The sync and asyncio clients are made from one table of calls (``clients.calls.WorkerCalls``):
the same methods with the same signatures and docstrings, blocking on one and coroutines on the
other; and the asyncio ``wait_ready``, which no other test awaits, against a real worker."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from clients import AsyncDiffusionClient, DeadlineExceeded, DiffusionClient
from clients.calls import WorkerCalls, client_method
from support import running_pair

ONE_RESPONSE = sorted(name for name, value in vars(WorkerCalls).items() if isinstance(value, client_method))
STREAMS = ("stream", "stream_video")
OWN = ("generate_video", "wait_ready", "close")  # each client's, written for its kind of iteration


@pytest.mark.unit
def test_every_call_is_in_the_table() -> None:
    assert ONE_RESPONSE == sorted(["generate", "cancel", "status", "init", "sleep", "wake", "load_weights",
                                   "push_weights", "weights_checksum", "load_adapter", "unload_adapter",
                                   "list_adapters", "health"])
    public = {name for name in dir(DiffusionClient) if not name.startswith("_")} - {"grpc_module"}
    assert public == {name for name in dir(AsyncDiffusionClient) if not name.startswith("_")} - {"grpc_module"}
    assert public == {*ONE_RESPONSE, *STREAMS, *OWN}


@pytest.mark.unit
@pytest.mark.parametrize("name", [*ONE_RESPONSE, *STREAMS, *OWN])
def test_both_clients_have_the_same_signature_and_docstring(name: str) -> None:
    sync, awaited = getattr(DiffusionClient, name), getattr(AsyncDiffusionClient, name)
    assert inspect.signature(sync) == inspect.signature(awaited)
    if name not in OWN:
        assert sync.__doc__ and sync.__doc__ == awaited.__doc__
    assert not inspect.iscoroutinefunction(sync)
    assert inspect.iscoroutinefunction(awaited) == (name not in STREAMS)


@pytest.mark.unit
def test_a_call_shows_what_it_returns_not_the_call_it_makes() -> None:
    client = DiffusionClient("127.0.0.1:1")
    try:
        signature = inspect.signature(client.cancel)
        assert str(signature) == "(request_id: 'str', *, timeout: 'float | None' = None) -> 'str'"
        assert inspect.signature(client.push_weights).return_annotation == "PushResult"
        assert client.cancel.__name__ == "cancel" and "queued" in (client.cancel.__doc__ or "")
    finally:
        client.close()


@pytest.mark.process
@pytest.mark.timeout(180)
def test_async_wait_ready_returns_once_serving_and_raises_at_its_deadline(tmp_path) -> None:
    async def scenario(target: str) -> None:
        async with AsyncDiffusionClient(target, timeout=60) as client:
            await client.wait_ready()
            assert await client.health() == "SERVING"
            with pytest.raises(DeadlineExceeded):  # a service never SERVING: the deadline passes
                await client.wait_ready("no.such.Service", timeout=0.5)

    with running_pair(tmp_path, "--model", "tiny", fake_step_s=0.01, ready=False) as pair:
        asyncio.run(scenario(pair.worker.target))
