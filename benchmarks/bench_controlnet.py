"""What a ControlNet costs per denoising step in the step loop, and what a plain request pays for
sharing its steps with a controlled one (issue 39 item 2), on the CPU.

``python -m benchmarks.bench_controlnet [--model tiny] [--steps 400]`` loads a built-in model
(float32, one thread) with its built-in ControlNet (``tiny-controlnet`` for ``tiny``,
``tiny-flux-controlnet`` for ``tiny-flux``...) and times single ``DenoisingLoop.step`` calls at
64 x 64 with guidance, four arrangements interleaved step by step (so that the machine's load falls
on all alike), each sequence restarted when it finishes:

- ``plain``: one plain image;
- ``controlled``: one image with the ControlNet over all its steps;
- ``plain pair``: two plain images in one step (one denoiser call);
- ``mixed pair``: a plain and a controlled image in one step.

It prints each arrangement's median step and the two differences that answer the questions:
``controlled - plain`` is what the ControlNet adds to a step of its image, and ``mixed pair - plain
pair`` what a controlled row adds to a shared step. Where the second equals the first, the plain row
of the mixed pair pays nothing beyond the shared step (its zero residuals cost nothing measurable).
Writes ``results/controlnet.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from runner_service.adapter_stores import AdapterSource
from runner_service.controlnets import ControlNets
from runner_service.denoising.controls import SequenceControl, control_image
from runner_service.denoising.loop import Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.families import loop_for
from runner_service.model_roots import ModelRoots
from runner_service.models.catalog import ensure_builtin
from runner_service.models.controlnets import BUILT_CONTROLNETS, save_controlnet
from runner_service.weights import read_tensors

RESULTS = Path(__file__).resolve().parent / "results"
SIZE = 64
SCHEDULE = 20  # steps per image before it restarts
GUIDANCE = 7.5
ARRANGEMENTS = ("plain", "controlled", "plain pair", "mixed pair")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny", choices=sorted(set(BUILT_CONTROLNETS.values())))
    parser.add_argument("--steps", type=int, default=400, help="timed steps per arrangement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    pipeline = DiffusionPipeline.from_pretrained(ensure_builtin(args.model, None), torch_dtype=torch.float32)
    name = next(name for name, model in BUILT_CONTROLNETS.items() if model == args.model)
    roots = ModelRoots()
    store = ControlNets(1 << 30, roots, lambda path: read_tensors(path, roots, 1 << 30))
    with tempfile.TemporaryDirectory() as directory:
        store.register(pipeline, AdapterSource(name, save_controlnet(name, Path(directory) / name), pin=True))
    net = store.require(pipeline, [name])[name]
    loop = loop_for(pipeline, device)
    assert loop is not None
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    control = SequenceControl(net, control_image(picture, SIZE, SIZE, pipeline.vae_scale_factor, device), 1.0, 0.0, 1.0)
    plain = SequenceSpec("a red fox", "blurry", SIZE, SIZE, SCHEDULE, GUIDANCE, 1, ())
    controlled = SequenceSpec("a red fox", "blurry", SIZE, SIZE, SCHEDULE, GUIDANCE, 2, (), controls=(control,))
    specs = {"plain": [plain], "controlled": [controlled], "plain pair": [plain, plain],
             "mixed pair": [plain, controlled]}
    cache = PromptCache()
    running: dict[str, list[Sequence]] = {}
    times: dict[str, list[float]] = {arrangement: [] for arrangement in ARRANGEMENTS}
    with torch.inference_mode():
        for round_ in range(args.steps + 10):  # the first 10 rounds warm up, untimed
            for arrangement in ARRANGEMENTS:
                sequences = running.get(arrangement)
                if sequences is None or sequences[0].finished:
                    sequences = running[arrangement] = [loop.start(spec, cache, "v") for spec in specs[arrangement]]
                started = time.perf_counter()
                loop.step(sequences)
                if round_ >= 10:
                    times[arrangement].append((time.perf_counter() - started) * 1000)
    medians = {arrangement: statistics.median(values) for arrangement, values in times.items()}
    result = {
        "model": args.model, "controlnet": name, "size": SIZE, "guidance": GUIDANCE, "steps": args.steps,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "median_ms": medians,
        "controlnet_ms": medians["controlled"] - medians["plain"],
        "controlnet_share": medians["controlled"] / medians["plain"] - 1,
        "controlled_row_in_pair_ms": medians["mixed pair"] - medians["plain pair"],
    }
    for arrangement in ARRANGEMENTS:
        print(f"{arrangement:>12}: {medians[arrangement]:7.2f} ms per step")
    print(f"a ControlNet adds {result['controlnet_ms']:.2f} ms to its image's step "
          f"(+{100 * result['controlnet_share']:.0f}%); a controlled row adds "
          f"{result['controlled_row_in_pair_ms']:.2f} ms to a shared step")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "controlnet.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
