"""Every grpcurl command in the README and docs/ runs as written against live workers and exits 0.

The pages call ``.venv/bin/grpcurl`` (what ``make install`` provides; it is not on PATH).
``-plaintext`` commands go to a plain worker, the ``-cacert`` ones to a TLS worker with ops and
inference tokens, from a directory holding the files they name (worker.pem, ops.token,
inference.token) and ``.venv/bin/grpcurl``, as the repository root does. ``localhost:50051``
becomes the worker's address and the LoadWeights path a real safetensors file.
"""

from __future__ import annotations

import subprocess

import grpc
import pytest

from certs import self_signed, wait_serving
from doc_blocks import GRPCURL as DOCS_GRPCURL
from doc_blocks import of_kind
from harness.forked_python import run_code
from harness.processes import REPO, free_port, start_runner, start_service, start_worker

pytestmark = pytest.mark.process

GRPCURL = REPO / ".venv" / "bin" / "grpcurl"
DOCS_TARGET = "localhost:50051"
DOCS_WEIGHTS = "/tmp/unet-update.safetensors"
# The docs' runner addresses: the worker's own runner, and a second one to attach.
DOCS_RUNNER, DOCS_SPARE_RUNNER = "127.0.0.1:50052", "127.0.0.1:50053"

# In page order: the README, then docs/ by name (docs/clients.md's ops lines before the attach and
# detach lines of docs/design.md, which leave the plain worker on the spare runner).
COMMANDS = [line for block in of_kind("grpcurl") for line in block.lines]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("docs")
    self_signed(work, "worker")
    (work / "ops.token").write_text("docs-ops\n")
    (work / "inference.token").write_text("docs-inference\n")
    # Forked from the runner's zygote, which has imported torch already (this process need not).
    made = run_code("from tests.runner_calls import perturbed_weights\n"
                    f"perturbed_weights({str(work / 'unet-update.safetensors')!r})", work, timeout=300)
    assert made.returncode == 0, made.stderr
    (work / ".venv" / "bin").mkdir(parents=True)
    (work / DOCS_GRPCURL.strip()).symlink_to(GRPCURL)
    return work


@pytest.fixture(scope="module")
def spare_runner(workdir):
    runner = start_runner(workdir)
    yield runner
    runner.stop()


@pytest.fixture(scope="module")
def plain(runner, spare_runner, workdir):
    worker = start_worker(workdir, runner.target, "--model", "tiny")
    worker.extra.update(runner=runner.target, spare_runner=spare_runner.target)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def tls(workdir):
    runner = start_runner(workdir)
    target = f"127.0.0.1:{free_port()}"
    worker = start_service("worker", "worker_service.main", [
        "--listen", target, "--runner", runner.target, "--model", "tiny", "--metrics-port", "0", "--http-port", "0",
        "--tls-cert", str(workdir / "worker.pem"), "--tls-key", str(workdir / "worker-key.pem"),
        "--ops-token-file", str(workdir / "ops.token"), "--inference-token-file", str(workdir / "inference.token"),
    ], workdir, target)
    wait_serving(worker, grpc.ssl_channel_credentials((workdir / "worker.pem").read_bytes()),
                 "diffusion.v1.WorkerService")
    yield worker
    worker.stop()
    runner.stop()


def test_the_docs_have_grpcurl_commands_of_both_kinds():
    assert len(COMMANDS) >= 10
    assert all(("-plaintext" in c) != ("-cacert" in c) for c in COMMANDS), COMMANDS
    assert any("-cacert" in c for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_docs_grpcurl_command_runs(command, request, workdir):
    worker = request.getfixturevalue("plain" if "-plaintext" in command else "tls")
    assert DOCS_TARGET in command
    rewritten = (command.replace(DOCS_TARGET, worker.target)
                 .replace(DOCS_WEIGHTS, str(workdir / "unet-update.safetensors"))
                 .replace(DOCS_RUNNER, worker.extra.get("runner", DOCS_RUNNER))
                 .replace(DOCS_SPARE_RUNNER, worker.extra.get("spare_runner", DOCS_SPARE_RUNNER)))
    done = subprocess.run(["bash", "-c", rewritten], cwd=workdir, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
