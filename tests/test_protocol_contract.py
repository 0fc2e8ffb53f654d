"""The released proto contract is a committed buf image: the breaking check needs no git history."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.processes import REPO

pytestmark = pytest.mark.unit

# buf-bin installs buf beside the interpreter that runs the tests.
BUF = Path(sys.executable).parent / "buf"


def _breaking(protos: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUF), "breaking", "--against", "released-contract.json"], cwd=protos,
                          capture_output=True, text=True, timeout=120)


def test_the_breaking_check_runs_outside_any_git_history(tmp_path: Path) -> None:
    protos = tmp_path / "protos"
    shutil.copytree(REPO / "protos", protos, ignore=shutil.ignore_patterns("gen"))
    assert not (tmp_path / ".git").exists()
    result = _breaking(protos)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_breaking_check_fails_on_a_renumbered_field(tmp_path: Path) -> None:
    protos = tmp_path / "protos"
    shutil.copytree(REPO / "protos", protos, ignore=shutil.ignore_patterns("gen"))
    worker_proto = protos / "diffusion" / "v1" / "worker.proto"
    text = worker_proto.read_text()
    assert "string prompt = 2;" in text
    worker_proto.write_text(text.replace("string prompt = 2;", "string prompt = 99;", 1))
    result = _breaking(protos)
    assert result.returncode != 0
    assert '"prompt"' in result.stdout + result.stderr
