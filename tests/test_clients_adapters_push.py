"""The SDK and the CLI for LoRA adapters and PushWeights: the stream they build checked in-process, then
everything against a real worker and runner over loopback gRPC (no mocks)."""

from __future__ import annotations

import asyncio
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from clients import AsyncDiffusionClient, DiffusionClient, Done, PushResult
from clients.push import push_requests
from clients.types import adapter_refs
from diffusion.v1 import worker_pb2
from harness.processes import REPO
from lora_files import make_lora
from runner_service.models.catalog import ensure_builtin
from serving_common.errors import field_violations
from support import cli

pytestmark = pytest.mark.timeout(180)
NOBODY = "127.0.0.1:1"  # nothing listens on port 1
STEPS = 2
SEED = 7


def expected_bytes(tensor: torch.Tensor) -> bytes:
    """Row-major little-endian bytes, computed apart from the client (bfloat16 through int16: numpy has none)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.contiguous().numpy().tobytes()


def expected_sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        digest.update(f"{name}\0{dtype}\0{'x'.join(str(d) for d in tensor.shape)}\0".encode())
        digest.update(expected_bytes(tensor))
    return digest.hexdigest()


def unet_tensors() -> dict[str, torch.Tensor]:
    """The built-in tiny model's own UNet tensors, named for PushWeights."""
    tensors = load_file(ensure_builtin("tiny") / "unet" / "diffusion_pytorch_model.safetensors")
    return {f"unet.{name}": tensor for name, tensor in sorted(tensors.items())}


# --- the stream the clients send, no worker needed -----------------------------------------------

MIXED = {
    "unet.a.weight": torch.arange(50, dtype=torch.float32).reshape(5, 10),
    "unet.b.weight": torch.linspace(-3, 3, 37).to(torch.bfloat16),
    "text_encoder.c.scale": torch.tensor(2.5, dtype=torch.float64),  # 0-d
    "unet.d.empty": torch.zeros(0, 4, dtype=torch.float16),
    "unet.e.ids": torch.arange(9, dtype=torch.int64).reshape(3, 3).t(),  # not contiguous
    "unet.f.mask": torch.tensor([True, False, True]),
}


@pytest.mark.unit
@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_push_requests_chunks_each_tensor_in_order_and_commits_its_sha256(chunk_bytes):
    progress: list[tuple[int, int]] = []
    requests = [worker_pb2.PushWeightsRequest.FromString(message) for message in
                push_requests(MIXED, chunk_bytes, lambda sent, total: progress.append((sent, total)))]
    *messages, last = requests
    assert last.WhichOneof("part") == "commit" and last.commit.sha256 == expected_sha256(MIXED)
    assert all(r.WhichOneof("part") in ("chunk", "chunks") for r in messages)
    chunks = [chunk for r in messages for chunk in (r.chunks.chunks if r.HasField("chunks") else [r.chunk])]
    assert all(sum(len(c.data) for c in (r.chunks.chunks if r.HasField("chunks") else [r.chunk])) <= chunk_bytes
               for r in messages)
    received: dict[str, bytes] = {}
    for chunk in chunks:
        if chunk.name not in received:  # a tensor's first chunk, and the previous tensor is complete
            assert list(received) == list(MIXED)[:len(received)]
            if received:
                previous = list(received)[-1]
                assert received[previous] == expected_bytes(MIXED[previous])
            tensor = MIXED[chunk.name]
            assert chunk.offset == 0 and chunk.dtype == str(tensor.dtype).removeprefix("torch.")
            assert tuple(chunk.shape) == tuple(tensor.shape)
            received[chunk.name] = b""
        else:  # only the name, the offset and the data
            assert chunk.name == list(received)[-1] and not chunk.dtype and not chunk.shape
            assert chunk.offset == len(received[chunk.name]) > 0
        received[chunk.name] += chunk.data
    assert received == {name: expected_bytes(tensor) for name, tensor in MIXED.items()}
    total = sum(len(data) for data in received.values())
    assert [sent for sent, _ in progress] == sorted(sent for sent, _ in progress)
    assert progress[-1] == (total, total) and {t for _, t in progress} == {total}


@pytest.mark.unit
def test_a_safetensors_file_streams_as_its_state_dict(tmp_path):
    path = tmp_path / "weights.safetensors"
    tensors = {name: t.contiguous() for name, t in sorted(MIXED.items())}
    save_file(tensors, str(path))
    totals = set()
    from_file = list(push_requests(path, 16, lambda sent, total: totals.add(total)))
    assert from_file == list(push_requests(tensors, 16)) == list(push_requests(str(path), 16))
    assert totals == {sum(len(expected_bytes(t)) for t in tensors.values())}


@pytest.mark.unit
def test_bad_weights_are_refused_before_anything_is_sent(tmp_path):
    with pytest.raises(ValueError, match="chunk_bytes"):
        push_requests(MIXED, 0)
    with pytest.raises(TypeError, match=r"weights\['unet.x'\] is a list"):
        push_requests({"unet.x": [1.0]})
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="garbage.safetensors"):
        push_requests(garbage)
    with pytest.raises(FileNotFoundError):
        push_requests(tmp_path / "missing.safetensors")


