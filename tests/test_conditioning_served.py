"""ControlNets and IP-Adapters end to end (issue 39 items 2-4): a real worker and runner serving
``tiny``, with the built-in ``tiny-controlnet`` and ``tiny-ip-adapter``, through the Python client.

What the worker adds to the runner's images: registration by kind, a request's controls and image
prompt reaching the pipeline (the image changes, and scale 0 is the plain image), and the lifecycle:
both survive a level-2 sleep and a runner restart with the same images. The equality of the images
with diffusers' own pipelines is the runner's tests' (tests/test_controlnet.py, tests/test_ip_adapter.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from clients import Control, DiffusionClient, ImagePrompt
from conditioning_support import CONTROLNET, IP_ADAPTER, png
from diffusion.v1 import worker_pb2
from harness.processes import wait_until
from support import Pair

pytest.importorskip("runner_service.models.controlnets",
                    reason="the runner's ControlNets (runner_service/models/controlnets.py, issue 39 item 2) "
                           "have not landed")
pytest.importorskip("runner_service.models.tiny_ip_adapters",
                    reason="the runner's IP-Adapters (runner_service/models/tiny_ip_adapters.py, issue 39 item 3) "
                           "have not landed")

pytestmark = [pytest.mark.process, pytest.mark.timeout(600)]

SEED = 21


@pytest.fixture(scope="module")
def pair(serve: Callable[..., Pair]) -> Pair:
    return serve()


@pytest.fixture(scope="module")
def client(pair: Pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DiffusionClient]:
    """A client of ``pair``'s worker, serving tiny with ControlNet edges and IP-Adapter style registered."""
    from runner_service.models.build import main as build_model

    root = tmp_path_factory.mktemp("conditioning-built")
    with DiffusionClient(pair.worker.target, timeout=300) as client:
        for name, built_in, kind in (("edges", "tiny-controlnet", "controlnet"),
                                     ("style", "tiny-ip-adapter", "ip_adapter")):
            build_model([built_in, str(root / name)])
            client.load_adapter(name, root / name, kind=kind)
        yield client


def pixels(client: DiffusionClient, **options: object) -> np.ndarray:
    result = client.generate("a red fox", width=64, height=64, steps=3, seed=SEED, output_format="raw", **options)
    return result.images[0].to_numpy().astype(np.int16)


EDGES = png(64, 64, noise=True)
REFERENCE = png(32, 32, noise=True)


@pytest.fixture(scope="module")
def plain(client: DiffusionClient) -> np.ndarray:
    return pixels(client)


@pytest.fixture(scope="module")
def conditioned(client: DiffusionClient) -> np.ndarray:
    return pixels(client, controls=[Control("edges", EDGES)], ip_adapter=ImagePrompt("style", [REFERENCE]))


def test_the_model_takes_both_kinds_and_lists_them(client):
    assert {CONTROLNET, IP_ADAPTER} <= set(client.status().model.capabilities.adapter_kinds)
    assert {(a.name, a.kind) for a in client.list_adapters().adapters} == {("edges", CONTROLNET),
                                                                            ("style", IP_ADAPTER)}


def test_controls_and_an_image_prompt_change_the_image_and_scale_zero_does_not(client, plain, conditioned):
    assert np.abs(conditioned - plain).max() > 0
    assert np.abs(pixels(client, controls=[Control("edges", EDGES, scale=0.0)]) - plain).max() <= 1
    assert np.abs(pixels(client, ip_adapter=ImagePrompt("style", [REFERENCE], scale=0.0)) - plain).max() <= 1


def storm_requests(samplers: list[str]) -> list[dict[str, object]]:
    """24 distinct requests mixing samplers, ControlNets, image prompts and plain ones."""
    second = png(48, 40, noise=True)
    kinds: list[dict[str, object]] = [
        {},
        {"sampler": samplers[0]},
        {"sampler": samplers[-1]},
        {"controls": [Control("edges", EDGES)]},
        {"controls": [Control("edges", EDGES, scale=0.5, start=0.3, end=1.0)], "sampler": samplers[0]},
        {"ip_adapter": ImagePrompt("style", [REFERENCE])},
        {"ip_adapter": ImagePrompt("style", [REFERENCE, second], scale=0.5)},
        {"controls": [Control("edges", EDGES, scale=1.5)], "ip_adapter": ImagePrompt("style", [second], scale=0.8),
         "sampler": samplers[-1]},
    ]
    return [{"prompt": f"a lantern on a pier, study {index}", "seed": 100 + index, **kinds[index % len(kinds)]}
            for index in range(24)]


def storm_pixels(client: DiffusionClient, request: dict[str, object]) -> np.ndarray:
    options = dict(request)
    prompt = str(options.pop("prompt"))
    result = client.generate(prompt, width=64, height=64, steps=3, output_format="raw", **options)
    return result.images[0].to_numpy().astype(np.int16)


def test_a_storm_of_mixed_requests_ends_each_once_with_its_image_alone(client):
    """Issue 39's acceptance storm: 24 concurrent requests on one runner, mixing samplers, controls,
    image prompts and plain requests (so they share step batches), each answered once and each
    within 1/255 of the same request run alone."""
    samplers = [name for name in client.status().model.capabilities.samplers if name in ("euler_a", "dpmpp_2m_karras")]
    assert len(samplers) == 2, client.status().model.capabilities.samplers
    requests = storm_requests(samplers)
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda request: storm_pixels(client, request), requests))
    # Each call has its image; the worker lets go of each as its call closes (a moment after its reply).
    wait_until(lambda: (status := client.status()).requests_in_flight == 0 and status.queue_depth == 0
               and not status.active_requests, 30, "the worker to hold none of the requests")
    for request, image in zip(requests, together, strict=True):
        alone = storm_pixels(client, request)
        assert np.abs(image - alone).max() <= 1, request


def test_they_survive_a_level_two_sleep(client, conditioned):
    client.sleep(2)
    client.wake()
    assert np.abs(pixels(client, controls=[Control("edges", EDGES)],
                         ip_adapter=ImagePrompt("style", [REFERENCE])) - conditioned).max() <= 1


def test_a_restarted_runner_gets_them_again(pair, client, conditioned):
    [before] = [r.info.instance_id for r in client.status().runners]
    pair.restart_runner(signal.SIGKILL)
    wait_until(lambda: all(r.ready and r.info.instance_id != before for r in client.status().runners), 300,
               "the new runner ready, its adapters re-applied")
    assert client.status().state == worker_pb2.WORKER_STATE_READY
    held = {(a.name, a.kind) for r in client.status().runners for a in r.info.adapters}
    assert held == {("edges", CONTROLNET), ("style", IP_ADAPTER)}
    assert np.abs(pixels(client, controls=[Control("edges", EDGES)],
                         ip_adapter=ImagePrompt("style", [REFERENCE])) - conditioned).max() <= 1
