"""The ModelHost's device operations as runner-group operations (``GroupCommands``): each rank runs
the same one on its own ``ModelHost``, all or nothing.

Every rank holds the same model, so an operation that fails for its input (a bad path, a digest
that does not match, a plan the family cannot take) fails on every rank alike and changes nothing
anywhere. What can fail on one rank alone is the device (memory, a driver error); then the ranks
that succeeded undo their part. Rank 0's caller may also go away (a cancel, a deadline): each
operation asks, right before it changes the model, whether rank 0's call still waits, and every
rank gets the same answer (``AgreedChange``), so all change or none. Otherwise:

- LoadModel loads beside the current model on every rank and switches only when all succeeded
  (then applies the parallel plan, which builds process groups: every rank at once);
- the model-changing operations of ``runner_service/operations.py`` are broadcast as they are and
  each rank runs the same one on its own host (``Replicated``): Sleep is undone by waking what it put
  to sleep, LoadAdapter by unloading the adapter; WakeUp, LoadWeights, PushWeights and UnloadAdapter
  keep no copy of what they replaced (that would double the weights' memory), so where one rank
  alone failed them the group ends (``launch.BROKEN_EXIT``) and the worker's restart path brings up
  a fresh group and applies its desired state again, rather than serving from mismatched ranks.

An execution runs the whole pipeline call on every rank (the denoiser's calls are shared out by
the model's ``ParallelRun``); whether to stop at a step boundary is rank 0's to say and every rank
agrees on it (``AgreedStop``), so no rank is left waiting in a collective the others have left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import torch
import torch.distributed as dist

from runner_service.execution import BatchResult, ExecutionCancelled, StepCallback, StopFlag
from runner_service.group.commands import Operation
from runner_service.group.launch import GroupMember
from runner_service.operations import DeviceOperation, Host, PushWeights
from runner_service.parallel import apply, check, refusal
from runner_service.pipeline_adapter import ImageRows, short_reason
from runner_service.platforms import MemoryUsage, Platform
from serving_common.errors import ServiceError, failed_precondition
from serving_common.generation_params import GenerationParams

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from diffusion.v1 import runner_pb2
    from runner_service.loaded_model import LoadedModel


class RankHost(Host, Protocol):
    """One rank's host, as the group's operations use it (``core.ModelHost``)."""

    @property
    def platform(self) -> Platform: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def group_member(self) -> GroupMember: ...

    def run_here(self, items: list[runner_pb2.ExecuteItem], on_step: StepCallback,
                 cancelled: StopFlag) -> BatchResult: ...


def _rank0_says(member: GroupMember, flag: bool) -> bool:
    """Rank 0's ``flag``, as every rank receives it (the followers' own is ignored)."""
    value = torch.tensor([int(flag)])
    dist.broadcast(value, src=0, group=member.agreements)
    return bool(value.item())


class AgreedChange:
    """The ``before_change`` each rank's operation calls right before it changes the model: rank 0
    asks its caller's watch (the call may have ended: cancelled, or past its deadline) and every
    rank gets the answer, so either all go on or all stop there with nothing changed. The ranks
    call it at the same points, as each runs the same operation on the same state."""

    def __init__(self, member: GroupMember, before_change: Callable[[], None] | None) -> None:
        self._member = member
        self._before_change = before_change  # rank 0's; None on the followers

    def __call__(self) -> None:
        refusal: ServiceError | None = None
        if self._before_change is not None:
            try:
                self._before_change()
            except ServiceError as error:
                refusal = error
        if _rank0_says(self._member, refusal is None):
            return
        if refusal is not None:
            raise refusal
        raise ServiceError(grpc.StatusCode.CANCELLED, "rank 0's call ended before the change; nothing changed")


class AgreedStop:
    """A ``StopFlag`` every rank reads alike: rank 0's event, broadcast at each check (each rank
    checks at the same step boundaries, as each runs the same call)."""

    def __init__(self, member: GroupMember, event: StopFlag | None) -> None:
        self._member = member
        self._event = event  # rank 0's; None on the followers

    def is_set(self) -> bool:
        return _rank0_says(self._member, self._event is not None and self._event.is_set())


class NotUndoable(RuntimeError):
    """Raised by an undo that cannot restore this rank: the group ends (``launch.BROKEN_EXIT``)."""


class Replicated:
    """A ``DeviceOperation`` broadcast as it is (``arguments``), which each rank runs on its own host;
    undone where another rank failed, when it can be, else the group ends. Followers return None:
    rank 0 answers."""

    def __init__(self, host: RankHost) -> None:
        self._host = host
        self._operation: DeviceOperation[Any] | None = None

    def do(self, arguments: DeviceOperation[Any], local: Any) -> Any:
        self._operation = arguments
        result = arguments.run(self._host, AgreedChange(self._host.group_member(), local))
        return result if self._host.rank == 0 else None

    def commit(self) -> None:
        pass

    def undo(self) -> None:
        operation = self._operation
        assert operation is not None
        if not operation.UNDOABLE:
            raise NotUndoable(f"{operation.NAME} keeps no copy of what it replaced, so it cannot be undone")
        operation.undo(self._host)


class Push:
    """PushWeights on a group: ``arguments`` = ([(name, dtype, shape)], digest), ``local`` = rank 0's
    (before_change, tensors). Each tensor goes to every rank by its own broadcast, as bytes, so no
    rank holds more than the pushed tensors once (a pickled dict would hold them twice or more)."""

    def __init__(self, host: RankHost) -> None:
        self._host = host

    def do(self, arguments: Any, local: Any) -> Any:
        listing, digest = arguments
        before_change, pushed = local if local is not None else (None, None)
        member = self._host.group_member()
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape in listing:
            tensor = pushed[name].contiguous() if pushed is not None else torch.empty(shape, dtype=dtype)
            dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=0, group=member.agreements)
            tensors[name] = tensor
        result = PushWeights(tensors, digest).run(self._host, AgreedChange(member, before_change))
        return result if self._host.rank == 0 else None

    def commit(self) -> None:
        pass

    def undo(self) -> None:
        raise NotUndoable("PushWeights keeps no copy of what it replaced, so it cannot be undone")


class Load:
    """LoadModel on a group: ``arguments`` = (source, dtype name, AccelerationPlan, ParallelPlan,
    LoadOptions).

    Every rank loads the new model beside its current one and the ranks compare outcomes before
    anything collective: a rank that failed alone (its device full) fails the load everywhere at
    once, not after the others' timeout. Then, with rank 0's caller still waiting, the plan is
    applied on every rank and one guided step runs through it (the group's canary); only then is
    the load ready to commit, which switches models without another exchange."""

    def __init__(self, host: RankHost) -> None:
        self._host = host
        self._new: LoadedModel | None = None

    def do(self, arguments: Any, local: Any) -> None:
        source, dtype_name, acceleration, plan, options = arguments
        member = self._host.group_member()
        slot = self._host.slot
        new: LoadedModel | None = None
        failure: Exception | None = None
        try:
            new = slot.load_beside(slot.check(source, options), dtype_name, acceleration)
            violations = check(plan, new.pipeline, self._host.world_size)
            if violations:
                raise refusal(violations)
        except Exception as error:  # noqa: BLE001 - every rank learns whether all loaded, then raises
            failure = error
        try:
            if not _every_rank_says(member, failure is None):
                raise failure or failed_precondition(f"loading {source!r} failed on another rank; nothing changed")
            assert new is not None
            AgreedChange(member, local)()
            new.parallel = apply(plan, new.pipeline, new.device)
            _canary(new)
        except BaseException:
            new = None
            slot.free_memory()
            raise
        self._new = new

    def commit(self) -> None:
        new, self._new = self._new, None
        assert new is not None  # do succeeded
        self._host.slot.install(new)

    def undo(self) -> None:
        self._new = None
        self._host.slot.free_memory()


def _every_rank_says(member: GroupMember, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=member.agreements)
    return bool(value.item())


def _canary(model: LoadedModel) -> None:
    """One step of one image (or video of the fewest frames) at the smallest size the plan takes,
    guided where the plan splits guidance, through the applied plan: a plan that loads but cannot
    generate fails the load here (the same on every rank) instead of every request after it."""
    parallel = model.parallel
    assert parallel is not None
    capabilities = model.capabilities
    task = next((task for task in ("TEXT_TO_IMAGE", "TEXT_TO_VIDEO") if task in capabilities.tasks), None)
    if task is None:
        return  # an edit model: its canary needs an image, and ran per rank at load
    size = capabilities.min_size or capabilities.size_multiple
    guidance, true_cfg = (2.0, 2.0) if parallel.split is not None else (capabilities.default_guidance, None)
    frames = capabilities.video.min_frames if capabilities.video is not None else 0
    pipeline = model.adapter.for_task(task)
    try:
        with torch.inference_mode(), parallel.request(parallel.guided(pipeline.scales(guidance, true_cfg))):
            pipeline.generate(ImageRows.of("canary", "", [0]),
                              GenerationParams(width=size, height=size, num_inference_steps=1, guidance_scale=guidance,
                                               true_cfg_scale=true_cfg, num_frames=frames),
                              lambda done, total: None)
    except Exception as error:  # noqa: BLE001 - any failure means the plan cannot serve
        raise failed_precondition(f"{model.source!r} with parallel {parallel.plan}: one step at {size}x{size} "
                                  f"failed: {short_reason(error)}") from None


class Execute:
    """One batch on every rank: ``arguments`` = the Execute items, ``local`` = rank 0's (progress
    callback, cancellation event). Rank 0 returns the outputs and weights version."""

    def __init__(self, host: RankHost) -> None:
        self._host = host

    def do(self, arguments: Any, local: Any) -> Any:
        on_step, cancelled = local if local is not None else (lambda _: None, None)
        try:
            outputs = self._host.run_here(arguments, on_step, AgreedStop(self._host.group_member(), cancelled))
        except (ServiceError, ExecutionCancelled):
            raise  # a refusal every rank makes alike, before the denoiser or after it; or an agreed stop
        except Exception:
            # Failed mid-call, maybe alone (its device out of memory): the other ranks wait in a
            # collective it will never join. The group ends now, not at the backend's timeout,
            # and the worker retries the request on the group that replaces it.
            logger.critical("an execution failed on rank %d mid-call: the group ends", self._host.rank,
                            exc_info=True)
            self._host.group_member().fail()
        return outputs if self._host.rank == 0 else None

    def commit(self) -> None:
        pass

    def undo(self) -> None:
        pass  # an execution changes no state


@dataclass(frozen=True)
class RankDevice:
    """One rank's device as GetInfo lists it (gathered from every rank)."""

    rank: int
    device_name: str
    memory: MemoryUsage


class Describe:
    """Each rank's device and its memory now."""

    def __init__(self, host: RankHost) -> None:
        self._host = host

    def do(self, arguments: Any, local: Any) -> RankDevice:
        platform = self._host.platform
        return RankDevice(self._host.rank, platform.device_name(), platform.memory())

    def commit(self) -> None:
        pass

    def undo(self) -> None:
        pass


def group_operations(host: RankHost) -> dict[str, Callable[[], Operation]]:
    """Every operation a group's host runs on all of its ranks, by the name rank 0 broadcasts."""
    return {
        "load": lambda: Load(host),
        "execute": lambda: Execute(host),
        "describe": lambda: Describe(host),
        "replicated": lambda: Replicated(host),
        "push": lambda: Push(host),
    }
