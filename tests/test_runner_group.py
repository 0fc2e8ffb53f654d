"""A runner group on two real gloo ranks (issue 27): operations run on both, all or nothing, and
the group dies as one.

Each test starts rank 0 as a spawned process that calls ``launch`` (which starts rank 1) and
serves this test through a pipe: every message is one ``GroupCommands.run`` or a stop. The ranks'
state is a stand-in for a model, a dict of tensors; what is under test is the group itself. Rank 0
runs one thread, so its follower is forked (``launch``), except where a test asks for a rank 0
running a second thread, whose follower is spawned.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.processes import wait_until
from runner_service.group import (
    RANK_DIED_EXIT,
    GroupCommands,
    GroupMember,
    GroupOperationError,
    Operation,
    launch,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.process]

# A deadline for a group to start (two fresh interpreters importing torch on a loaded machine) or
# to end, never a measure.
DEADLINE_S = 120.0

# This rank's stand-in model: named tensors.
STATE: dict[str, torch.Tensor] = {}
# Rank 0's line to the test (set in rank 0's process only).
_TEST_LINE: list[multiprocessing.connection.Connection] = []


class Put:
    """Sets a tensor at once and keeps the one it replaced until the group commits; fails on the
    rank named in its arguments (as a load that does not fit on one device would)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.key = ""
        self.previous: torch.Tensor | None = None

    def do(self, arguments: tuple[str, list[float], int | None], local: None) -> str:
        self.key, values, failing_rank = arguments
        if self.rank == failing_rank:  # a do that fails leaves its rank as it was
            raise ValueError(f"no room for {self.key!r} on this rank")
        self.previous = STATE.get(self.key)
        STATE[self.key] = torch.tensor(values)
        return f"rank {self.rank} holds {self.key}"

    def commit(self) -> None:
        self.previous = None

    def undo(self) -> None:
        if self.previous is None:
            del STATE[self.key]
        else:
            STATE[self.key] = self.previous


class Read:
    """What this rank holds, and which process it is."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def do(self, arguments: None, local: None) -> dict[str, Any]:
        # rank 0 sets its test line before it launches: a forked follower holds a copy, a spawned one none
        return {"rank": self.rank, "pid": os.getpid(), "state": {key: value.tolist() for key, value in STATE.items()},
                "copied_from_rank0": bool(_TEST_LINE)}

    def commit(self) -> None:
        pass

    def undo(self) -> None:
        pass


class Stall(Read):
    """Never returns on rank 1, once it has said so in the file its arguments name: rank 0 then
    waits for rank 1's outcome in the group's collective."""

    def do(self, arguments: Any, local: None) -> dict[str, Any]:
        if self.rank == 1:
            with open(str(arguments), "w"):
                pass
            threading.Event().wait()
        return super().do(None)


def _operations(member: GroupMember) -> dict[str, Any]:
    def put() -> Operation:
        return Put(member.rank)

    def read() -> Operation:
        return Read(member.rank)

    def stall() -> Operation:
        return Stall(member.rank)

    return {"put": put, "read": read, "stall": stall}


def _serve(member: GroupMember) -> None:
    """Every rank's serve: rank 0 runs what the test sends, the follower follows."""
    commands = GroupCommands(member, _operations(member))
    if member.rank != 0:
        commands.follow()
        return
    line = _TEST_LINE[0]
    while True:
        message = line.recv()
        if message == "stop":
            commands.stop()
            line.send(("stopped", None))
            return
        operation, arguments = message
        try:
            line.send(("ok", commands.run(operation, arguments)))
        except GroupOperationError as error:
            line.send(("failed", (str(error), error.failures)))


def _rank0(line: multiprocessing.connection.Connection, threaded: bool) -> None:
    """Rank 0; ``threaded``: running a second thread when it launches, as torch's OpenMP pool does
    with ``OMP_NUM_THREADS`` above 1 (the suite sets 1)."""
    torch.set_num_threads(1)
    _TEST_LINE.append(line)
    if threaded:
        threading.Thread(target=threading.Event().wait, name="second", daemon=True).start()
    launch(["cpu", "cpu"], _serve)


@dataclass
class Group:
    rank0: multiprocessing.process.BaseProcess
    line: multiprocessing.connection.Connection

    def call(self, message: Any) -> tuple[str, Any]:
        self.line.send(message)
        if not self.line.poll(DEADLINE_S):
            pytest.fail(f"the group did not answer {message!r} within {DEADLINE_S} s")
        answer: tuple[str, Any] = self.line.recv()
        return answer

    def read(self) -> list[dict[str, Any]]:
        status, results = self.call(("read", None))
        assert status == "ok", results
        return list(results)


