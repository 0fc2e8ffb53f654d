"""Names users know and per-model defaults (issue 38 items 5 and 6), with real processes.

One worker, on the session's runner, serves a copy of ``tiny`` whose generation_config.json says 3
steps, no guidance and 32x48, under two ``--served-model-name`` names, with the HTTP API on. The real
OpenAI SDK lists the names, generates under one and gets 404 for another; a request that sets
nothing gets the file's defaults, as GetStatus shows them. The last test switches the worker to the
built-in ``tiny`` (no file: the flags' defaults apply, under its own name), which leaves the runner
serving tiny as the session's other modules expect. A file that cannot be read as defaults stops
its load with the reason. The precedence itself is checked in-process.
"""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from diffusion.v1 import common_pb2, worker_pb2
from runner_calls import tiny_model_copy
from runner_service.generation_config import read_generation_defaults
from runner_service.model_roots import ModelRoots
from serving_common.errors import ServiceError
from worker_service.config import FALLBACK_GUIDANCE, Limits
from worker_service.generation_defaults import defaults_in_force
from worker_service.served_names import ServedNames
from worker_service.validation import normalize

NAMES = ["distilled", "team/distilled-v1"]
FILE_DEFAULTS = {"num_inference_steps": 3, "guidance_scale": 0.0, "width": 32, "height": 48, "sampler": "later"}
# The worker's own defaults, for a model without a file of its own.
FLAGS = ("--default-steps", "2", "--default-size", "40", "--default-guidance", "1.5")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tiny_model_copy(tmp_path_factory.mktemp("distilled") / "tiny-distilled")
    (directory / "generation_config.json").write_text(json.dumps(FILE_DEFAULTS))
    return directory


@pytest.fixture(scope="module")
def pair(serve, real_runner, model_dir):
    return serve("--model", str(model_dir), *[arg for name in NAMES for arg in ("--served-model-name", name)], *FLAGS,
                 on=real_runner, http=True)


def sdk(pair) -> openai.OpenAI:
    return openai.OpenAI(base_url=pair.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.process
def test_models_lists_each_served_name(pair):
    assert [model.id for model in sdk(pair).models.list().data] == NAMES


@pytest.mark.process
@pytest.mark.parametrize("name", NAMES)
def test_a_generation_naming_a_served_name_is_served(pair, name):
    result = sdk(pair).images.generate(model=name, prompt="a fox", size="32x32",
                                       extra_body={"num_inference_steps": 1, "seed": 1})
    assert len(result.data) == 1 and result.data[0].b64_json


@pytest.mark.process
@pytest.mark.parametrize("asked", ["dall-e-3", "tiny-distilled"])  # the directory's own name is not served
def test_another_name_is_404_naming_the_served_names(pair, asked):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk(pair).images.generate(model=asked, prompt="a fox", size="32x32", extra_body={"num_inference_steps": 1})
    error = caught.value.body
    assert caught.value.status_code == 404 and error["param"] == "model" and error["type"] == "not_found_error"
    assert f"model {asked!r} is not served here" in error["message"], error
    assert all(repr(name) in error["message"] for name in NAMES), error


@pytest.mark.process
def test_getstatus_shows_the_served_names_and_the_models_own_defaults(stub):
    status = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    assert list(status.served_model_names) == NAMES
    expected = common_pb2.GenerationDefaults(num_inference_steps=3, guidance_scale=0.0, width=32, height=48)
    assert status.model.defaults == expected  # what the runner read
    assert status.defaults == expected  # what is in force
    assert status.defaults.HasField("guidance_scale")


@pytest.mark.process
def test_a_request_that_sets_nothing_gets_the_models_defaults(stub):
    def steps_run() -> int:
        return stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10).statistics.denoising_steps

    before = steps_run()
    [image] = stub.Generate(worker_pb2.GenerateRequest(prompt="a fox", seed=3), timeout=120).images
    assert (image.width, image.height) == (32, 48)
    assert (image.parameters["steps"], image.parameters["cfg_scale"]) == (3, 0)
    assert steps_run() - before == 3  # counted as run, not as the flag's 2
    [image] = stub.Generate(worker_pb2.GenerateRequest(prompt="a fox", seed=3, num_inference_steps=1, width=24,
                                                       height=24, guidance_scale=2.0), timeout=120).images
    assert (image.width, image.height, image.parameters["steps"], image.parameters["cfg_scale"]) == (24, 24, 1, 2)


@pytest.mark.process
def test_a_generation_config_that_is_not_defaults_stops_the_load_with_the_reason(stub, model_dir, tmp_path):
    bad = tiny_model_copy(tmp_path / "bad")
    (bad / "generation_config.json").write_text(json.dumps({"num_inference_steps": "four", "guidance_scale": -1}))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Init(worker_pb2.InitRequest(model=str(bad)), timeout=120)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "generation_config.json" in caught.value.details()
    assert "num_inference_steps must be a whole number" in caught.value.details()
    assert "guidance_scale must be a number from 0" in caught.value.details()
    status = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)  # the model loaded keeps serving
    assert (status.state, status.model.source, list(status.served_model_names)) == (
        worker_pb2.WORKER_STATE_READY, str(model_dir), NAMES)


