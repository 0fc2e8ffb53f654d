"""Shared fixtures: real runner processes on loopback, a model cache shared by the session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

from harness.processes import start_runner

# One torch thread in the test process and in every service it starts (they inherit it), set
# before the plugins below import torch: the suite runs several torch processes at once, and on
# 2 cores their OpenMP teams spinning beside each other cost up to 30x on a loaded machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor builds CPU kernels in the compiling process: its default pool of compile workers (an
# interpreter importing torch each, started on a cold inductor cache) costs more CPU than it saves
# beside the suite's other processes (a cold compiled load of shapes: 94 s of CPU with the pool, 88 s without).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# A Hugging Face hub cache of this test process's own, empty but while test_hf_models writes its
# snapshots there, set before huggingface_hub is imported (it reads the variable at import, as
# every runner forked from the zygote then has): no test reads the user's cache, and a runner
# serving hub ids needs no environment of its own, which would make it a fresh interpreter.
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="hf-hub-cache-")
atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], True)

# Fixtures shared across modules, one file per area (each has one owner).
pytest_plugins = ["fixtures_worker", "fixtures_runner", "fixtures_families", "fixtures_shapes", "fixtures_group"]


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> str:
    """Every process of the run builds built-in models into one cache, once: under pytest-xdist one
    cache for all its workers (beside their own temporary directories), which a build writes
    atomically (``catalog.write_atomically``), so two workers building the same model at once both
    end up reading one copy."""
    if os.environ.get("DIFFUSION_MODEL_CACHE"):
        return os.environ["DIFFUSION_MODEL_CACHE"]
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if worker_id != "master" else base) / "model-cache"
    cache.mkdir(exist_ok=True)
    os.environ["DIFFUSION_MODEL_CACHE"] = str(cache)
    return str(cache)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory):
    """A runner process with no model loaded; stopped with SIGTERM after the module."""
    process = start_runner(tmp_path_factory.mktemp("runner-logs"))
    yield process
    process.stop()


# The markers every test carries one of (pyproject's [tool.pytest.ini_options] markers).
TEST_KINDS = ("unit", "process", "slow")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that says neither unit nor process (nor slow) fails the run: ``make test-fast`` picks
    tests by marker, so an unmarked one would silently fall out of it."""
    unmarked = [item.nodeid for item in items if not any(item.get_closest_marker(kind) for kind in TEST_KINDS)]
    if unmarked:
        raise pytest.UsageError(f"{len(unmarked)} test(s) carry none of the markers {', '.join(TEST_KINDS)} "
                                f"(pytestmark = pytest.mark.unit or .process): {', '.join(unmarked[:10])}")
    longest_modules_first(items)


def longest_modules_first(items: list[pytest.Item]) -> None:
    """Orders the modules slow ones first, then the other process ones, then the unit ones, each
    module's tests in their own order: ``make test`` hands whole modules to its workers in this
    order (``--dist loadfile --no-loadscope-reorder``), so the longest start first and the end of
    the run is not one slow module running alone while the other workers idle."""
    def kind(item: pytest.Item) -> int:
        return next(rank for rank, marker in enumerate(("slow", "process", "unit", ""))
                    if not marker or item.get_closest_marker(marker))

    module_kind: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        module_kind[module] = min(module_kind.get(module, 3), kind(item))
    order = {module: index for index, module in enumerate(module_kind)}
    items.sort(key=lambda item: (module_kind[item.nodeid.split("::")[0]], order[item.nodeid.split("::")[0]]))
