"""What a newcomer meets starting ``make run`` (deploy/pod.py), with real processes: a model that cannot
load ends the pod with its reason, a second pod on taken ports says only that, and a start prints only
the project's own lines (issue 36 items 1, 2 and 10)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from harness.processes import REPO, free_port, health_status, start_runner
from pod_process import NO_HTTP, READINESS, SERVING, Pod, gone
from serving_common.listen_ports import PORT_IN_USE, bind_error, listens_on
from serving_common.protocol import BUILTIN_MODEL_NAMES

pytestmark = [pytest.mark.timeout(300), pytest.mark.process, pytest.mark.slow]

# A log line of the project's own: its text format (serving_common.logs) from one of its loggers.
OWN_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                      r"(runner_service|worker_service|serving_common)(\.\w+)*: .*")


def foreign_lines(pod: Pod) -> list[str]:
    """The lines the pod's runner and worker printed that are not the project's own log lines."""
    return [line for line in list(pod.lines)
            if (m := re.fullmatch(r"\[(runner|worker)\] (.*)", line)) and not OWN_LINE.fullmatch(m.group(2))]


@pytest.fixture(scope="module")
def group_pod():
    """A pod serving tiny-flux on a runner group of two CPU ranks, as docs/parallel.md starts one."""
    pod = Pod("--devices", "2", "--model", "tiny-flux", "--", "--cfg-parallel", *NO_HTTP)
    yield pod
    pod.kill_all()


def test_a_pod_start_prints_only_the_projects_own_lines(group_pod):
    group_pod.wait_ready(240)
    group_pod.wait_for(lambda: "Ctrl-C stops both." in group_pod.lines, "the commands to try", 10)
    assert any(line.startswith("[runner] ") and "rank 0 of 2" in line for line in group_pod.lines)
    assert foreign_lines(group_pod) == [], group_pod.output()


@pytest.mark.parametrize("flag", ["--worker-listen", "--runner-listen"])
def test_a_second_pod_on_a_taken_port_says_only_that(group_pod, flag):
    group_pod.wait_ready(240)
    if flag == "--worker-listen":
        second = Pod(worker=(taken := group_pod.worker))
    else:
        second = Pod(runner=(taken := group_pod.runner))
    assert second.wait_exit(60) == 1
    assert second.lines == [f"[pod] cannot listen on {taken} ({flag}): the port is in use (is another pod "
                            f"running? stop it, or pass another {flag})"]
    assert health_status(group_pod.worker, READINESS) == SERVING, group_pod.output()


def test_a_model_that_cannot_load_ends_the_pod_with_the_reason_and_what_to_try():
    pod = Pod("--model", "stabilityai/sdxl-turbo", "--", *NO_HTTP)
    try:
        assert pod.wait_exit(240) == 1, pod.output()
    finally:
        pod.kill_all()
    assert "[pod] worker ready" not in pod.lines and "The worker is ready" not in pod.output()
    assert all(gone(pid) for pid in [*pod.pids("worker"), *pod.pids("runner")]), pod.output()
    stopped = [line.split()[1] for line in pod.lines if re.fullmatch(r"\[pod\] (worker|runner) stopped.*", line)]
    assert stopped == ["worker", "runner"], pod.output()
    reason, advice = pod.lines[-2:]
    assert reason.startswith("[pod] worker FAILED: loading model stabilityai/sdxl-turbo failed: ")
    assert "'stabilityai/sdxl-turbo' is not a built-in model" in reason
    assert advice.startswith("[pod] --model takes a built-in model (")
    assert all(name in advice for name in BUILTIN_MODEL_NAMES) and "model directory" in advice
    assert foreign_lines(pod) == [], pod.output()  # a single runner's start is quiet too


def test_a_runner_at_log_level_debug_keeps_the_libraries_warnings(tmp_path):
    runner = start_runner(tmp_path, "--log-level", "debug", fresh=True)  # the warnings of its imports
    try:
        log = runner.log()
    finally:
        runner.stop()
    assert re.search(r"^\S+ \S+ (DEBUG|INFO|WARNING) torchao[\w.]*: ", log, re.MULTILINE), log


def test_the_holder_of_a_listening_port_is_told_apart():
    """What keeps a pod from calling another's worker its own: the port's listening socket is the child's."""
    listen = f"127.0.0.1:{free_port()}"
    host, port = listen.rsplit(":", 1)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys; s = socket.socket(); "
         f"s.bind(({host!r}, {port})); s.listen(); print('listening', flush=True); sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "listening\n"
        assert listens_on(holder.pid, listen)
        assert not listens_on(os.getpid(), listen)
        assert bind_error(listen) == PORT_IN_USE
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert not listens_on(holder.pid, listen) and bind_error(listen) is None
