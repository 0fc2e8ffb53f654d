"""The worker's part of InitRequest.parallel (issue 27): it reaches every runner's LoadModel (from
Init, from the --model flags, after a runner or the worker restarts), is kept in the state file, is
reported back from the runners (ModelInfo.parallel, RunnerInfo.devices), and a degree past the
worker's bound, or one a runner refuses, is INVALID_ARGUMENT naming the field.

The worker is the thing under test: it runs as a real process against in-process fake runner groups
(``GroupRunner``: ``tests/fake_runner.py`` with ``DEVICES`` devices that records each LoadModel and
refuses a parallelism its devices cannot hold, as a runner group does), served from a thread of this
process so that a test can replace one with a new instance on the same socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
import pytest

from clients.client import DiffusionClient
from diffusion.v1 import common_pb2, runner_pb2, worker_pb2
from fake_runner import FakeRunner, serve_fake_runner
from harness.processes import ServiceProcess, start_worker, wait_until, worker_stub
from serving_common.errors import field_violations, invalid_argument
from support import cli
from worker_service.desired_state import DesiredState
from worker_service.state_store import StateStore

pytestmark = pytest.mark.process
T = TypeVar("T")
DEVICES = 2
CFG = common_pb2.Parallelism(cfg=True)


class GroupRunner(FakeRunner):
    """A fake runner of ``DEVICES`` devices: it records each LoadModel, echoes the parallelism it took
    in ModelInfo.parallel, and refuses one needing more devices than it has (naming
    ``parallel.ulysses_degree``), keeping the model it held."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[runner_pb2.LoadModelRequest] = []

    def info(self) -> common_pb2.RunnerInfo:
        info = super().info()
        info.devices.extend(common_pb2.DeviceInfo(rank=rank, device_name=f"fake:{rank}") for rank in range(DEVICES))
        return info

    async def LoadModel(self, request: runner_pb2.LoadModelRequest,
                        context: grpc.aio.ServicerContext) -> runner_pb2.LoadModelResponse:
        self.loads.append(request)
        asked = request.parallel
        needed = (2 if asked.cfg else 1) * max(asked.ulysses_degree, 1) * max(asked.ring_degree, 1)
        if needed > DEVICES:
            await invalid_argument({"parallel.ulysses_degree": f"needs {needed} devices, the group has {DEVICES}"}
                                   ).abort(context)
        await super().LoadModel(request, context)
        assert self.model is not None
        self.model.parallel.CopyFrom(asked)
        return runner_pb2.LoadModelResponse(info=self.info())