@pytest.mark.unit
def test_adapter_forms_build_the_same_request():
    assert adapter_refs({"a": 1.0, "b": 0.5}) == adapter_refs([("a", 1.0), ("b", 0.5)])
    [name_only] = adapter_refs(["a"])
    assert name_only.name == "a" and not name_only.HasField("scale")  # 1.0 on the worker
    assert adapter_refs("a") == adapter_refs(["a"])


@pytest.mark.unit
def test_the_clients_import_without_torch():
    code = ("import sys, clients, clients.cli, clients.push, clients.aio; "
            "assert 'torch' not in sys.modules and 'safetensors' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


@pytest.mark.unit
@pytest.mark.parametrize("value", ["x:notanumber", ":0.5", "x:", "x:nan", "x:inf"])
def test_bad_adapter_forms_are_refused_by_argparse(value, tmp_path):
    done = cli("--target", NOBODY, "generate", "a fox", "-o", str(tmp_path / "x.png"), "--adapter", value)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [error] = [line for line in done.stderr.splitlines() if "error:" in line]
    assert error == (f"diffusion generate: error: argument --adapter: must be NAME or NAME:SCALE with a finite "
                     f"number SCALE, not {value!r}")


@pytest.mark.unit
@pytest.mark.parametrize("command", [["push-weights"], ["checksum"], ["adapters"], ["adapters", "load"],
                                     ["adapters", "unload"], ["adapters", "list"]])
def test_new_commands_have_plain_help(command):
    done = cli(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert "``" not in done.stdout and done.stdout.strip()


@pytest.mark.unit
def test_adapters_needs_an_action():
    assert all(action in cli("adapters", "--help").stdout for action in ("load", "unload", "list"))
    done = cli("--target", NOBODY, "adapters")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == "diffusion adapters: error: the following arguments are required: ACTION"


# --- adapters through a real worker ---------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(serve, real_runner):
    """A worker with the tiny model, on the session's real_runner (see fixtures_worker.py)."""
    return serve(on=real_runner)


@pytest.fixture(scope="module")
def client(pair):
    with DiffusionClient(pair.worker.target, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> Path:
    return make_lora(tmp_path_factory.mktemp("loras") / "style.safetensors", seed=1)


def pixels(client: DiffusionClient, **options) -> bytes:
    return client.generate("a red fox", steps=STEPS, seed=SEED, output_format="raw", **options).images[0].data


@pytest.fixture(scope="module")
def base(client) -> bytes:
    return pixels(client)


@pytest.fixture
def style(client, lora):
    """The adapter "style" registered for one test."""
    adapter = client.load_adapter("style", lora)
    yield adapter
    if any(a.name == "style" for a in client.list_adapters().adapters):
        client.unload_adapter("style")


@pytest.mark.process
def test_sdk_loads_lists_applies_and_unloads_an_adapter(client, base, style, lora):
    assert style.name == "style" and style.path == str(lora) and style.resident and not style.pinned
    assert sorted(style.components) == ["text_encoder", "unet"]
    listed = client.list_adapters()
    assert [a.name for a in listed.adapters] == ["style"] and listed.max_adapters >= 1
    styled = pixels(client, adapters={"style": 1.0})
    assert styled != base
    assert pixels(client, adapters=[("style", 1.0)]) == styled == pixels(client, adapters=["style"])
    assert pixels(client, adapters={"style": 0.0}) == base
    with client.stream("a red fox", steps=STEPS, seed=SEED, output_format="raw", adapters=["style"]) as stream:
        [done] = [event for event in stream if isinstance(event, Done)]
    assert done.result.images[0].data == styled
    client.unload_adapter("style")
    assert not client.list_adapters().adapters
    with pytest.raises(grpc.RpcError) as refused:
        pixels(client, adapters=["style"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapters[0].name" in field_violations(refused.value)


@pytest.mark.process
def test_async_client_has_the_same_adapter_calls(pair, client, lora):
    async def scenario():
        async with AsyncDiffusionClient(pair.worker.target, timeout=60) as aio:
            adapter = await aio.load_adapter("style", lora, pin=True)
            listed = await aio.list_adapters()
            result = await aio.generate("a red fox", steps=STEPS, seed=SEED, output_format="raw",
                                        adapters={"style": 0.5})
            await aio.unload_adapter("style")
            return adapter, listed, result.images[0].data

    adapter, listed, data = asyncio.run(scenario())
    assert adapter.pinned and [a.name for a in listed.adapters] == ["style"]
    client.load_adapter("style", lora)
    try:
        assert data == pixels(client, adapters=[("style", 0.5)])
    finally:
        client.unload_adapter("style")


@pytest.mark.process
def test_cli_loads_lists_applies_and_unloads_an_adapter(pair, client, lora, base, tmp_path):
    done = cli("--target", pair.worker.target, "adapters", "load", "style", str(lora), "--pin")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"loaded adapter style (text_encoder, unet, pinned) from {lora}"
    listed = cli("--target", pair.worker.target, "adapters", "list")
    assert listed.returncode == 0, listed.stderr
    heading, row, limit = listed.stdout.splitlines()
    assert heading.split() == ["NAME", "KIND", "RESIDENT", "PINNED", "COMPONENTS", "REQUESTS", "PATH"]
    name, kind, resident, pinned, components, requests, path = row.split()
    assert (name, kind, resident, pinned, components, path) == ("style", "lora", "yes", "yes", "text_encoder,unet",
                                                                str(lora))
    assert re.fullmatch(r"at most \d+ resident at once", limit)
    output = tmp_path / "fox.raw"
    generated = cli("--target", pair.worker.target, "generate", "a red fox", "-o", str(output), "--steps", str(STEPS),
                    "--seed", str(SEED), "--format", "raw", "--adapter", "style:0.5")
    assert generated.returncode == 0, generated.stderr
    assert output.read_bytes() == pixels(client, adapters={"style": 0.5}) != base
    after = cli("--target", pair.worker.target, "adapters", "list").stdout.splitlines()[1].split()[5]
    assert int(after) == int(requests) + 2  # the CLI's request and the SDK's
    unloaded = cli("--target", pair.worker.target, "adapters", "unload", "style")
    assert unloaded.returncode == 0 and unloaded.stdout.strip() == "unloaded adapter style"
    assert cli("--target", pair.worker.target, "adapters", "list").stdout.splitlines()[0] == "no adapters"
    missing = cli("--target", pair.worker.target, "adapters", "unload", "style")
    assert missing.returncode == 1 and missing.stderr.startswith("error: NOT_FOUND: ")


# --- PushWeights through a real worker --------------------------------------------------------------

@pytest.mark.process
def test_pushing_the_models_own_unet_keeps_the_image_and_reports_the_checksum(client, base):
    tensors = unet_tensors()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    progress: list[int] = []
    reply = client.push_weights(tensors, chunk_bytes=64 * 1024, on_progress=lambda sent, _: progress.append(sent))
    assert sorted(reply.loaded_names) == sorted(tensors) and reply.bytes_received == total
    # after each message of at most 64 KiB of data, and the small tensors packed: fewer messages than tensors
    assert progress[-1] == total and total // (64 * 1024) <= len(progress) < len(tensors)
    assert pixels(client) == base
    checksum = client.weights_checksum()
    assert checksum.checksum == reply.checksum and checksum.weights_version == reply.weights_version


@pytest.mark.process
def test_async_push_of_a_file_matches_the_sync_checksum(pair, client, tmp_path):
    path = tmp_path / "unet.safetensors"
    save_file(unet_tensors(), str(path))

    async def scenario():
        async with AsyncDiffusionClient(pair.worker.target, timeout=120) as aio:
            reply = await aio.push_weights(path, chunk_bytes=256 * 1024)
            return reply, await aio.weights_checksum()

    reply, checksum = asyncio.run(scenario())
    assert checksum.checksum == reply.checksum == client.weights_checksum().checksum
    assert reply.bytes_received == path.stat().st_size - 8 - int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.process
def test_cli_push_weights_shows_progress_and_the_new_version(pair, client, base, tmp_path):
    tensors = unet_tensors()
    path = tmp_path / "unet.safetensors"
    save_file(tensors, str(path))
    done = cli("--target", pair.worker.target, "push-weights", str(path), "--chunk-bytes", str(128 * 1024))
    assert done.returncode == 0, done.stderr
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert done.stderr.rstrip().endswith(f"[{'#' * 30}] {total}/{total}"), done.stderr[-200:]
    checksum = client.weights_checksum()
    assert done.stdout.splitlines()[-1] == (f"pushed {len(tensors)} tensors ({total} bytes): weights version "
                                            f"{checksum.weights_version}, checksum {checksum.checksum}")
    assert pixels(client) == base
    shown = cli("--target", pair.worker.target, "checksum")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"checksum {checksum.checksum}, weights version {checksum.weights_version}"


@pytest.mark.process
def test_cli_push_weights_refuses_a_file_that_is_not_safetensors(pair, tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"\x00" * 16)
    done = cli("--target", pair.worker.target, "push-weights", str(path))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: {path}: "), done.stderr


@pytest.mark.process
def test_push_weights_returns_a_small_result(client):
    stored = load_file(ensure_builtin("tiny") / "unet" / "diffusion_pytorch_model.safetensors")
    tensors = {f"unet.{name}": stored[name] for name in ("conv_in.bias", "conv_in.weight")}
    result = client.push_weights(tensors)
    assert isinstance(result, PushResult)
    assert result.loaded_names == tuple(sorted(tensors)) and result.tensors == 2
    assert result.bytes_received == sum(t.numel() * t.element_size() for t in tensors.values())
    checksum = client.weights_checksum()
    assert (result.checksum, result.weights_version) == (checksum.checksum, checksum.weights_version)
    assert repr(result) == (f"PushResult(weights {result.weights_version}, checksum {result.checksum}, 2 tensors, "
                            f"{result.bytes_received} bytes)")