@pytest.mark.process
def test_without_a_file_the_flags_apply_and_the_model_is_named_by_its_source(pair, stub):
    stub.Init(worker_pb2.InitRequest(model="tiny"), timeout=120)  # last: leaves the runner serving tiny
    status = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    assert list(status.served_model_names) == ["tiny"]
    assert status.defaults == common_pb2.GenerationDefaults(num_inference_steps=2, guidance_scale=1.5, width=40,
                                                            height=40)
    [image] = stub.Generate(worker_pb2.GenerateRequest(prompt="a fox", seed=3), timeout=120).images
    assert (image.width, image.height, image.parameters["steps"], image.parameters["cfg_scale"]) == (40, 40, 2, 1.5)
    assert [model.id for model in sdk(pair).models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as caught:
        sdk(pair).images.generate(model=NAMES[0], prompt="a fox", size="32x32")
    assert "this worker serves 'tiny'" in caught.value.body["message"]


# -- in-process ------------------------------------------------------------------------------------

CFG = common_pb2.GUIDANCE_KIND_CLASSIFIER_FREE


def model(defaults: common_pb2.GenerationDefaults | None = None, guidance: int = CFG,
          family_guidance: float = 3.5) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        source="m", size_multiple=16, min_size=32, max_size=1024, defaults=defaults,
        capabilities=common_pb2.ModelCapabilities(guidance=guidance, default_guidance_scale=family_guidance))


@pytest.mark.unit
def test_guidance_comes_from_the_file_then_the_flag_then_the_family() -> None:
    limits, flagged = Limits(), Limits(default_guidance=1.0)
    from_file = common_pb2.GenerationDefaults(guidance_scale=0.0)
    assert defaults_in_force(model(from_file), flagged).guidance_scale == 0.0
    assert defaults_in_force(model(), flagged).guidance_scale == 1.0
    assert defaults_in_force(model(), limits).guidance_scale == 3.5
    assert defaults_in_force(model(family_guidance=0.0), limits).guidance_scale == FALLBACK_GUIDANCE
    assert defaults_in_force(None, limits).guidance_scale == FALLBACK_GUIDANCE
    # A model that takes no guidance gets none, whatever is set.
    assert defaults_in_force(model(from_file, common_pb2.GUIDANCE_KIND_NONE), flagged).guidance_scale == 0.0


@pytest.mark.unit
def test_sizes_and_steps_come_from_the_file_else_the_flags_on_the_models_grid() -> None:
    limits = Limits(default_size=40, default_steps=9)
    assert defaults_in_force(model(), limits) == common_pb2.GenerationDefaults(
        num_inference_steps=9, guidance_scale=3.5, width=48, height=48)  # 40 rounded up onto 16s
    own = common_pb2.GenerationDefaults(num_inference_steps=4, width=64)
    assert defaults_in_force(model(own), limits) == common_pb2.GenerationDefaults(
        num_inference_steps=4, guidance_scale=3.5, width=64, height=48)
    request = normalize(worker_pb2.GenerateRequest(prompt="a fox"), limits, (), model=model(own))
    assert (request.num_inference_steps, request.width, request.height, request.guidance_scale) == (4, 64, 48, 3.5)


@pytest.mark.unit
def test_served_names_stand_for_the_model_flag_only() -> None:
    served = ServedNames("m", ("a", "b", "a", ""))
    assert served.of(model()) == ("a", "b")
    assert served.of(common_pb2.ModelInfo(source="other")) == ("other",)
    assert served.of(None) == ()
    assert ServedNames("m", ()).of(model()) == ("m",)
    # A Hugging Face id a restarted runner loads at the commit it was pinned to is still --model.
    pinned = common_pb2.ModelInfo(source="acme/tiny@0123abcd", revision="0123abcd")
    assert ServedNames("acme/tiny", ("fox",)).of(pinned) == ("fox",)
    assert ServedNames("acme/tiny", ()).of(pinned) == ("acme/tiny",)
    assert ServedNames("acme/other", ()).of(pinned) == ("acme/tiny@0123abcd",)


@pytest.mark.unit
@pytest.mark.parametrize("content, words", [
    ("{", "is not JSON"),
    ("[4]", "must hold a JSON object, got list"),
    ('{"num_inference_steps": 0}', "num_inference_steps must be a whole number from 1"),
    ('{"num_inference_steps": true}', "num_inference_steps must be a whole number from 1"),
    ('{"width": 7.5}', "width must be a whole number from 1"),
    ('{"guidance_scale": NaN}', "guidance_scale must be a number from 0 to 100"),
    ('{"guidance_scale": "none"}', "guidance_scale must be a number from 0 to 100"),
])
def test_a_generation_config_that_is_not_defaults_is_refused_naming_source(tmp_path, content, words) -> None:
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ServiceError) as caught:
        read_generation_defaults(tmp_path, ModelRoots())
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    [(field, description)] = caught.value.violations
    assert field == "source" and words in description, description


@pytest.mark.unit
def test_a_generation_config_gives_what_it_sets_and_nothing_else(tmp_path) -> None:
    assert read_generation_defaults(tmp_path, ModelRoots()).to_proto() == common_pb2.GenerationDefaults()
    (tmp_path / "generation_config.json").write_text('{"num_inference_steps": 4, "guidance_scale": 0, "foo": 1}')
    defaults = read_generation_defaults(tmp_path, ModelRoots()).to_proto()
    assert defaults == common_pb2.GenerationDefaults(num_inference_steps=4, guidance_scale=0.0)
    assert defaults.HasField("guidance_scale") and not defaults.width
