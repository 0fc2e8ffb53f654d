"""LoadWeights on a real runner: all or nothing, round trips, the updates reported, and how sleep treats them."""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from diffusion.v1 import runner_pb2
from runner_calls import generate, info
from runner_service.families.sd.tiny import build_sd
from serving_common.errors import field_violations

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def stub(shared_runner):
    return shared_runner.load("tiny")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny UNet's weights as built (what the runner loaded), and a perturbed conv_in."""
    directory = tmp_path_factory.mktemp("weights")
    unet = {f"unet.{k}": v.detach().clone() for k, v in build_sd("tiny").unet.named_parameters()}
    save_file(unet, directory / "original.safetensors")
    noise = torch.Generator().manual_seed(0)
    conv_in = unet["unet.conv_in.weight"]
    save_file({"unet.conv_in.weight": conv_in + 0.5 * torch.randn(conv_in.shape, generator=noise)},
              directory / "perturbed.safetensors")
    save_file({}, directory / "empty.safetensors")
    vae_bias = build_sd("tiny").vae.decoder.conv_out.bias.detach()
    save_file({"vae.decoder.conv_out.bias": vae_bias + 0.1}, directory / "vae.safetensors")
    unknown = {"unet.conv_in.weight": conv_in, "unet.no_such.weight": conv_in.clone()}
    save_file(unknown, directory / "unknown.safetensors")
    save_file({"unet.conv_in.weight": conv_in[:1]}, directory / "wrong_shape.safetensors")
    save_file({"unet.conv_in.weight": conv_in.half()}, directory / "wrong_dtype.safetensors")
    split = directory / "split"
    split.mkdir()
    names = sorted(unet)
    save_file({n: unet[n] for n in names[: len(names) // 2]}, split / "a.safetensors")
    save_file({n: unet[n] for n in names[len(names) // 2:]}, split / "b.safetensors")
    return directory


def load(stub, path, expected_digest: str = "") -> runner_pb2.RunnerServiceLoadWeightsResponse:
    return stub.LoadWeights(runner_pb2.RunnerServiceLoadWeightsRequest(path=str(path),
                                                                       expected_digest=expected_digest))


def digest(*files) -> str:
    """sha256 of the files' bytes, in the order given (a directory's files go in name order)."""
    hashed = hashlib.sha256()
    for file in files:
        hashed.update(file.read_bytes())
    return hashed.hexdigest()


def updates(stub) -> list[tuple[str, list[str]]]:
    return [(u.digest, list(u.components)) for u in info(stub).weight_updates]


def drop_updates(stub) -> None:
    """Back to the weights as loaded: a level-2 sleep of every component forgets every update."""
    stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=2))
    stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest())
    assert updates(stub) == []


def test_round_trip_changes_then_restores_the_output(stub, files):
    start, version = generate(stub), info(stub).weights_version
    changed = load(stub, files / "perturbed.safetensors")
    assert list(changed.loaded_names) == ["unet.conv_in.weight"]
    assert changed.weights_version != version
    assert not np.array_equal(generate(stub), start)
    restored = load(stub, files / "original.safetensors")
    assert len(restored.loaded_names) == len(list(build_sd("tiny").unet.parameters()))
    assert restored.weights_version not in (version, changed.weights_version)
    assert np.array_equal(generate(stub), start)


def test_a_directory_of_files_loads_every_tensor(stub, files):
    loaded = load(stub, files / "split")
    assert len(loaded.loaded_names) == len(list(build_sd("tiny").unet.parameters()))
    assert loaded.update.digest == digest(files / "split" / "a.safetensors", files / "split" / "b.safetensors")


def test_an_empty_file_loads_nothing(stub, files):
    version, before = info(stub).weights_version, updates(stub)
    loaded = load(stub, files / "empty.safetensors")
    assert list(loaded.loaded_names) == [] and loaded.weights_version == version
    assert not loaded.HasField("update") and updates(stub) == before


def test_updates_are_reported_by_load_weights_and_listed_in_order_by_get_info(stub, files):
    drop_updates(stub)
    unet = load(stub, files / "perturbed.safetensors")
    vae = load(stub, files / "vae.safetensors")
    assert (unet.update.digest, list(unet.update.components)) == (digest(files / "perturbed.safetensors"), ["unet"])
    assert (vae.update.digest, list(vae.update.components)) == (digest(files / "vae.safetensors"), ["vae"])
    assert updates(stub) == [(unet.update.digest, ["unet"]), (vae.update.digest, ["vae"])]
    assert info(stub).weights_version == vae.weights_version


def test_level_2_sleep_drops_only_the_updates_touching_the_slept_components(stub, files):
    drop_updates(stub)
    load(stub, files / "perturbed.safetensors")
    vae = load(stub, files / "vae.safetensors")
    stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=1))
    stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest())
    assert len(updates(stub)) == 2
    stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=2, tags=["unet"]))
    assert updates(stub) == [(vae.update.digest, ["vae"])]
    stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest())
    assert updates(stub) == [(vae.update.digest, ["vae"])]


def test_an_expected_digest_must_match_or_nothing_is_loaded(stub, files):
    drop_updates(stub)
    path = files / "perturbed.safetensors"
    start, version = generate(stub), info(stub).weights_version
    wrong = "0123456789ab" + "0" * 52
    with pytest.raises(grpc.RpcError) as error:
        load(stub, path, expected_digest=wrong)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = error.value.details()
    assert str(path) in details and digest(path)[:12] in details and wrong[:12] in details, details
    assert info(stub).weights_version == version and updates(stub) == []
    assert np.array_equal(generate(stub), start)

    loaded = load(stub, path, expected_digest=digest(path))
    assert loaded.update.digest == digest(path) and loaded.weights_version != version


@pytest.mark.parametrize("name, field, words", [
    ("unknown.safetensors", "tensors[unet.no_such.weight]", "unet.no_such.weight"),
    ("wrong_shape.safetensors", "tensors[unet.conv_in.weight]", "(1, 4, 3, 3)"),
    ("wrong_dtype.safetensors", "tensors[unet.conv_in.weight]", "float16"),
    ("missing.safetensors", "path", "does not exist"),
])
def test_bad_files_are_invalid_argument_and_change_nothing(stub, files, name, field, words):
    start, version = generate(stub), info(stub).weights_version
    with pytest.raises(grpc.RpcError) as error:
        load(stub, files / name)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = field_violations(error.value)
    assert field in violations and words in (error.value.details() + violations[field])
    assert info(stub).weights_version == version
    assert np.array_equal(generate(stub), start)


def test_level_1_keeps_loaded_weights_and_level_2_drops_them(stub, files):
    load(stub, files / "original.safetensors")
    base = generate(stub)
    changed = load(stub, files / "perturbed.safetensors")
    perturbed = generate(stub)
    stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=1))
    stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest())
    assert np.array_equal(generate(stub), perturbed)
    assert info(stub).weights_version == changed.weights_version

    stub.Sleep(runner_pb2.RunnerServiceSleepRequest(level=2))
    with pytest.raises(grpc.RpcError) as error:
        load(stub, files / "perturbed.safetensors")
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stub.WakeUp(runner_pb2.RunnerServiceWakeUpRequest())
    assert np.array_equal(generate(stub), base)
    assert info(stub).weights_version != changed.weights_version
