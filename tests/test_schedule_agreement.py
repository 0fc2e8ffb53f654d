"""One flag chooses scheduling by compute for both sides: the runner's ``--step-schedule``. Each
runner reports it (``RunnerInfo.step_schedule``), and the worker, which has no such flag of its
own, schedules by compute while every ready runner takes turns, and in order otherwise: the two
sides never disagree (a worker taking turns beside a runner that steps every size group at every
step had its turns undone: 5 of 64 small requests finished beside one large one, against 26 with
both taking turns). Real runner processes serving ``tiny``, whose family batches steps."""

from __future__ import annotations

import grpc
import pytest

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import ServiceProcess, start_runner, start_worker, wait_until
from support import request

W = worker_pb2
pytestmark = [pytest.mark.timeout(300), pytest.mark.process]
BY_COMPUTE = "scheduling by compute: every ready runner takes turns"
IN_ORDER = "scheduling in order: runner(s)"


def test_the_worker_schedules_by_compute_while_its_runner_takes_turns_and_in_order_once_it_does_not(tmp_path):
    runners: list[ServiceProcess] = [start_runner(tmp_path, "--step-schedule", "budget")]
    worker = start_worker(tmp_path, runners[0].target, "--model", "tiny")
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            assert stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info.step_schedule == "budget"
            assert len(stub.Generate(request(num_inference_steps=2), timeout=120).images) == 1
            assert BY_COMPUTE in worker.log() and IN_ORDER not in worker.log()

            # The same runner started again with --step-schedule all (the default) serves, in order.
            runners[0].stop()
            runners.append(start_runner(tmp_path, target=runners[0].target))
            wait_until(lambda: (s := stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0]).ready
                       and s.info.step_schedule == "all", 120, "the runner stepping every size group ready")
            assert len(stub.Generate(request(num_inference_steps=2), timeout=120).images) == 1
            assert f"{IN_ORDER} {runners[0].target} do not take turns by compute" in worker.log()
    finally:
        worker.stop()
        for runner in runners:
            runner.stop()