class Runners:
    """``count`` GroupRunners on unix sockets, served by an event loop on a thread of this process."""

    def __init__(self, directory: Path, count: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.targets = [f"unix:{directory}/group-runner-{i}.sock" for i in range(count)]
        self.fakes: list[GroupRunner] = []
        self.servers: list[grpc.aio.Server] = []
        for target in self.targets:
            self.fakes.append(GroupRunner())
            self.servers.append(self.call(serve_fake_runner(self.fakes[-1], target)))

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def restart(self, index: int) -> GroupRunner:
        """Replaces runner ``index`` with a new instance on the same socket, as a restarted process."""
        self.call(self.servers[index].stop(0))
        self.fakes[index] = GroupRunner()
        self.servers[index] = self.call(serve_fake_runner(self.fakes[index], self.targets[index]))
        return self.fakes[index]

    def close(self) -> None:
        for server in self.servers:
            self.call(server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextlib.contextmanager
def runners(directory: Path, count: int = 2) -> Iterator[Runners]:
    group = Runners(directory, count)
    try:
        yield group
    finally:
        group.close()


@contextlib.contextmanager
def worker_on(group: Runners, log_dir: Path, *flags: str) -> Iterator[ServiceProcess]:
    """A worker serving ``shapes`` on every runner of ``group``, with ``flags``; returned once all are ready."""
    runner_flags = [flag for target in group.targets[1:] for flag in ("--runner", target)]
    worker = start_worker(log_dir, group.targets[0], *runner_flags, "--model", "shapes",
                          "--runner-poll-interval", "0.1", *flags)
    try:
        wait_until(lambda: all(r.ready for r in status(worker).runners), 30, "every runner ready")
        yield worker
    finally:
        worker.stop()


def status(worker: ServiceProcess) -> worker_pb2.GetStatusResponse:
    with worker_stub(worker.target, warm=False) as stub:
        response: worker_pb2.GetStatusResponse = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    return response


def init_refused(worker: ServiceProcess, parallel: common_pb2.Parallelism) -> dict[str, str]:
    """The field violations of an Init of ``shapes`` with ``parallel``, which must be INVALID_ARGUMENT."""
    with worker_stub(worker.target, warm=False) as stub, pytest.raises(grpc.RpcError) as refused:
        stub.Init(worker_pb2.InitRequest(model="shapes", parallel=parallel), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    return field_violations(cast(grpc.Call, refused.value))


def test_init_parallel_reaches_every_runners_load_model_and_comes_back_in_their_info(tmp_path):
    """The --model flags' parallelism is the first LoadModel's; Init's replaces it on every runner,
    and the status reports what each runner took and its devices."""
    with runners(tmp_path) as group, worker_on(group, tmp_path, "--ring-degree", "2") as worker:
        assert [[load.parallel for load in fake.loads] for fake in group.fakes] == [
            [common_pb2.Parallelism(ring_degree=2)]] * 2
        with DiffusionClient(worker.target) as client:
            done = client.init("shapes", parallel={"cfg": True})
        assert done.model.parallel == CFG
        assert [fake.loads[-1].parallel for fake in group.fakes] == [CFG, CFG]
        shown = status(worker)
        assert shown.model.parallel == CFG
        assert [(r.ready, r.info.model.parallel) for r in shown.runners] == [(True, CFG)] * 2
        assert [[d.device_name for d in r.info.devices] for r in shown.runners] == [["fake:0", "fake:1"]] * 2


def test_a_degree_past_the_bound_is_refused_before_any_runner_and_a_runners_refusal_comes_back(tmp_path):
    """65 is refused by the worker (no LoadModel is sent); 2 x 2 devices on a group of 2 by the runners,
    whose status comes back unchanged while the model serves on with the parallelism it had."""
    with runners(tmp_path) as group, worker_on(group, tmp_path, "--cfg-parallel") as worker:
        loads = [len(fake.loads) for fake in group.fakes]
        assert set(init_refused(worker, common_pb2.Parallelism(ulysses_degree=65, ring_degree=1000))) == {
            "parallel.ulysses_degree", "parallel.ring_degree"}
        assert init_refused(worker, common_pb2.Parallelism(ulysses_degree=64, ring_degree=2)) == {
            "parallel.ulysses_degree": "needs 128 devices, the group has 2"}
        assert [len(fake.loads) for fake in group.fakes] == [count + 1 for count in loads]
        shown = status(worker)
        assert shown.state == worker_pb2.WORKER_STATE_READY and shown.model.parallel == CFG
        with worker_stub(worker.target, warm=False) as stub:
            assert stub.Generate(worker_pb2.GenerateRequest(prompt="a red circle", width=16, height=16,
                                                            num_inference_steps=2), timeout=30).images


def test_the_cli_inits_with_parallel_flags_and_reports_a_refused_degree(tmp_path):
    with runners(tmp_path, 1) as group, worker_on(group, tmp_path) as worker:
        done = cli("--target", worker.target, "init", "shapes", "--ulysses-degree", "2")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["model"]["parallel"]["ulyssesDegree"] == 2
        assert group.fakes[0].loads[-1].parallel == common_pb2.Parallelism(ulysses_degree=2)
        refused = cli("--target", worker.target, "init", "shapes", "--cfg-parallel", "--ring-degree", "65")
        assert refused.returncode != 0 and "parallel.ring_degree" in refused.stderr, refused.stderr
        assert group.fakes[0].loads[-1].parallel == common_pb2.Parallelism(ulysses_degree=2)


def test_a_restarted_runner_and_a_restarted_worker_get_inits_parallel_again(tmp_path):
    """A runner back as a new instance is loaded with Init's parallelism; so is a fresh runner of a new
    worker on the same state file, whose --model flags ask for none."""
    state = tmp_path / "state.json"
    with runners(tmp_path) as group:
        with worker_on(group, tmp_path, "--state-file", str(state)) as worker:
            with DiffusionClient(worker.target) as client:
                client.init("shapes", parallel=common_pb2.Parallelism(cfg=True))
            assert json.loads(state.read_text())["parallel"] == {"cfg": True}
            before = status(worker).runners[0].info.instance_id
            restarted = group.restart(0)
            wait_until(lambda: (lambda r: r.ready and r.info.instance_id not in ("", before))(
                status(worker).runners[0]), 30, "the restarted runner ready")
            assert [load.parallel for load in restarted.loads] == [CFG]
        fresh = group.restart(1)
        with worker_on(group, tmp_path, "--state-file", str(state)) as worker:
            assert [load.parallel for load in fresh.loads] == [CFG]
            assert [r.info.model.parallel for r in status(worker).runners] == [CFG, CFG]


def test_a_runner_holds_the_desired_state_only_with_its_parallelism():
    desired = DesiredState.loading("shapes", common_pb2.DTYPE_UNSPECIFIED, None, CFG)
    info = common_pb2.RunnerInfo(model=common_pb2.ModelInfo(source="shapes", parallel=CFG))
    assert desired.held_by(info)
    info.model.parallel.CopyFrom(common_pb2.Parallelism(ulysses_degree=2))
    assert not desired.held_by(info)
    info.model.ClearField("parallel")
    assert not desired.held_by(info)
    assert DesiredState.loading("shapes", common_pb2.DTYPE_UNSPECIFIED, None, None).held_by(info)


def test_a_state_file_written_before_parallel_loads_with_one_device(tmp_path):
    path = tmp_path / "state.json"
    StateStore(str(path)).save(DesiredState.loading("shapes", common_pb2.DTYPE_UNSPECIFIED, None, CFG))
    saved = json.loads(path.read_text())
    assert saved["parallel"] == {"cfg": True}
    loaded = StateStore(str(path)).load()
    assert loaded is not None and loaded.parallel_message() == CFG
    del saved["parallel"]
    path.write_text(json.dumps(saved))
    loaded = StateStore(str(path)).load()
    assert loaded is not None and loaded.model == "shapes"
    assert loaded.parallel_message() == common_pb2.Parallelism()
    saved["parallel"] = {"no_such_field": 1}
    path.write_text(json.dumps(saved))
    assert StateStore(str(path)).load() is None

