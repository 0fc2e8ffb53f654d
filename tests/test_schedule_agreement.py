"""The worker's ``--schedule budget`` and its runners' ``--step-schedule`` agree, or the runner gets no
work: each runner reports its step schedule (``RunnerInfo.step_schedule``), and a worker scheduling
by compute refuses a runner of a step-batching model that advances every size group at every step
(which undid the worker's turns: 5 of 64 small requests finished beside one large one, against 26
with both set). Real runner processes serving ``tiny``, whose family batches steps."""

from __future__ import annotations

import grpc
import pytest

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import ServiceProcess, start_runner, start_worker, wait_until
from support import request

W = worker_pb2
pytestmark = [pytest.mark.timeout(300), pytest.mark.process]
NEEDS = "this worker's --schedule budget needs --step-schedule budget"


def test_a_budget_worker_refuses_a_runner_stepping_every_size_group_and_serves_one_taking_turns(tmp_path):
    runners: list[ServiceProcess] = [start_runner(tmp_path)]  # --step-schedule all, the default
    worker = start_worker(tmp_path, runners[0].target, "--schedule", "budget", "--model", "tiny",
                          ready=False)
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=10).state == W.WORKER_STATE_FAILED,
                       120, "the worker refusing its runner")
            status = stub.GetStatus(W.GetStatusRequest(), timeout=10)
            assert NEEDS in status.message and runners[0].target in status.message, status.message
            assert status.runners[0].info.step_schedule == "all" and not status.runners[0].ready
            assert NEEDS in worker.log()
            with pytest.raises(grpc.RpcError) as init:
                stub.Init(W.InitRequest(model="tiny"), timeout=120)
            assert init.value.code() == grpc.StatusCode.FAILED_PRECONDITION and NEEDS in init.value.details()
            assert not stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].ready

            # The same runner started with --step-schedule budget is taken: the refusal was its instance's.
            runners[0].stop()
            runners.append(start_runner(tmp_path, "--step-schedule", "budget", target=runners[0].target))
            wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].ready, 120,
                       "the runner taking turns ready")
            assert stub.GetStatus(W.GetStatusRequest(), timeout=10).runners[0].info.step_schedule == "budget"
            assert len(stub.Generate(request(num_inference_steps=2), timeout=120).images) == 1
    finally:
        worker.stop()
        for runner in runners:
            runner.stop()
