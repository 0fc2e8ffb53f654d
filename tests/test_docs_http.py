"""The curl and OpenAI SDK blocks of docs/ (docs/http.md's: image URLs, edits, videos) run as written,
in the order each page shows them, in one working directory, against a live worker on its own
runner whose HTTP port stands for ``localhost:8000``.

The worker serves the default model (``shapes``, as ``make run``), 4 steps where a request sets none
(``--default-steps``; ``make run``'s is 20: what the examples show does not depend on the count); a
block on the Videos API (``/v1/videos``, ``client.videos``) runs with ``tiny-wan`` loaded, as the
page says a video model must be; one with ``controls`` (docs/conditioning.md's) with ``tiny`` loaded
and the page's ControlNet ``edges`` and IP-Adapter ``look`` registered (the built-in
``tiny-controlnet`` and ``tiny-ip-adapter``), as the page has the reader do before. Shell blocks run
in bash (``set -eu``), their ``python3`` this environment's, as a reader's with Pillow installed
(the page says so); Python blocks as ``python -c`` runs them, each a process forked from the
runner's zygote (``harness.forked_python``), as are the built-in adapters' builds. A block passes
when it exits 0 and prints no OpenAI error, and every file the blocks made is what its name says: a
JSON answer without an error, a PNG that decodes, an MP4 whose frames decode. (The README's blocks
are ``test_openai_api.py``'s.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import av
import pytest
from PIL import Image

from diffusion.v1 import common_pb2, worker_pb2
from doc_blocks import HTTP_PORT, PAGES, Block, blocks
from harness.forked_python import run_code, run_module
from harness.processes import REPO, free_port, start_worker, worker_stub

pytestmark = pytest.mark.process

IMAGE_MODEL, VIDEO_MODEL, CONDITIONED_MODEL = "shapes", "tiny-wan", "tiny"
# What a request that sets no steps runs (the module docstring).
DEFAULT_STEPS = ("--default-steps", "4")
# What docs/conditioning.md registers before its HTTP examples: name -> (built-in, kind).
CONDITIONING = {"edges": ("tiny-controlnet", common_pb2.ADAPTER_KIND_CONTROLNET),
                "look": ("tiny-ip-adapter", common_pb2.ADAPTER_KIND_IP_ADAPTER)}
HTTP_PAGES = [page for page in PAGES if page != REPO / "README.md"
              and any(block.kind == "openai" for block in blocks(page))]


@pytest.fixture(scope="module")
def worker(runner, tmp_path_factory):
    port = free_port()
    process = start_worker(tmp_path_factory.mktemp("docs-http"), runner.target, "--model", IMAGE_MODEL,
                           "--http-port", str(port), *DEFAULT_STEPS)
    process.extra.update(port=port, loaded=IMAGE_MODEL, adapters=tmp_path_factory.mktemp("docs-http-adapters"))
    yield process
    process.stop()


def model_for(block: Block) -> str:
    if "/v1/videos" in block.code or "client.videos" in block.code:
        return VIDEO_MODEL
    return CONDITIONED_MODEL if "controls" in block.code else IMAGE_MODEL


def load(worker, model: str) -> None:
    if worker.extra["loaded"] != model:
        with worker_stub(worker.target, warm=False) as stub:
            stub.Init(worker_pb2.InitRequest(model=model), timeout=300)
            if model == CONDITIONED_MODEL:
                register_conditioning(stub, worker.extra["adapters"])
        worker.extra["loaded"] = model


def register_conditioning(stub, root: Path) -> None:
    """docs/conditioning.md's ControlNet and IP-Adapter, built once into ``root`` (``diffusion-build-model``,
    forked from the runner's zygote), registered by kind."""
    for name, (built_in, kind) in CONDITIONING.items():
        if not (root / name).exists():
            built = run_module("runner_service.models.build", [built_in, str(root / name)], root, timeout=300)
            assert built.returncode == 0, built.stderr
        stub.LoadAdapter(worker_pb2.LoadAdapterRequest(name=name, path=str(root / name), kind=kind), timeout=120)


def run_block(block: Block, port: int, workdir: Path) -> None:
    code = block.code.replace(HTTP_PORT, f"127.0.0.1:{port}")
    if block.language in ("python", "py"):
        done = run_code(code, workdir, timeout=300)
    else:
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        done = subprocess.run(["bash", "-c", "set -eu\n" + code], cwd=workdir, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(REPO), "PATH": path})
    assert done.returncode == 0, f"{block.code}\n{done.stdout}\n{done.stderr}"
    assert '"error":' not in done.stdout, f"{block.code}\n{done.stdout}"


def check_file(path: Path) -> None:
    """``path`` is what its name says, and no error answer."""
    if path.suffix == ".json":
        assert "error" not in json.loads(path.read_bytes()), path.read_text()[:500]
    elif path.suffix == ".png":
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 0, path
            image.load()
    elif path.suffix == ".mp4":
        with av.open(str(path)) as container:
            assert sum(1 for _ in container.decode(video=0)) > 0, path
    else:
        raise AssertionError(f"the docs made {path.name}, which this test cannot check")


@pytest.mark.slow
@pytest.mark.parametrize("page", HTTP_PAGES, ids=lambda page: page.name)
def test_page_http_examples_run_as_written(page, worker, tmp_path):
    ran = [block for block in blocks(page) if block.kind == "openai"]
    for block in ran:
        load(worker, model_for(block))
        run_block(block, worker.extra["port"], tmp_path)
    made = sorted(tmp_path.iterdir())
    assert made, f"{page.name}'s HTTP examples made no file"
    for path in made:
        check_file(path)
