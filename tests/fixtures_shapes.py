"""The built-in ``shapes`` model served for the prompt-adherence tests (registered in conftest.py).

``shapes_served``: three workers serving ``shapes``, each taking up to 9 images at a time
(--max-batch-size 9: eight requests and a long one that holds the batch running), their processes
started side by side (a runner's start is mostly its torch import): ``step`` on one runner that
batches at denoising steps, ``request`` on one that runs each Execute as one pipeline call
(--batching request), ``two`` on two runners that batch at steps.

``green_circles``: a LoRA adapter for ``shapes`` that draws every circle green, trained here in
seconds with peft on the transformer alone, and saved as diffusers saves a Flux LoRA (what
LoadAdapter takes).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from diffusion.v1 import worker_pb2_grpc
from harness.processes import ServiceProcess, start_runner, start_worker, worker_stub

MODEL = "shapes"
MAX_BATCH = 9


@dataclass
class Served:
    """A worker serving ``shapes`` from its runners, and a stub to it."""

    worker: ServiceProcess
    runners: list[ServiceProcess]
    stub: worker_pb2_grpc.WorkerServiceStub


def _stop_all(processes: list[ServiceProcess]) -> None:
    with ThreadPoolExecutor(len(processes) or 1) as pool:
        list(pool.map(ServiceProcess.stop, processes))


def _side_by_side(starts: list[Callable[[], ServiceProcess]], stack: contextlib.ExitStack) -> list[ServiceProcess]:
    """Runs ``starts`` in threads; those started are stopped together when ``stack`` closes, also
    when another fails to start."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    stack.callback(_stop_all, [future.result() for future in futures if future.exception() is None])
    return [future.result() for future in futures]  # raises the first failure


@pytest.fixture(scope="module")
def shapes_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    """The ``step``, ``request`` and ``two`` workers (see the module docstring), for a module."""
    log_dir = tmp_path_factory.mktemp("shapes-served")
    layout: dict[str, list[tuple[str, ...]]] = {"step": [()], "request": [("--batching", "request")],
                                                "two": [(), ()]}
    with contextlib.ExitStack() as stack:
        runner_args = [args for runners in layout.values() for args in runners]
        runners = _side_by_side([partial(start_runner, log_dir, *args) for args in runner_args], stack)
        owned: dict[str, list[ServiceProcess]] = {}
        for name, wanted in layout.items():
            owned[name], runners = runners[:len(wanted)], runners[len(wanted):]

        def worker(name: str) -> ServiceProcess:
            first, *others = owned[name]
            extra = [flag for runner in others for flag in ("--runner", runner.target)]
            return start_worker(log_dir, first.target, *extra, "--model", MODEL, "--max-batch-size", str(MAX_BATCH))

        workers = _side_by_side([partial(worker, name) for name in layout], stack)
        served = {}
        for name, process in zip(layout, workers, strict=True):
            stub = stack.enter_context(worker_stub(process.target))
            served[name] = Served(process, owned[name], stub)
        yield served


@pytest.fixture(scope="module")
def green_circles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA file for ``shapes`` that draws every circle green, whatever colour the prompt asks."""
    return train_green_circles(tmp_path_factory.mktemp("shapes-lora") / "green-circles.safetensors")


def train_green_circles(path: Path, steps: int = 30, seed: int = 0) -> Path:
    """Trains a rank-4 LoRA on the transformer's attention projections by flow matching (the loss
    of ``train_shapes``), on drawn circles of any colour but green prompted as such and drawn
    green, encoded once by the model's VAE; writes it to ``path`` as diffusers saves a Flux LoRA."""
    import numpy as np  # torch, diffusers and peft: only for the modules that ask
    import torch
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from runner_service.models.catalog import ensure_builtin
    from runner_service.models.shapes_scenes import COLOURS, POSITIONS, Scene, draw
    from runner_service.models.train_shapes import flow_matching_loss

    pipeline = FluxPipeline.from_pretrained(ensure_builtin(MODEL), dtype=torch.float32)
    for module in (pipeline.transformer, pipeline.text_encoder, pipeline.text_encoder_2, pipeline.vae):
        module.requires_grad_(False)
    pipeline.transformer.add_adapter(LoraConfig(
        r=4, lora_alpha=4, init_lora_weights="gaussian",
        target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]))
    rng = random.Random(seed)
    others = sorted(set(COLOURS) - {"green"})
    scenes = [Scene(colour, "circle", background, rng.choice(sorted(POSITIONS)))
              for colour, background in (rng.sample(others, 2) for _ in range(64))]
    pictures = np.stack([draw(Scene("green", "circle", s.background, s.position), 64, 64, rng) for s in scenes])
    vae = pipeline.vae
    with torch.no_grad():
        sample = torch.from_numpy(pictures).permute(0, 3, 1, 2).float() / 127.5 - 1
        latents = (vae.encode(sample).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    parameters = [p for p in pipeline.transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        chosen = torch.randint(0, len(scenes), (16,), generator=generator)
        loss = flow_matching_loss(pipeline, latents[chosen], [scenes[int(i)].prompt for i in chosen], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    FluxPipeline.save_lora_weights(path.parent, weight_name=path.name,
                                   transformer_lora_layers=get_peft_model_state_dict(pipeline.transformer))
    return path
