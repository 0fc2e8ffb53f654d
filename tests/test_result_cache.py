"""The result cache (issue 41 item 5): exact repeats of seeded requests answered from memory.

Unit: every field of a normalized request is in the key (input images by their bytes), the bounds
in entries and bytes drop the least recently used, a response larger than the budget is never
kept, and a clear drops everything, also what was in flight. Process: a real worker and runner
serving ``tiny`` with ``--result-cache-bytes``: the second identical seeded request (gRPC, stream and
the OpenAI HTTP API) returns identical bytes and the runner never sees it; a request without a seed
never hits; any changed parameter misses; LoadWeights, LoadAdapter, UnloadAdapter, Init, a
level-2 sleep and the reconciler's re-apply of state changed behind the worker's back drop every
entry; and the default worker keeps nothing."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import re
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from diffusion.v1 import common_pb2, runner_pb2
from diffusion.v1 import worker_pb2 as W
from diffusion.v1.worker_pb2_grpc import WorkerServiceStub as Stub
from harness.processes import ServiceProcess, wait_until
from serving_common.generation_params import Control, ImagePrompt
from support import Pair
from worker_service.result_cache import ResultCache, answered_from_memory, request_key, served_identity
from worker_service.validation import NormalizedRequest

CACHE_BYTES = 8 * 1024**2
CACHE_ENTRIES = 3
IDENTITY = served_identity(common_pb2.ModelInfo(source="tiny"), "v1", [("style", "abc")])
_ids = itertools.count()
# The runner's log line of each Execute, with the request ids of its batch.
EXECUTED = re.compile(r"execute \d+ request\(s\)[^\n]*\[request_id=([^\]]+)\]")


# -- unit: the key and the bounds ----------------------------------------------------------------

def normalized(**fields: object) -> NormalizedRequest:
    values: dict[str, object] = {"request_id": "r", "prompt": "a fox", "width": 64, "height": 64,
                                 "num_inference_steps": 4, "guidance_scale": 7.5, "seed": 1, "output_format": 1}
    return NormalizedRequest(**{**values, **fields})  # type: ignore[arg-type]


def raw(fill: int) -> runner_pb2.RawImage:
    return runner_pb2.RawImage(pixels=bytes([fill]) * 48, width=4, height=4, channels=3)


# A value other than the default for the fields whose type says nothing of one.
OTHER_VALUES: dict[str, object] = {
    "adapters": (("style", 0.5),), "controls": (Control("edges"),), "ip_adapter": ImagePrompt("face"),
    "image": raw(1), "mask_image": raw(2), "control_images": (raw(3),), "prompt_images": (raw(4),),
    "true_cfg_scale": 2.0, "cache_threshold": 0.2, "strength": 0.5, "task": common_pb2.TASK_IMAGE_TO_IMAGE,
}


def other_value(name: str, value: object) -> object:
    if name in OTHER_VALUES:
        return OTHER_VALUES[name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 3
    if isinstance(value, str):
        return value + " changed"
    raise AssertionError(f"NormalizedRequest.{name}: give OTHER_VALUES a value of it, so its key is tested")


@pytest.mark.unit
def test_every_field_but_the_request_id_is_in_the_key() -> None:
    base = normalized()
    key = request_key(base, IDENTITY)
    assert request_key(dataclasses.replace(base, request_id="another"), IDENTITY) == key
    for field in dataclasses.fields(NormalizedRequest):
        if field.name != "request_id":
            changed = dataclasses.replace(base, **{field.name: other_value(field.name, getattr(base, field.name))})
            assert request_key(changed, IDENTITY) != key, field.name


@pytest.mark.unit
def test_input_images_are_keyed_by_their_bytes() -> None:
    with_image = normalized(image=raw(1))
    assert request_key(with_image, IDENTITY) == request_key(normalized(image=raw(1)), IDENTITY)
    assert request_key(with_image, IDENTITY) != request_key(normalized(image=raw(9)), IDENTITY)


@pytest.mark.unit
def test_what_serves_is_in_the_key_but_not_what_changes_while_it_serves() -> None:
    model = common_pb2.ModelInfo(source="tiny", revision="abc", dtype=common_pb2.DTYPE_FLOAT32)
    identity = served_identity(model, "v1", [("style", "d1")])
    asleep = common_pb2.ModelInfo()
    asleep.CopyFrom(model)
    asleep.components.add(name="unet", asleep=True)
    asleep.costs.add(pixels=4096, step_ms=3.0)
    assert served_identity(asleep, "v1", [("style", "d1")]) == identity
    others = [served_identity(model, "v2", [("style", "d1")]), served_identity(model, "v1", [("style", "d2")]),
              served_identity(model, "v1", []),
              served_identity(common_pb2.ModelInfo(source="tiny", revision="def", dtype=common_pb2.DTYPE_FLOAT32),
                              "v1", [("style", "d1")]),
              served_identity(common_pb2.ModelInfo(source="tiny", revision="abc", dtype=common_pb2.DTYPE_FLOAT32,
                                                   acceleration=common_pb2.Acceleration(compile=True)),
                              "v1", [("style", "d1")])]
    assert identity not in others and len(set(others)) == len(others)


def response(size: int, tag: int = 0) -> W.GenerateResponse:
    return W.GenerateResponse(request_id=f"req-{tag}", images=[W.Image(data=bytes([tag % 256]) * size, seed=tag)],
                              timings=W.Timings(execute_ms=5.0, total_ms=9.0))


def stored(cache: ResultCache, seed: int) -> W.GenerateResponse | None:
    lookup = cache.lookup(normalized(seed=seed), seeded=True)
    assert lookup is not None
    return cache.get(lookup)


def store(cache: ResultCache, seed: int, size: int = 100) -> None:
    lookup = cache.lookup(normalized(seed=seed), seeded=True)
    assert lookup is not None
    cache.put(lookup, response(size, seed))


@pytest.mark.unit
def test_a_hit_is_the_response_less_its_request_id_and_timings() -> None:
    cache = ResultCache(10_000, 10, lambda: IDENTITY)
    store(cache, 1)
    hit = stored(cache, 1)
    assert hit is not None and hit.images[0].data == bytes([1]) * 100 and hit.images[0].seed == 1
    assert hit.request_id == "" and not hit.HasField("timings")
    assert cache.stats().hits == 1 and cache.stats().misses == 0
    assert stored(cache, 2) is None and cache.stats().misses == 1


@pytest.mark.unit
def test_off_without_a_seed_or_with_previews_nothing_is_looked_up() -> None:
    assert ResultCache(0, 10, lambda: IDENTITY).lookup(normalized(), seeded=True) is None
    cache = ResultCache(10_000, 10, lambda: IDENTITY)
    assert cache.lookup(normalized(), seeded=False) is None
    assert cache.lookup(normalized(partial_images=2), seeded=True) is None


@pytest.mark.unit
def test_the_entry_bound_drops_the_least_recently_used() -> None:
    cache = ResultCache(1_000_000, 2, lambda: IDENTITY)
    store(cache, 1)
    store(cache, 2)
    assert stored(cache, 1) is not None  # 2 is now the least recently used
    store(cache, 3)
    assert stored(cache, 2) is None
    assert stored(cache, 1) is not None and stored(cache, 3) is not None
    assert cache.stats().entries == 2


@pytest.mark.unit
def test_the_byte_bound_drops_the_oldest_and_never_keeps_a_larger_response() -> None:
    cache = ResultCache(2_000, 100, lambda: IDENTITY)
    store(cache, 1, size=500)
    store(cache, 2, size=500)
    assert cache.stats().entries == 2 and cache.stats().bytes <= 2_000
    store(cache, 3, size=500)
    assert stored(cache, 1) is None and stored(cache, 2) is not None and stored(cache, 3) is not None
    assert cache.stats().entries == 2 and cache.stats().bytes <= 2_000
    store(cache, 4, size=2_000)  # more than the whole budget: not kept, nothing dropped for it
    assert stored(cache, 4) is None
    assert stored(cache, 2) is not None and stored(cache, 3) is not None


@pytest.mark.unit
def test_a_clear_drops_every_entry_and_what_was_looked_up_before_it() -> None:
    cache = ResultCache(10_000, 10, lambda: IDENTITY)
    store(cache, 1)
    in_flight = cache.lookup(normalized(seed=2), seeded=True)
    assert in_flight is not None
    cache.clear()
    assert stored(cache, 1) is None and cache.stats().entries == 0 and cache.stats().bytes == 0
    cache.put(in_flight, response(100, 2))  # it ran on what was there before the change
    assert stored(cache, 2) is None
    store(cache, 2)
    assert stored(cache, 2) is not None


# -- process: a real worker and runner -----------------------------------------------------------

@pytest.fixture(scope="module")
def pair(serve) -> Pair:
    """A worker keeping results (the module's CACHE_BYTES and CACHE_ENTRIES), with metrics and the HTTP API."""
    return serve("--result-cache-bytes", str(CACHE_BYTES), "--result-cache-entries", str(CACHE_ENTRIES),
                 http=True, metrics=True)


def seeded(**fields: object) -> W.GenerateRequest:
    """A 64x64, 4-step PNG request of seed 5 under a new request id; ``fields`` replace any of it."""
    values: dict[str, object] = {"prompt": "a lighthouse", "width": 64, "height": 64, "num_inference_steps": 4,
                                 "seed": 5, "output_format": W.OUTPUT_FORMAT_PNG}
    return W.GenerateRequest(request_id=f"cache-{next(_ids)}", **{**values, **fields})


def executed(runner: ServiceProcess, request_id: str) -> bool:
    """Whether the runner's log shows an Execute of ``request_id`` (alone or in a batch)."""
    return any(request_id in ids.split(",") for ids in EXECUTED.findall(runner.log()))


def ran(pair: Pair, response: W.GenerateResponse) -> bool:
    """Whether ``response`` was generated (the runner executed it), not answered from memory."""
    if answered_from_memory(response):
        return False
    wait_until(lambda: executed(pair.runner, response.request_id), 30,
               f"the runner's log of {response.request_id}")
    return True


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.process
def test_a_seeded_repeat_returns_identical_bytes_and_never_reaches_the_runner(pair: Pair, stub: Stub) -> None:
    before = metrics(pair.metrics_url)
    first = stub.Generate(seeded(), timeout=60)
    second = stub.Generate(seeded(), timeout=60)
    assert ran(pair, first)
    assert [i.data for i in second.images] == [i.data for i in first.images]
    assert [i.parameters for i in second.images] == [i.parameters for i in first.images]
    assert second.request_id != first.request_id and second.weights_version == first.weights_version
    assert second.timings.execute_ms == 0 and not second.timings.HasField("runner") and second.timings.total_ms > 0
    assert not executed(pair.runner, second.request_id)
    after = metrics(pair.metrics_url)
    assert after["diffusion_result_cache_hits_total"] == before["diffusion_result_cache_hits_total"] + 1
    assert after["diffusion_result_cache_misses_total"] == before["diffusion_result_cache_misses_total"] + 1
    assert after["diffusion_result_cache_entries"] >= 1 and after["diffusion_result_cache_bytes"] > 0


@pytest.mark.process
def test_a_stream_hit_sends_only_the_result(pair: Pair, stub: Stub) -> None:
    request = seeded(prompt="a stream of lights")
    first = [e for e in stub.GenerateStream(W.GenerateStreamRequest(request=request), timeout=60)]
    request.request_id = f"cache-{next(_ids)}"
    second = list(stub.GenerateStream(W.GenerateStreamRequest(request=request), timeout=60))
    assert any(e.HasField("progress") for e in first) and ran(pair, first[-1].done)
    assert [e.WhichOneof("event") for e in second] == ["done"]
    assert second[0].done.images[0].data == first[-1].done.images[0].data
    assert answered_from_memory(second[0].done)


@pytest.mark.process
def test_the_http_api_gets_hits_too(pair: Pair, stub: Stub) -> None:
    client = openai.OpenAI(base_url=pair.base_url, api_key="unused", max_retries=0, timeout=60)
    hits = metrics(pair.metrics_url)["diffusion_result_cache_hits_total"]
    asked = {"prompt": "a lighthouse over http", "size": "64x64", "extra_body": {"seed": 9, "num_inference_steps": 4}}
    first, second = client.images.generate(**asked), client.images.generate(**asked)  # type: ignore[call-overload]
    assert base64.b64decode(second.data[0].b64_json) == base64.b64decode(first.data[0].b64_json)
    assert first.model_extra["timings"]["execute_ms"] > 0 and second.model_extra["timings"]["execute_ms"] == 0
    streamed = list(client.images.generate(**asked, stream=True))  # type: ignore[call-overload]
    assert [base64.b64decode(event.b64_json) for event in streamed] == [base64.b64decode(first.data[0].b64_json)]
    assert metrics(pair.metrics_url)["diffusion_result_cache_hits_total"] == hits + 2  # the repeat, the stream


@pytest.mark.process
def test_a_request_without_a_seed_never_hits(pair: Pair, stub: Stub) -> None:
    unseeded = seeded(prompt="a lighthouse, any seed")
    unseeded.ClearField("seed")
    first = stub.Generate(unseeded, timeout=60)
    unseeded.request_id = f"cache-{next(_ids)}"
    second = stub.Generate(unseeded, timeout=60)
    assert ran(pair, first) and ran(pair, second)
    # Its seed, sent explicitly, is a request of its own: it ran once without the cache seeing it.
    again = stub.Generate(seeded(prompt="a lighthouse, any seed", seed=first.images[0].seed), timeout=60)
    assert ran(pair, again) and again.images[0].data == first.images[0].data


@pytest.mark.process
@pytest.mark.parametrize("change", [
    {"prompt": "a lighthouse at night"}, {"negative_prompt": "fog"}, {"seed": 6}, {"num_inference_steps": 3},
    {"guidance_scale": 3.0}, {"width": 72}, {"num_images": 2}, {"output_format": W.OUTPUT_FORMAT_JPEG},
    {"output_format": W.OUTPUT_FORMAT_RAW}, {"sampler": "euler"},
], ids=lambda change: "-".join(f"{k}={v}" for k, v in change.items()))
def test_changing_any_parameter_misses(pair: Pair, stub: Stub, change: dict[str, object]) -> None:
    stub.Generate(seeded(prompt="a lighthouse to vary"), timeout=60)
    assert answered_from_memory(stub.Generate(seeded(prompt="a lighthouse to vary"), timeout=60))
    changed = stub.Generate(seeded(**{"prompt": "a lighthouse to vary", **change}), timeout=60)
    assert ran(pair, changed)


@pytest.mark.process
def test_the_entry_bound_drops_the_oldest(pair: Pair, stub: Stub) -> None:
    prompts = [f"lighthouse number {n}" for n in range(CACHE_ENTRIES + 1)]
    for prompt in prompts:
        assert ran(pair, stub.Generate(seeded(prompt=prompt), timeout=60))
    assert answered_from_memory(stub.Generate(seeded(prompt=prompts[-1]), timeout=60))
    assert ran(pair, stub.Generate(seeded(prompt=prompts[0]), timeout=60))


def cached_then(stub: Stub, prompt: str) -> W.GenerateRequest:
    """A request whose response the cache now holds."""
    stub.Generate(seeded(prompt=prompt), timeout=60)
    assert answered_from_memory(stub.Generate(seeded(prompt=prompt), timeout=60))
    return seeded(prompt=prompt)


@pytest.mark.process
def test_a_level_1_sleep_keeps_the_entries_and_a_level_2_sleep_drops_them(pair: Pair, stub: Stub) -> None:
    request = cached_then(stub, "a lighthouse asleep")
    stub.Sleep(W.SleepRequest(level=1), timeout=60)
    stub.WakeUp(W.WakeUpRequest(), timeout=60)
    assert answered_from_memory(stub.Generate(request, timeout=60))
    stub.Sleep(W.SleepRequest(level=2), timeout=60)
    stub.WakeUp(W.WakeUpRequest(), timeout=60)
    request.request_id = f"cache-{next(_ids)}"
    assert ran(pair, stub.Generate(request, timeout=60))


@pytest.mark.process
def test_load_weights_and_init_drop_every_entry(pair: Pair, stub: Stub, tmp_path) -> None:
    from runner_calls import perturbed_weights  # torch: only for this test

    request = cached_then(stub, "a lighthouse reweighted")
    before = stub.Generate(request, timeout=60)
    path = tmp_path / "perturbed.safetensors"
    perturbed_weights(path)
    loaded = stub.LoadWeights(W.LoadWeightsRequest(path=str(path)), timeout=120)
    after = stub.Generate(seeded(prompt="a lighthouse reweighted"), timeout=60)
    assert ran(pair, after) and after.weights_version == loaded.weights_version
    assert after.images[0].data != before.images[0].data
    stub.Init(W.InitRequest(model="tiny"), timeout=120)
    again = stub.Generate(seeded(prompt="a lighthouse reweighted"), timeout=60)
    assert ran(pair, again) and again.images[0].data == before.images[0].data


@pytest.mark.process
def test_loading_and_unloading_an_adapter_drop_every_entry(pair: Pair, stub: Stub, tmp_path) -> None:
    from lora_files import make_lora  # torch: only for this test

    lora = make_lora(tmp_path / "style.safetensors", seed=1)
    request = cached_then(stub, "a lighthouse in style")
    stub.LoadAdapter(W.LoadAdapterRequest(name="style", path=str(lora)), timeout=120)
    assert ran(pair, stub.Generate(request, timeout=60))
    styled = seeded(prompt="a lighthouse in style", adapters=[common_pb2.AdapterRef(name="style", scale=1.0)])
    stub.Generate(styled, timeout=60)
    styled.request_id = f"cache-{next(_ids)}"
    assert answered_from_memory(stub.Generate(styled, timeout=60))
    stub.UnloadAdapter(W.UnloadAdapterRequest(name="style"), timeout=60)
    assert ran(pair, stub.Generate(seeded(prompt="a lighthouse in style"), timeout=60))


# The worker's log line of a runner brought to the desired state by a (re-)apply that loaded it.
REAPPLIED = re.compile(r"runner \S+ ready \(instance [^)]*\)$", re.MULTILINE)


@pytest.mark.process
def test_a_re_apply_after_a_change_behind_the_workers_back_drops_every_entry(pair: Pair, stub: Stub, tmp_path) -> None:
    """A LoadWeights sent to the runner directly changes its weights behind the worker's back; the
    reconciler finds it holding state the worker did not ask for and loads the desired state again,
    which need not be what the entries were made from (a model directory whose files changed loads
    under the same identity): every entry is dropped, and the repeat is generated again."""
    from runner_calls import perturbed_weights, runner_stub  # torch: only for this test

    request = cached_then(stub, "a lighthouse behind the back")
    log = pair.worker.log
    reapplies = len(REAPPLIED.findall(log()))
    path = tmp_path / "behind.safetensors"
    perturbed_weights(path, seed=3)
    runner_stub(pair.runner.target).LoadWeights(
        runner_pb2.RunnerServiceLoadWeightsRequest(path=str(path)), timeout=120)
    wait_until(lambda: len(REAPPLIED.findall(log())) > reapplies, 60, "the reconciler's re-apply")
    assert "holds state the worker did not ask for" in log()
    hits = metrics(pair.metrics_url)["diffusion_result_cache_hits_total"]
    assert ran(pair, stub.Generate(request, timeout=60))
    assert metrics(pair.metrics_url)["diffusion_result_cache_hits_total"] == hits


@pytest.mark.process
def test_the_default_worker_keeps_nothing(tiny_pair: Pair, tiny_stub: Stub) -> None:
    first = tiny_stub.Generate(seeded(prompt="a lighthouse, uncached"), timeout=60)
    second = tiny_stub.Generate(seeded(prompt="a lighthouse, uncached"), timeout=60)
    assert not answered_from_memory(second) and second.images[0].data == first.images[0].data
    wait_until(lambda: executed(tiny_pair.runner, second.request_id), 30, "the runner's log of the repeat")