@pytest.fixture
def group(request: pytest.FixtureRequest) -> Iterator[Group]:
    """A group whose rank 0 runs one thread (its follower forked), or a second one where the test
    is parametrized with ``threaded`` (its follower spawned)."""
    context = multiprocessing.get_context("spawn")
    line, rank0_line = context.Pipe()
    rank0 = context.Process(target=_rank0, args=(rank0_line, getattr(request, "param", "") == "threaded"),
                            name="rank-0")
    rank0.start()
    rank0_line.close()
    try:
        yield Group(rank0, line)
    finally:
        if rank0.is_alive():
            rank0.kill()  # its follower dies with it
        rank0.join(DEADLINE_S)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` (not this process's child) has ended: gone, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_operations_run_on_every_rank_all_or_nothing(group: Group) -> None:
    status, results = group.call(("put", ("w", [1.0, 2.0], None)))
    assert (status, results) == ("ok", ["rank 0 holds w", "rank 1 holds w"])
    before = group.read()
    assert [(result["rank"], result["state"]) for result in before] == [(0, {"w": [1.0, 2.0]}), (1, {"w": [1.0, 2.0]})]
    assert before[0]["pid"] == group.rank0.pid and before[1]["pid"] != group.rank0.pid

    # rank 1 fails: rank 0, which had already replaced its tensor, puts the old one back
    status, (message, failures) = group.call(("put", ("w", [9.0, 9.0], 1)))
    assert status == "failed"
    assert failures == {1: "ValueError: no room for 'w' on this rank"}
    assert "put failed on rank(s) [1]" in message and "rank 1: ValueError: no room for 'w'" in message
    assert [result["state"] for result in group.read()] == [{"w": [1.0, 2.0]}] * 2

    # rank 0 fails on a new name: rank 1 removes the tensor it had added
    status, (_, failures) = group.call(("put", ("v", [3.0], 0)))
    assert (status, list(failures)) == ("failed", [0])
    assert [result["state"] for result in group.read()] == [{"w": [1.0, 2.0]}] * 2

    status, results = group.call(("put", ("v", [3.0], None)))
    assert status == "ok"
    assert [result["state"] for result in group.read()] == [{"w": [1.0, 2.0], "v": [3.0]}] * 2

    # an orderly stop: the follower leaves as told and rank 0 exits cleanly
    assert group.call("stop")[0] == "stopped"
    group.rank0.join(DEADLINE_S)
    assert group.rank0.exitcode == 0
    assert _ended(before[1]["pid"])


@pytest.mark.parametrize(("group", "forked"), [("one thread", True), ("threaded", False)], indirect=["group"])
def test_rank0_killed_ends_follower(group: Group, forked: bool) -> None:
    """Its follower forked (rank 0 runs one thread) or spawned (rank 0 runs a second): either dies with it."""
    rank0, follower = group.read()
    assert rank0["copied_from_rank0"] and follower["copied_from_rank0"] == forked
    pid = follower["pid"]
    assert not _ended(pid) and group.rank0.pid is not None
    os.kill(group.rank0.pid, signal.SIGKILL)
    wait_until(lambda: _ended(pid), DEADLINE_S, "rank 1 to end after rank 0 was killed")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_follower_killed_or_stopped_ends_rank0(group: Group, tmp_path: Path, signum: int) -> None:
    """Even while rank 0 waits for that follower in an operation's collective. A follower alive but
    running nothing (SIGSTOP) goes unheard in the heartbeat: rank 0 kills it and ends the group as
    for a death, with no timeout of the collectives' reached."""
    follower = group.read()[1]["pid"]
    stalled = tmp_path / "stalled"
    group.line.send(("stall", str(stalled)))
    wait_until(stalled.exists, DEADLINE_S, "rank 1 to be inside the operation")
    os.kill(follower, signum)
    group.rank0.join(DEADLINE_S)
    assert group.rank0.exitcode == RANK_DIED_EXIT
    wait_until(lambda: _ended(follower), DEADLINE_S, "rank 1 to be gone with the group")


def test_rank0_stopped_ends_follower(group: Group) -> None:
    """Rank 0 stopped (SIGSTOP) is not dead, so no death signal comes: the follower stops hearing
    its heartbeat and ends."""
    follower = group.read()[1]["pid"]
    assert group.rank0.pid is not None
    os.kill(group.rank0.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: _ended(follower), DEADLINE_S, "rank 1 to end after rank 0 was stopped")
    finally:
        os.kill(group.rank0.pid, signal.SIGCONT)
    group.rank0.join(DEADLINE_S)
    assert group.rank0.exitcode == RANK_DIED_EXIT  # continued, rank 0 finds its follower gone


@pytest.mark.parametrize(("devices", "refusal"), [
    (["cpu", "tpu:0"], "devices: unknown device 'tpu:0'"),
    (["cuda:0", "cuda"], "devices: 'cuda' needs its index"),
    ([], "devices: a group needs at least one device"),
])
def test_bad_devices_are_refused_naming_the_field(devices: list[str], refusal: str) -> None:
    """Before any process starts."""
    with pytest.raises(ValueError, match=f"^{refusal}"):
        launch(devices, _serve)
