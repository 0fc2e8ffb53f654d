"""No host sync inside a denoising step (issue 40 item 3), counted on CPU by ``host_syncs.HostSyncs``:
the scalar reads, value-dependent shapes and copies to the host that would make the host wait for an
accelerator, on tensors derived from the model's weights and the sequences' latents, timesteps and
prompts. A step batch (one image joining a step late) steps with none; the decode of finished images
copies them to the host once, as uint8. Where a diffusers scheduler reads a timestep on the host
inside its own ``step`` (DDIM, PNDM, LCM index their ``alphas_cumprod`` by it), every read is in
diffusers' scheduler module, none in ours; the step cache reads its skip decisions once per denoiser
call, which is what lets it skip the computation of the rows it skips."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline

from host_syncs import Counts, HostSyncs
from runner_service.acceleration.row_cache import RowCache
from runner_service.denoising.loop import DenoisingLoop, Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families import loop_for
from runner_service.models.catalog import ensure_builtin
from runner_service.step_engine import decode_finished

pytestmark = pytest.mark.unit

SIZE, STEPS = 64, 4  # PNDM needs 4 or more


def _pipeline(name: str) -> DiffusionPipeline:
    pipeline = DiffusionPipeline.from_pretrained(ensure_builtin(name), dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def tiny() -> DiffusionPipeline:
    return _pipeline("tiny")


@pytest.fixture(scope="module")
def tiny_flux() -> DiffusionPipeline:
    return _pipeline("tiny-flux")


def _loop(pipeline: DiffusionPipeline) -> DenoisingLoop:
    loop = loop_for(pipeline, torch.device("cpu"))
    assert loop is not None
    return loop


def _watched(pipeline: DiffusionPipeline) -> HostSyncs:
    syncs = HostSyncs()
    syncs.modules_on_device(module for module in pipeline.components.values() if isinstance(module, torch.nn.Module))
    return syncs


def _start(loop: DenoisingLoop, syncs: HostSyncs, spec: SequenceSpec) -> Sequence:
    """A sequence started outside the count (its start encodes prompts and draws latents), its tensors on the device."""
    syncs.counting = False
    sequence = loop.start(spec, PromptCache(0), "")
    syncs.on_device([sequence.latents, sequence.timesteps, *sequence.conditioning.values()])
    syncs.counting = True
    return sequence


def _steps(loop: DenoisingLoop, syncs: HostSyncs, specs: list[SequenceSpec],
           cache: RowCache | None = None) -> Iterator[tuple[Counts, list[Sequence]]]:
    """Steps a batch of ``specs`` (the second joining after the first step) to its end; yields each
    step's counts and the sequences it finished, decoded after the counts were taken."""
    running = [_start(loop, syncs, specs[0])]
    joining = specs[1:]
    while running:
        loop.step(running, cache)
        counts = syncs.take()
        finished = [sequence for sequence in running if sequence.finished]
        yield counts, finished
        running = [sequence for sequence in running if not sequence.finished]
        if joining:
            running.append(_start(loop, syncs, joining.pop(0)))


@pytest.mark.parametrize("sampler", ["euler", "euler_a", "dpmpp_2m", "unipc"])
def test_a_step_batch_steps_without_a_host_sync_and_copies_each_decode_once(tiny: DiffusionPipeline,
                                                                            sampler: str) -> None:
    loop, syncs = _loop(tiny), _watched(tiny)
    specs = [SequenceSpec("a red circle", "", SIZE, SIZE, STEPS, 4.0, 1, (), sampler=sampler),
             SequenceSpec("a blue square", "", SIZE, SIZE, STEPS, 1.0, 2, (), sampler=sampler)]
    decodes = []
    with torch.inference_mode(), syncs:
        for counts, finished in _steps(loop, syncs, specs):
            assert counts.syncs == [], f"a step waited for the device: {counts.events}"
            if finished:
                pixels = decode_finished(loop, finished)
                decodes.append((syncs.take(), len(finished), pixels))
    assert len(decodes) == 2, "each image finished at its own step"
    for counts, images, pixels in decodes:
        assert counts.transfers == ["Tensor.cpu"], "one copy to the host per decode"
        assert counts.scalar_reads == counts.data_dependent == []
        assert counts.bytes_to_host == images * SIZE * SIZE * 3, "the copy is of uint8 pixels"
        assert all(image.dtype.name == "uint8" and image.shape == (SIZE, SIZE, 3) for image in pixels.values())


@pytest.mark.parametrize("sampler", ["", "pndm", "lcm"], ids=["own-ddim", "pndm", "lcm"])
def test_schedulers_that_read_the_timestep_do_it_in_their_own_step(tiny: DiffusionPipeline, sampler: str) -> None:
    """tiny's own DDIM, PNDM and LCM read the device timestep on the host in ``step`` (diffusers'
    code, as in the pipeline's own loop): every read is counted there, none in the runner's code."""
    loop, syncs = _loop(tiny), _watched(tiny)
    specs = [SequenceSpec("a red circle", "", SIZE, SIZE, STEPS, 4.0, 1, (), sampler=sampler),
             SequenceSpec("a blue square", "", SIZE, SIZE, STEPS, 1.0, 2, (), sampler=sampler)]
    origins: list[str] = []
    with torch.inference_mode(), syncs:
        for counts, _ in _steps(loop, syncs, specs):
            assert counts.transfers == [] and counts.data_dependent == []
            origins.extend(counts.origins)
    assert origins, "these schedulers do read the timestep"
    assert {origin.partition(":")[0] for origin in origins} <= {
        "diffusers/schedulers/scheduling_ddim.py", "diffusers/schedulers/scheduling_pndm.py",
        "diffusers/schedulers/scheduling_lcm.py"}, Counter(origins)


def test_the_step_cache_reads_its_decisions_once_per_call(tiny_flux: DiffusionPipeline) -> None:
    """tiny-flux with the first block cache (threshold high enough to skip): a step reads nothing
    until a row has a cached step to compare with, then one batched read of the rows' decisions."""
    loop, syncs = _loop(tiny_flux), _watched(tiny_flux)
    cache = RowCache(tiny_flux.transformer, 10.0, 0)
    specs = [SequenceSpec("a red circle", "", SIZE, SIZE, 4, 4.0, 1, (), true_cfg=2.0),
             SequenceSpec("a blue square", "", SIZE, SIZE, 4, 1.0, 2, ())]
    try:
        with torch.inference_mode(), syncs:
            per_step = [(counts, [s.done for s in finished]) for counts, finished in _steps(loop, syncs, specs, cache)]
    finally:
        cache.remove()
    assert cache.rows_skipped > 0
    assert per_step[0][0].syncs == [], "no row has a cached step at the first step"
    for counts, _ in per_step[1:]:
        assert counts.syncs == ["Tensor.tolist"], counts.events
        assert "runner_service/acceleration/row_cache.py:" in counts.origins[0]
    with torch.inference_mode(), syncs:
        assert all(counts.syncs == [] for counts, _ in _steps(loop, syncs, specs)), "no cache, no read"
