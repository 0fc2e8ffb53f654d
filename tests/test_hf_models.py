"""Hugging Face ids as model sources (issue 38 item 1), resolved by the real ``huggingface_hub``
from a hub cache this module writes by hand (``hub_cache``): the test process's own
``HF_HUB_CACHE`` (conftest), which its runners read as they would the user's, emptied again after
the module. No runner is started with ``--allow-download``: nothing is fetched.

The cache holds ``acme/tiny-sd``: the built-in ``tiny`` saved as commit MAIN (``refs/main``), and
as commit V2 (``refs/v2``) with another noise schedule, so the two snapshots draw different images
from the same seed. One runner and worker (HTTP on, a state file) serve it all; the last test
restarts that runner.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import torch
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from huggingface_hub import constants
from PIL import Image

from diffusion.v1 import worker_pb2 as W
from harness.processes import REPO, free_port, start_runner, start_worker, wait_until, worker_stub
from hub_cache import commit_of, point, repo_folder, write_snapshot
from runner_service.model_roots import ModelRoots
from runner_service.model_sources import HubCache, SourceKind, locate
from runner_service.models.catalog import ensure_builtin
from serving_common.errors import ServiceError
from serving_common.hub_ids import HubId
from serving_common.protocol import BUILTIN_MODEL_NAMES
from support import cli_command, cli_env, pixels

pytestmark = pytest.mark.process
REPO_ID = "acme/tiny-sd"
MAIN, V2 = commit_of("main"), commit_of("v2")
SIZE, STEPS, SEED, GUIDANCE, PROMPT = 64, 2, 5, 7.5, "a red fox"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[Path]:
    """The hub cache the runners read: ``acme/tiny-sd`` at MAIN (refs/main) and at V2 (refs/v2);
    what the module wrote there is removed after it."""
    cache = Path(constants.HF_HUB_CACHE)
    assert not any(cache.iterdir()), f"{cache} should be the test process's own empty hub cache"
    saved = tmp_path_factory.mktemp("hub") / "saved"
    shutil.copytree(ensure_builtin("tiny"), saved)
    write_snapshot(cache, REPO_ID, saved, MAIN)
    schedule = saved / "scheduler" / "scheduler_config.json"
    config = json.loads(schedule.read_text())
    schedule.write_text(json.dumps({**config, "beta_end": 0.03, "beta_schedule": "linear"}))
    write_snapshot(cache, REPO_ID, saved, V2, refs=("v2",))
    yield cache
    for written in cache.iterdir():
        shutil.rmtree(written)


def snapshot(hub: Path, commit: str) -> Path:
    return hub / "models--acme--tiny-sd" / "snapshots" / commit


@functools.cache
def from_pretrained(directory: Path) -> np.ndarray:
    """The image diffusers' own pipeline call makes from ``directory``, as uint8 (read-only): made
    once per snapshot, which no test changes."""
    pipeline = DiffusionPipeline.from_pretrained(directory, torch_dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        image = pipeline(prompt=[PROMPT], negative_prompt=[""], num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                         generator=[torch.Generator("cpu").manual_seed(SEED)], width=SIZE, height=SIZE,
                         output_type="np").images[0]
    drawn = (image * 255).round().clip(0, 255).astype(np.uint8)
    drawn.setflags(write=False)
    return drawn


def difference(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


# -- resolution, in this process ------------------------------------------------------------------


@pytest.mark.parametrize("source, expected", [
    ("acme/tiny-sd", HubId("acme/tiny-sd")),
    ("acme/tiny-sd@v2", HubId("acme/tiny-sd", "v2")),
    ("stabilityai/sd-turbo@refs/pr/1", HubId("stabilityai/sd-turbo", "refs/pr/1")),
    (f"a.b_c/x-1@{MAIN}", HubId("a.b_c/x-1", MAIN)),
    ("tiny", None), ("/models/sd", None), ("a/b/c", None), ("acme/tiny-sd@", None), ("acme/..@v2", None),
    ("acme/x@../../etc", None), ("acme/x@v2/", None), ("ac--me/x", None), ("-acme/x", None), ("acme/x@a@b", None),
])
def test_an_id_is_org_slash_name_with_an_optional_revision(source, expected):
    assert HubId.parse(source) == expected
    if expected is not None:
        assert str(expected) == source


def test_an_id_resolves_to_its_branch_tag_or_commit_snapshot_inside_the_cache(hub, tmp_path):
    cache = HubCache(hub)
    assert cache.snapshot(HubId(REPO_ID)) == snapshot(hub, MAIN)
    assert cache.snapshot(HubId(REPO_ID, "main")) == snapshot(hub, MAIN)
    assert cache.snapshot(HubId(REPO_ID, "v2")) == snapshot(hub, V2)
    assert cache.snapshot(HubId(REPO_ID, MAIN)) == snapshot(hub, MAIN)
    located = locate(f"{REPO_ID}@v2", None, ModelRoots([tmp_path / "elsewhere"]), cache)
    assert (located.kind, located.path, located.revision) == (SourceKind.HUB, snapshot(hub, V2), V2)
    # The snapshot's files are links into blobs/: reading them stays inside the cache, whatever the roots.
    assert located.roots.model_tree(located.path, "source") > 0
    assert located.roots.roots == [hub.resolve()]


def test_an_existing_relative_directory_is_a_path_not_an_id(hub, tmp_path, monkeypatch):
    (tmp_path / "acme" / "tiny-sd").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    located = locate(REPO_ID, None, ModelRoots(), HubCache(hub))
    assert (located.kind, located.path, located.revision) == (SourceKind.PATH, Path(REPO_ID), "")


@pytest.mark.parametrize("hub_id, command", [
    (HubId("acme/absent"), "hf download acme/absent"),
    (HubId(REPO_ID, "v9"), f"hf download {REPO_ID} --revision v9"),
])
def test_a_missing_id_is_not_found_naming_it_the_folder_and_how_to_fetch_it(hub, hub_id, command):
    with pytest.raises(ServiceError) as raised:
        HubCache(hub).snapshot(hub_id)
    error = raised.value
    assert error.code == grpc.StatusCode.NOT_FOUND
    folder = hub / f"models--{hub_id.repo_id.replace('/', '--')}"
    assert str(hub_id) in error.message and str(folder) in error.message and f"`{command}`" in error.message


def test_an_id_missing_from_the_cache_is_downloaded_only_when_a_download_is_given(hub, tmp_path):
    """With --allow-download the runner's HubCache has the hub's download; here one that writes the
    layout as the hub would, called once, for the id missing only."""
    cache = tmp_path / "cache"
    shutil.copytree(hub, cache, symlinks=True)
    asked: list[HubId] = []

    def download(hub_id: HubId, into: Path) -> Path:
        asked.append(hub_id)
        return write_snapshot(into, hub_id.repo_id, snapshot(hub, MAIN), commit_of("fetched"))

    fetching = HubCache(cache, download)
    assert fetching.snapshot(HubId(REPO_ID)) == snapshot(cache, MAIN)
    assert fetching.snapshot(HubId("acme/fetched")).name == commit_of("fetched")
    assert asked == [HubId("acme/fetched")]
    assert HubCache(cache).snapshot(HubId("acme/fetched")).name == commit_of("fetched")  # cached now


def test_a_download_that_fails_is_unavailable_naming_the_id_and_why(hub):
    def offline(hub_id: HubId, into: Path) -> Path:
        raise OSError("network is unreachable")

    with pytest.raises(ServiceError) as raised:
        HubCache(hub, offline).snapshot(HubId("acme/elsewhere"))
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert "'acme/elsewhere'" in raised.value.message and "OSError: network is unreachable" in raised.value.message


# -- served by a worker ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(hub, tmp_path_factory):
    """A runner reading the hub cache, and a worker serving ``acme/tiny-sd`` (HTTP on, a state file)."""
    logs = tmp_path_factory.mktemp("hf-logs")
    runner = start_runner(logs)
    port = free_port()
    state_file = logs / "state.json"
    try:
        worker = start_worker(logs, runner.target, "--model", REPO_ID, "--http-port", str(port),
                              "--state-file", str(state_file))
    except BaseException:
        runner.stop()
        raise
    served = {"runner": runner, "worker": worker, "logs": logs, "state_file": state_file,
              "sdk": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                   timeout=60)}
    yield served
    worker.stop()
    served["runner"].stop()


@pytest.fixture(scope="module")
def stub(served):
    with worker_stub(served["worker"].target) as stub:
        yield stub


def generated(stub) -> np.ndarray:
    return pixels(stub.Generate(W.GenerateRequest(prompt=PROMPT, seed=SEED, num_inference_steps=STEPS, width=SIZE,
                                                  height=SIZE, guidance_scale=GUIDANCE,
                                                  output_format=W.OUTPUT_FORMAT_RAW), timeout=120))


def over_http(served, model: str) -> np.ndarray:
    result = served["sdk"].images.generate(prompt=PROMPT, model=model, size=f"{SIZE}x{SIZE}",
                                           extra_body={"seed": SEED, "num_inference_steps": STEPS,
                                                       "guidance_scale": GUIDANCE})
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"))


def model_info(stub):
    return stub.GetStatus(W.GetStatusRequest(), timeout=10).model


def test_an_id_is_served_as_diffusers_loads_its_snapshot_by_grpc_and_by_its_name_over_http(served, stub, hub):
    stub.Init(W.InitRequest(model=REPO_ID), timeout=300)
    model = model_info(stub)
    assert (model.source, model.revision, model.pipeline_class) == (REPO_ID, MAIN, "StableDiffusionPipeline")
    own = from_pretrained(snapshot(hub, MAIN))
    assert difference(generated(stub), own) <= 1
    assert difference(over_http(served, REPO_ID), own) <= 1
    assert [m.id for m in served["sdk"].models.list().data] == [REPO_ID]
    with pytest.raises(openai.APIStatusError) as refused:
        over_http(served, MAIN)  # the commit is not a name the model is served by
    assert refused.value.status_code in (400, 404) and refused.value.body["param"] == "model"


def test_a_revision_picks_its_snapshot_and_the_id_alone_still_names_it(served, stub, hub):
    stub.Init(W.InitRequest(model=f"{REPO_ID}@v2"), timeout=300)
    model = model_info(stub)
    assert (model.source, model.revision) == (f"{REPO_ID}@v2", V2)
    image = generated(stub)
    assert difference(image, from_pretrained(snapshot(hub, V2))) <= 1
    assert difference(image, from_pretrained(snapshot(hub, MAIN))) > 8
    assert difference(over_http(served, REPO_ID), image) <= 1


def test_an_id_missing_from_the_cache_fails_init_at_once_and_the_model_keeps_serving(served, stub, hub):
    before = model_info(stub)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Init(W.InitRequest(model="acme/absent"), timeout=60)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value
    details = refused.value.details()
    assert "'acme/absent'" in details and str(hub / "models--acme--absent") in details
    assert "`hf download acme/absent`" in details
    after = model_info(stub)
    assert (after.source, after.revision) == (before.source, before.revision)


def test_a_restarted_runner_loads_the_snapshot_the_id_first_resolved_to(served, stub, hub):
    """The desired state (and its file) keep the id and its commit: refs/main moved to V2 meanwhile,
    yet the new runner loads MAIN, under the id pinned to it, still served by the id's name."""
    stub.Init(W.InitRequest(model=REPO_ID), timeout=300)
    assert model_info(stub).revision == MAIN
    saved = json.loads(served["state_file"].read_text())
    assert (saved["model"], saved["revision"]) == (REPO_ID, MAIN)
    point(hub, REPO_ID, "main", V2)
    try:
        runner = served["runner"]
        runner.stop()
        served["runner"] = start_runner(served["logs"], target=runner.target)
        status = wait_until(lambda: (s := stub.GetStatus(W.GetStatusRequest(), timeout=10)).runners[0].restarts
                            and s.runners[0].ready and s, 300, "the restarted runner, ready")
    finally:
        point(hub, REPO_ID, "main", MAIN)
    assert (status.model.source, status.model.revision) == (f"{REPO_ID}@{MAIN}", MAIN)
    assert difference(over_http(served, REPO_ID), from_pretrained(snapshot(hub, MAIN))) <= 1


