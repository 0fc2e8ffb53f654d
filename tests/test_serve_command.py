"""``diffusion serve MODEL`` (issue 38 item 7): the installed console script runs ``make run``'s
launcher (serving_common.pod), as real processes started outside the repository: it serves and
answers, Ctrl-C (SIGINT) stops the worker and then the runner and exits 0, and a model that cannot
load ends it with exit code 1 and the reason."""

from __future__ import annotations

import re
import signal

import pytest

from clients import DiffusionClient
from pod_process import NO_HTTP, Pod, gone

pytestmark = [pytest.mark.timeout(300), pytest.mark.process]



def stopped(pod: Pod) -> list[str]:
    """The children the pod said it stopped, in order."""
    return [line.split()[1] for line in pod.lines if re.fullmatch(r"\[pod\] (worker|runner) stopped.*", line)]


def test_serve_starts_answers_and_ctrl_c_stops_both_children(tmp_path):
    pod = Pod("tiny", "--", *NO_HTTP, serve=True, cwd=tmp_path)
    try:
        pod.wait_ready(240)
        pod.wait_for(lambda: "Ctrl-C stops both." in pod.lines, "the commands to try", 10)
        assert f"  diffusion --target {pod.worker} generate " in pod.output()  # the installed command
        with DiffusionClient(pod.worker, timeout=120) as client:
            assert client.status().model.source == "tiny"
            assert len(client.generate("a fox", steps=1, width=32, height=32).images) == 1
        children = [*pod.pids("worker"), *pod.pids("runner")]
        assert len(children) == 2, pod.output()
        pod.process.send_signal(signal.SIGINT)
        assert pod.wait_exit(60) == 0, pod.output()
    finally:
        pod.kill_all()
    assert "[pod] SIGINT: stopping" in pod.lines
    assert stopped(pod) == ["worker", "runner"], pod.output()
    assert all(gone(pid) for pid in children), pod.output()


def test_serve_of_a_model_that_cannot_load_exits_1_with_the_reason(tmp_path):
    pod = Pod("./no-such-model", "--", *NO_HTTP, serve=True, cwd=tmp_path)
    try:
        assert pod.wait_exit(240) == 1, pod.output()
    finally:
        pod.kill_all()
    assert "The worker is ready" not in pod.output()
    assert stopped(pod) == ["worker", "runner"], pod.output()
    assert all(gone(pid) for pid in [*pod.pids("worker"), *pod.pids("runner")]), pod.output()
    reason, advice = pod.lines[-2:]
    assert reason.startswith("[pod] worker FAILED: loading model ./no-such-model failed: "), pod.output()
    assert "no-such-model" in reason.split(" failed: ", 1)[1]
    assert advice.startswith("[pod] MODEL takes a built-in model (") and advice.endswith("diffusion serve tiny")
