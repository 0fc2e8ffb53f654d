"""The peer: LitServe's dynamic batching over the same diffusers pipeline, PNG out.

``python -m benchmarks.litserve_server MODEL_DIR PORT [MAX_BATCH_SIZE] [BATCH_TIMEOUT_S]``; a POST
to ``/predict`` with ``{"prompt", "seed", "size", "steps"}`` answers ``{"png": base64}``. Run only
by ``bench_serving.py`` (LitServe is a bench extra, never a dependency of the services). The
pipeline is called with the guidance every system gets (``bench.guidance_arguments``).
"""

from __future__ import annotations

import base64
import io
import sys

import litserve as ls
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from benchmarks.bench import guidance_arguments


class DiffusionAPI(ls.LitAPI):
    def __init__(self, directory: str, max_batch_size: int, batch_timeout: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout)
        self.directory = directory

    def setup(self, device: str) -> None:
        # float32, as the runner loads a model on a CPU (shapes ships in float16).
        self.pipeline = DiffusionPipeline.from_pretrained(self.directory, dtype=torch.float32).to(device)
        self.pipeline.set_progress_bar_config(disable=True)
        self.guidance = guidance_arguments(self.pipeline)

    def decode_request(self, request: dict) -> dict:
        return request

    def batch(self, inputs: list[dict]) -> list[dict]:
        return inputs

    def predict(self, requests: list[dict]) -> list[str]:
        # A batch shares its size and steps, as the benchmark's requests all do.
        first = requests[0]
        with torch.inference_mode():
            images = self.pipeline(
                [r["prompt"] for r in requests], negative_prompt=[""] * len(requests), width=first["size"],
                height=first["size"], num_inference_steps=first["steps"],
                generator=[torch.Generator().manual_seed(r["seed"]) for r in requests], output_type="np",
                **self.guidance).images
        encoded = []
        for image in images:
            buffer = io.BytesIO()
            Image.fromarray((image * 255).round().clip(0, 255).astype("uint8")).save(buffer, format="PNG")
            encoded.append(base64.b64encode(buffer.getvalue()).decode())
        return encoded

    def unbatch(self, output: list[str]) -> list[str]:
        return output

    def encode_response(self, output: str) -> dict:
        return {"png": output}


if __name__ == "__main__":
    directory, port = sys.argv[1], int(sys.argv[2])
    batch_size = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 0.005
    server = ls.LitServer(DiffusionAPI(directory, batch_size, timeout), accelerator="cpu", workers_per_device=1,
                          timeout=600)
    server.run(port=port, generate_client_file=False, log_level="warning")