# -- the catalog -----------------------------------------------------------------------------------


def test_diffusion_models_lists_the_built_ins_the_cached_pipelines_and_the_model_roots(hub, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(snapshot(hub, MAIN), root / "my-sd")  # the links copied as files
    (root / "notes").mkdir()
    env = cli_env({"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "DIFFUSION_RUNNER_MODEL_ROOT": str(root)})
    done = subprocess.run(cli_command("models", "--json"), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    listed = {entry["name"]: entry for entry in json.loads(done.stdout)}
    assert [name for name, entry in listed.items() if entry["kind"] == "built-in"] == list(BUILTIN_MODEL_NAMES)
    main, tagged = listed[REPO_ID], listed[f"{REPO_ID}@v2"]
    assert (main["kind"], main["pipeline"], main["path"]) == ("hugging face", "StableDiffusionPipeline",
                                                              str(snapshot(hub, MAIN)))
    assert tagged["path"] == str(snapshot(hub, V2)) and main["size"] > 100_000
    mine = listed[str(root / "my-sd")]
    assert (mine["kind"], mine["pipeline"], mine["size"]) == ("model root", "StableDiffusionPipeline", main["size"])
    assert len(listed) == len(BUILTIN_MODEL_NAMES) + 3  # not the root itself, nor notes/
    table = subprocess.run(cli_command("models"), env=env, capture_output=True, text=True, timeout=60).stdout
    assert table.splitlines()[0].split() == ["NAME", "KIND", "PIPELINE", "SIZE", "PATH"]
    assert any(line.split()[:2] == [f"{REPO_ID}@v2", "hugging"] for line in table.splitlines())


# -- docs/models.md --------------------------------------------------------------------------------


def naming_examples() -> tuple[list[str], list[str]]:
    """The sources docs/models.md's "Naming a model" gives ``diffusion init``, and the ids it gives
    ``hf download`` (with their --revision)."""
    section = (REPO / "docs" / "models.md").read_text().split("## Naming a model", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for block in re.findall(r"```text\n(.*?)```", section, flags=re.S)
             for line in block.splitlines()]
    inits = [line.removeprefix("diffusion init ") for line in lines if line.startswith("diffusion init ")]
    downloads = [line.removeprefix("hf download ").replace(" --revision ", "@") for line in lines
                 if line.startswith("hf download ")]
    return inits, downloads


def test_the_sources_docs_models_names_load_as_it_says(served, stub, hub):
    """Each ``diffusion init`` of the page (but the path, which is the reader's) loads: the built-in
    by name, each id from its snapshot, written here into the cache under the page's names; each
    ``hf download`` of the page fetches one of those ids."""
    inits, downloads = naming_examples()
    assert len(inits) == 6 and set(downloads) <= set(inits), (inits, downloads)
    for source in inits:
        if source.startswith("/"):
            continue
        hub_id = HubId.parse(source)
        if hub_id is not None:
            pinned = re.fullmatch(r"[0-9a-f]{40}", hub_id.revision) is not None
            commit = hub_id.revision if pinned else commit_of(source)
            if not (repo_folder(hub, hub_id.repo_id) / "snapshots" / commit).exists():
                write_snapshot(hub, hub_id.repo_id, snapshot(hub, MAIN), commit,
                               refs=() if pinned else (hub_id.revision or "main",))
        stub.Init(W.InitRequest(model=source), timeout=300)
        model = model_info(stub)
        assert model.source == source and bool(model.revision) == (hub_id is not None), source
