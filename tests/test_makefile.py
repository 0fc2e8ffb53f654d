"""The Makefile's user-facing lines, as the README writes them."""

from __future__ import annotations

import shlex
import subprocess

from harness.processes import REPO


def test_make_run_passes_args_to_the_pod_launcher() -> None:
    readme = (REPO / "README.md").read_text()
    documented = '--model small -- --max-batch-size 4'
    assert f'make run ARGS="{documented}"' in readme
    # -n prints the recipes (install's too, when it is due) without running them.
    result = subprocess.run(["make", "-n", "run", f"ARGS={documented}"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    [launch] = [line for line in result.stdout.splitlines() if "deploy/pod.py" in line]
    assert shlex.split(launch)[-5:] == shlex.split(documented)
