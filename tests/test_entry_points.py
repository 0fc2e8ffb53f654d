"""Every command-line entry point, as a subprocess: no abbreviated flags (forked from the runner's
zygote, which imported torch once for all), and a --help that is quick to answer (a fresh interpreter:
no torch, diffusers or transformers imported), prints no warnings, no reST markup and no
"(default: None)". No worker or runner is started."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from harness import forked_python
from harness.processes import REPO
from runner_service.models.catalog import BUILTIN_MODELS
from serving_common.protocol import BUILTIN_MODEL_NAMES

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
HEAVY = ("torch", "diffusers", "transformers")
# Runs a module as __main__ and, however it exits, prints which heavy libraries it imported.
PROBE = f"""
import atexit, runpy, sys
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
atexit.register(lambda: print("IMPORTED:", *[name for name in {HEAVY!r} if name in sys.modules]))
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
SERVICES = ["runner_service.main", "worker_service.main", "runner_service.models.build"]


@functools.cache  # several tests read the same help: one interpreter each
def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "default", "-c", PROBE, module, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=100)


@pytest.mark.parametrize("module", [*SERVICES, "clients.cli", "runner_service.models.table", "protos.generate",
                                    "benchmarks.bench", "benchmarks.bench_serving", "benchmarks.bench_weights"])
def test_no_entry_point_takes_an_abbreviated_flag(module):
    # --hel would be --help with argparse's abbreviations: the help, exit 0. What the module imports is
    # not under test here, so it is forked from a process that has imported torch and diffusers already.
    done = forked_python.run_module(module, ["--hel"])
    assert done.returncode == 2 and "usage:" not in done.stdout, done.stdout + done.stderr


def test_the_pod_launcher_takes_no_abbreviated_flag():
    done = subprocess.run([sys.executable, str(REPO / "deploy" / "pod.py"), "--hel"], cwd=REPO, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 2 and "unrecognized arguments: --hel" in done.stderr, done.stderr


def test_generate_step_is_not_taken_for_steps(tmp_path):
    done = subprocess.run([sys.executable, "-m", "clients.cli", "--target", "127.0.0.1:1", "generate", "a fox",
                           "-o", str(tmp_path / "fox.png"), "--step", "5"], cwd=REPO, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 2 and "unrecognized arguments: --step 5" in done.stderr, done.stderr


@pytest.mark.parametrize("command", [[module] for module in SERVICES] + [
    ["clients.cli"], ["clients.cli", "generate"], ["clients.cli", "init"], ["clients.cli", "adapters", "load"]])
def test_help_imports_no_torch_and_prints_no_warnings(command):
    done = run_module(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no library notices, no warnings
    assert done.stdout.rstrip().endswith("IMPORTED:"), done.stdout[-300:]
    assert "(default: None)" not in done.stdout and "``" not in done.stdout and "usage:" in done.stdout


def test_the_torch_free_list_of_built_in_models_is_the_catalogs():
    assert BUILTIN_MODEL_NAMES == tuple(BUILTIN_MODELS)
    init_help = run_module("clients.cli", "init", "--help").stdout
    build_help = run_module("runner_service.models.build", "--help").stdout
    for name in BUILTIN_MODELS:
        assert name in init_help and name in build_help


def test_runner_help_says_which_families_step_batching_serves():
    batching = run_module("runner_service.main", "--help").stdout.split("--batching")[-1].split("--prompt")[0]
    # The families are listed where they are derived from the registry, not in the help, where they would drift.
    assert "docs/families.md, 'Step-level batching'" in " ".join(batching.split())


def test_worker_runner_flag_shows_its_real_default_once():
    help_text = " ".join(run_module("worker_service.main", "--help").stdout.split())
    assert help_text.count("127.0.0.1:50052") == 1 and "(default: None)" not in help_text
