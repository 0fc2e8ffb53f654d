"""The group's device operations, applied on every rank all or nothing.

Rank 0 is the only rank that serves, so it is the only one that decides: ``GroupCommands.run``
broadcasts ``(operation, arguments)`` on the command group and every rank, rank 0 included, runs
the same registered :class:`Operation` on its own state. Each rank's outcome is then gathered on
every rank, so that all of them take the same decision without another message: if every rank
succeeded, each commits; if any failed, those that succeeded undo, and rank 0 raises one error
naming each rank that failed and why. A load keeps the previous model until every rank holds the
new one, so a load that failed on one rank leaves every rank on the old model.

A rank whose commit or undo fails no longer holds what the others hold, and no message can bring
it back: it exits (``GroupMember.fail``: ``launch.BROKEN_EXIT``), which ends the whole group
(runner_service.group.launch) and hands recovery to the worker's restart path rather than serving
from mismatched ranks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from runner_service.group.launch import GroupMember

logger = logging.getLogger(__name__)

# The command that ends the followers' loop (no operation may take this name).
_STOP = "__stop__"


class Operation(Protocol):
    """One device operation in two phases, run on every rank of the group.

    ``do`` applies it on this rank keeping whatever ``undo`` needs (a load keeps the previous
    model), and returns this rank's result (a follower's is pickled and gathered; rank 0's stays in
    its process, so it may be large: an execution's images). ``local`` is what rank 0's caller
    passes beside the broadcast arguments and never leaves rank 0 (its call's watch, its progress
    callback); None on the other ranks. Then, on every
    rank at once, ``commit`` when all ranks' ``do`` succeeded (drop what undo needed, switch to the
    new), or ``undo`` when another rank's failed. A ``do`` that raises must leave its own rank as
    it was (a load that does not fit keeps the old model), since only the ranks whose ``do``
    succeeded are asked to undo. A fresh
    operation object is made for each call, so it can hold that call's undo state.
    """

    def do(self, arguments: Any, local: Any) -> Any: ...

    def commit(self) -> None: ...

    def undo(self) -> None: ...


class GroupOperationError(RuntimeError):
    """An operation failed on some ranks; every rank is back where it was before it."""

    def __init__(self, operation: str, failures: dict[int, str], own: Exception | None = None) -> None:
        self.operation = operation
        self.failures = failures
        # This rank's own error, where it failed too (rank 0 reports it with its status code).
        self.own = own
        reasons = "; ".join(f"rank {rank}: {reason}" for rank, reason in sorted(failures.items()))
        super().__init__(f"{operation} failed on rank(s) {sorted(failures)} and was undone on every rank ({reasons})")


@dataclass(frozen=True)
class _Outcome:
    """One rank's ``do``: its result, or why it failed."""

    result: Any = None
    error: str | None = None


class GroupCommands:
    """Rank 0 runs operations on the whole group with ``run``; the other ranks ``follow``.

    ``operations`` maps each operation's name to a factory of a fresh :class:`Operation`; every
    rank registers the same names. One operation runs at a time (rank 0 serialises its callers):
    the ranks must meet in the same collectives in the same order.
    """

    def __init__(self, member: GroupMember, operations: Mapping[str, Callable[[], Operation]]) -> None:
        if _STOP in operations:
            raise ValueError(f"operations: {_STOP!r} is reserved")
        self._member = member
        self._operations = dict(operations)
        self._lock = threading.Lock()

    def run(self, operation: str, arguments: Any = None, local: Any = None) -> list[Any]:
        """Runs ``operation`` on every rank (rank 0 only, ``local`` for its own ``do``); each rank's
        result, by rank.

        Raises :class:`GroupOperationError` after every rank has undone it, when it failed on any.
        """
        if self._member.rank != 0:
            raise RuntimeError("only rank 0 runs the group's operations; the others follow")
        if operation not in self._operations:
            raise KeyError(f"operation {operation!r} is not registered")
        with self._lock:
            if self._member.stopping.is_set():
                raise RuntimeError("the group is stopping")
            self._broadcast(operation, arguments)
            return self._apply(operation, arguments, local)

    def follow(self) -> None:
        """A follower's loop: runs each operation rank 0 sends, until rank 0 stops the group."""
        while True:
            operation, arguments = self._broadcast(None, None)
            if operation == _STOP:
                self._member.stopping.set()
                return
            try:
                self._apply(operation, arguments, None)
            except GroupOperationError:  # rank 0 reports it; this rank has undone its part
                pass

    def stop(self) -> None:
        """Tells the followers to leave (rank 0, after its last operation): their ``follow`` returns."""
        with self._lock:
            self._member.stopping.set()  # before the followers can end: their exit is expected
            self._broadcast(_STOP, None)

    def _broadcast(self, operation: str | None, arguments: Any) -> tuple[str, Any]:
        """Rank 0's command, as every rank receives it."""
        message: list[Any] = [(operation, arguments)]
        self._exchange(lambda: dist.broadcast_object_list(message, src=0, group=self._member.commands))
        command: tuple[str, Any] = message[0]
        return command

    def _exchange(self, collective: Callable[[], None]) -> None:
        """One collective of the command group. One that fails (a rank died, its connection broke)
        leaves the ranks out of step for good: this rank ends the group rather than answer its
        caller with the collective's error (the worker retries a request on a group that ended, but
        not one that failed it)."""
        try:
            collective()
        except RuntimeError:  # torch.distributed's errors, DistBackendError included
            logger.critical("the group's commands broke on rank %d: the group ends", self._member.rank, exc_info=True)
            self._member.fail()

    def _apply(self, operation: str, arguments: Any, local: Any) -> list[Any]:
        """Runs the operation on this rank and, from every rank's outcome, commits or undoes it."""
        step: Operation | None = None
        own: Any = None
        own_error: Exception | None = None
        try:
            step = self._operations[operation]()
            own = step.do(arguments, local)
            outcome = _Outcome(result=None if self._member.rank == 0 else own)
        except Exception as error:  # reported to rank 0, which raises it for the whole group
            logger.info("%s failed on rank %d: %s", operation, self._member.rank, error)
            own_error = error
            outcome = _Outcome(error=f"{type(error).__name__}: {error}")
        outcomes: list[Any] = [None] * self._member.world_size
        self._exchange(lambda: dist.all_gather_object(outcomes, outcome, group=self._member.commands))
        failures = {rank: ranked.error for rank, ranked in enumerate(outcomes) if ranked.error is not None}
        if step is not None and outcome.error is None:
            phase = step.undo if failures else step.commit
            try:
                phase()
            except Exception:
                logger.critical("%s of %s failed on rank %d: its state no longer matches the group's; the group "
                                "ends", phase.__name__, operation, self._member.rank, exc_info=True)
                self._member.fail()
        if failures:
            raise GroupOperationError(operation, failures, own_error)
        return [own, *(ranked.result for ranked in outcomes[1:])]
