"""A runner group's processes: rank 0 is the calling process, each other device gets a follower.

Why the group dies as one: a rank that is gone leaves the others blocked in a collective (or, worse,
serving with a model missing a shard), so nothing a rank alone could do would recover it. Instead
the whole group exits and the worker's existing restart and retry path starts a fresh one:

- rank 0 watches its followers' process sentinels on a thread; the first follower to end, however
  it ended (kill -9 included), makes rank 0 kill the others and exit with :data:`RANK_DIED_EXIT`;
- a follower asks Linux for SIGKILL when rank 0 dies (``prctl(PR_SET_PDEATHSIG)``; SIGKILL because
  a follower may sit in a C++ collective where no Python signal handler would run), and also
  watches a pipe from rank 0 whose end of file ends it, for the systems without prctl;
- a rank that is alive but stalled (stopped, or wedged) is found by the heartbeat: a thread on each
  rank meets the others once a second in an all-reduce on a gloo group of its own, bounded by
  ``--group-heartbeat-timeout``. A stalled rank runs no thread, so it is the others that notice:
  their round times out, and rank 0 kills the followers and exits with :data:`RANK_DIED_EXIT`, or a
  follower whose rank 0 stalled exits. The compute collectives (the commands, the agreements, the
  device backend's exchanges) keep their long timeouts: a rank may legitimately wait in them for a
  long step of another's, but never for a rank whose heartbeat has stopped;
- a rank whose part of an operation fails mid-way ends the group (``GroupMember.fail``). On rank 0
  that is often the echo of a follower's death (the collective it was in broke): then rank 0 exits
  with :data:`RANK_DIED_EXIT`, as its watcher would, not :data:`BROKEN_EXIT`, whichever thread
  sees the death first.

How a follower starts: forked from rank 0 where rank 0 still runs one thread on Linux, which spares
each follower the imports rank 0 has already paid for (torch, diffusers, transformers: seconds of
CPU each); spawned (a fresh interpreter) otherwise. A fork copies only the forking thread, so it
is safe only where no other thread could hold a lock the child then needs: rank 0 launches before
it touches a device (CUDA's runtime, once initialised, runs threads of its own), and torch's
OpenMP pool, started at its import where ``OMP_NUM_THREADS`` is above 1, makes rank 0 spawn.
Either way the follower is rank 0's child, so the death signal, the sentinels and the pipe above
are the same. The followers start before rank 0 opens anything: every rank joins ``torch.distributed``
through one TCPStore that rank 0 then opens on a port the kernel picks (no port can be taken
between choosing and binding it) and sends each follower down its pipe; then every rank opens a
gloo group for the group's commands (:mod:`runner_service.group.commands`) whatever the
device backend is: commands are small Python objects, and a wait for the next one must not be
bounded by the device backend's timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import NoReturn

import torch
import torch.distributed as dist

from runner_service.config import RunnerConfig
from runner_service.platforms import distributed_backend

logger = logging.getLogger(__name__)

# How rank 0 exits when a follower ended on its own or stalled (and how a follower whose rank 0
# stalled exits): the supervisor (the pod, Kubernetes) restarts it.
RANK_DIED_EXIT = 3
# How a rank exits when its own part of an operation failed and left it unlike the others, or left
# them waiting in a collective it will never join (the group then ends as one).
BROKEN_EXIT = 4
# How often the ranks meet for the heartbeat, at most (a shorter timeout meets more often).
HEARTBEAT_INTERVAL_S = 1.0
MASTER_ADDR = "127.0.0.1"
# How long a rank waits for the others, to join (a follower's imports can take a minute on a
# loaded machine) and in each collective of the device backend (the parallel modes' exchanges).
JOIN_TIMEOUT = timedelta(minutes=5)
# Followers wait on the command group for the next command for as long as the runner idles; a
# rank that died is noticed by this module's watchers, never by this timeout.
COMMAND_TIMEOUT = timedelta(days=365)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class GroupMember:
    """This process's place in the group: what ``serve`` is given on every rank."""

    rank: int
    world_size: int
    device: str
    # The gloo group that carries the commands (runner_service.group.commands).
    commands: dist.ProcessGroup
    # A gloo group for the ranks' agreements inside an operation (whether rank 0's caller still
    # waits; whether to stop at a step): bounded by JOIN_TIMEOUT, so a rank that failed alone
    # before an agreement leaves the others waiting that long at most.
    agreements: dist.ProcessGroup
    # Set once the group is being stopped in order: from then on a follower that ends with exit code
    # 0 is leaving as told, not dying.
    stopping: threading.Event
    # Ends this rank's process because its part of an operation failed mid-way (the caller logs
    # why): the group ends as one, with RANK_DIED_EXIT on rank 0 where a follower's end caused it.
    fail: Callable[[], NoReturn]


@dataclass(frozen=True)
class _Rendezvous:
    """What a follower needs to join, but for the store's port, which comes down its pipe once
    rank 0 has opened the store (picklable: it crosses to a spawned process)."""

    rank: int
    world_size: int
    device: str
    rank0_pid: int
    heartbeat_timeout_s: float


def _join(rendezvous: _Rendezvous, store: dist.TCPStore, stopping: threading.Event, fail: Callable[[], NoReturn],
          stalled: Callable[[str], None]) -> tuple[GroupMember, threading.Thread]:
    """Joins the default process group on this rank's device, opens the command and agreement
    groups, and starts this rank's heartbeat (``stalled`` is called, with why, when it fails)."""
    backend = distributed_backend(rendezvous.device)
    # an accelerator rank binds its device here, so that its backend's communicator is made on it
    device_id = None if backend == "gloo" else torch.device(rendezvous.device)
    dist.init_process_group(backend, store=store, rank=rendezvous.rank, world_size=rendezvous.world_size,
                            timeout=JOIN_TIMEOUT, device_id=device_id)
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    agreements = dist.new_group(backend="gloo", timeout=JOIN_TIMEOUT)
    beats = dist.new_group(backend="gloo", timeout=timedelta(seconds=rendezvous.heartbeat_timeout_s))
    heartbeat = threading.Thread(target=_heartbeat, args=(beats, rendezvous.heartbeat_timeout_s, stopping, stalled),
                                 name="group-heartbeat", daemon=True)
    heartbeat.start()
    member = GroupMember(rendezvous.rank, rendezvous.world_size, rendezvous.device, commands, agreements, stopping,
                         fail)
    return member, heartbeat


def _heartbeat(beats: dist.ProcessGroup, timeout_s: float, stopping: threading.Event,
               stalled: Callable[[str], None]) -> None:
    """This rank's heartbeat: one all-reduce with every other rank each round, which fails when a
    rank has not come for ``timeout_s`` (stopped, wedged, or gone). Each rank brings whether it is
    stopping, so that every rank leaves after the same round once the group stops in order, and
    none is left waiting for the others' next round."""
    interval_s = min(HEARTBEAT_INTERVAL_S, timeout_s / 4)
    while True:
        leaving = torch.tensor([int(stopping.is_set())])
        try:
            dist.all_reduce(leaving, op=dist.ReduceOp.MAX, group=beats)
        except RuntimeError as error:  # gloo's timeout, or a peer's connection closed
            if not stopping.is_set():
                stalled(f"the group's heartbeat failed: a rank did not take part within {timeout_s:g} s, or is "
                        f"gone ({str(error).splitlines()[0]})")
            return
        if leaving.item():
            return
        stopping.wait(interval_s)


def _exit_broken() -> NoReturn:
    """A follower's ``fail``: rank 0's watcher sees it end and ends the group."""
    logging.shutdown()
    os._exit(BROKEN_EXIT)


def _exit_stalled(reason: str) -> NoReturn:
    """A follower's heartbeat failed: another rank is stalled (rank 0, or a follower that rank 0
    ends the group for), and the group cannot serve without it."""
    logger.critical("%s: this rank ends", reason)
    logging.shutdown()
    os._exit(RANK_DIED_EXIT)


def _die_with_rank0(rank0_pid: int, from_rank0: multiprocessing.connection.Connection) -> int:
    """Ends this follower when rank 0 ends: a kernel death signal where there is one, and rank 0's
    pipe closing everywhere. Returns the store's port, the one message rank 0 sends down the pipe."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != rank0_pid:  # rank 0 died before the death signal was asked for
        os._exit(RANK_DIED_EXIT)
    try:
        store_port: int = from_rank0.recv()
    except (EOFError, OSError):  # rank 0 ended before it opened the store
        os._exit(RANK_DIED_EXIT)

    def watch() -> None:
        try:
            from_rank0.recv()  # rank 0 sends nothing more: this returns only by end of file
        except (EOFError, OSError):
            pass
        os._exit(RANK_DIED_EXIT)

    threading.Thread(target=watch, name="rank0-watch", daemon=True).start()
    return store_port


def _follower(rendezvous: _Rendezvous, serve: Callable[[GroupMember], None],
              from_rank0: multiprocessing.connection.Connection,
              rank0_ends: list[multiprocessing.connection.Connection]) -> None:
    """A follower process's entry: joins the group, runs ``serve`` (which follows rank 0's commands).
    ``rank0_ends``: rank 0's ends of the followers' pipes, its own pipe's among them, which a fork
    copied into this process: closed, so that its pipe ends when rank 0 ends."""
    for end in rank0_ends:
        end.close()
    store_port = _die_with_rank0(rendezvous.rank0_pid, from_rank0)
    store = dist.TCPStore(MASTER_ADDR, store_port, rendezvous.world_size, is_master=False, timeout=JOIN_TIMEOUT)
    member, heartbeat = _join(rendezvous, store, threading.Event(), _exit_broken, _exit_stalled)
    serve(member)
    heartbeat.join()  # it leaves in the round that sees the group stopping, with every other rank's
    dist.destroy_process_group()


def _watch_followers(followers: list[BaseProcess], stopping: threading.Event,
                     abandon: multiprocessing.connection.Connection) -> None:
    """Rank 0's watcher: a follower that ends ends the group, unless the group is stopping in order
    and it ended cleanly. Returns when every follower has left in order, or when ``abandon`` is
    signalled (rank 0 is failing and kills the followers itself)."""
    watched = list(followers)
    while watched:
        ready = multiprocessing.connection.wait([*(process.sentinel for process in watched), abandon])
        if abandon in ready:
            return
        ended = [process for process in watched if process.sentinel in ready]
        for process in ended:
            process.join()  # its sentinel closes a moment before its exit code can be read
        if stopping.is_set() and all(process.exitcode == 0 for process in ended):
            watched = [process for process in watched if process not in ended]
            continue
        logger.critical("group %s ended (exit codes %s): the group ends", [process.name for process in ended],
                        [process.exitcode for process in ended])
        _end_group(followers, RANK_DIED_EXIT)


def _end_group(followers: list[BaseProcess], code: int) -> NoReturn:
    """Rank 0 ends the group: kills every follower still there (a stopped one included) and exits."""
    for process in followers:
        if process.is_alive():
            process.kill()
    logging.shutdown()
    os._exit(code)


def _rank0_failed(followers: list[BaseProcess], wait_s: float) -> NoReturn:
    """Rank 0's ``fail``: its part of an operation failed mid-way. When a follower ended first (the
    collective rank 0 was in broke because of it; its sentinel closes with its sockets, so it is
    seen within ``wait_s`` when that is the cause), the group ends as for any rank's death."""
    ended = multiprocessing.connection.wait([process.sentinel for process in followers], timeout=wait_s)
    if ended:
        logger.critical("a follower ended during rank 0's operation: the group ends")
    _end_group(followers, RANK_DIED_EXIT if ended else BROKEN_EXIT)


def _rank0_stalled(followers: list[BaseProcess], reason: str) -> NoReturn:
    """Rank 0's heartbeat failed: a follower is stalled (or gone), and is killed with the others."""
    logger.critical("%s: the group ends", reason)
    _end_group(followers, RANK_DIED_EXIT)


def launch(devices: list[str], serve: Callable[[GroupMember], None], join_timeout_s: float = 60.0,
           heartbeat_timeout_s: float = RunnerConfig.group_heartbeat_timeout) -> None:
    """Runs a group of ``len(devices)`` ranks, rank ``i`` on ``devices[i]``: ``serve`` runs on every
    rank once the group has joined, rank 0's in this process, and returns here when it returns. A
    rank that misses the heartbeat for ``heartbeat_timeout_s`` seconds ends the group.

    ``serve`` must be importable by name (a module-level function, or a ``functools.partial`` of
    one): a follower may be spawned. On rank 0 it serves and sends the commands, on the others it
    follows them; when rank 0's returns it should have told the followers to stop, which this waits
    up to ``join_timeout_s`` for before killing them. Call it before this process runs a second
    thread, or its followers are spawned (the module docstring).
    """
    if not devices:
        raise ValueError("devices: a group needs at least one device")
    for device in devices:
        distributed_backend(device)  # an unknown device is refused before any process starts
    world_size = len(devices)
    forked = _can_fork()
    context = multiprocessing.get_context("fork") if forked else multiprocessing.get_context("spawn")
    if forked:
        # What Python's gc documentation advises before a fork without exec: what rank 0 holds now
        # (its imports, half a million objects) is left out of every later collection, so that no
        # rank's collections write to those shared pages (copy on write) or walk them again (0.2 s
        # of CPU each; a model change collects on every rank).
        gc.collect()
        gc.freeze()
    followers: list[BaseProcess] = []
    pipes: list[multiprocessing.connection.Connection] = []
    for rank in range(1, world_size):
        from_rank0, to_follower = context.Pipe(duplex=False)
        pipes.append(to_follower)
        rank0_ends = list(pipes) if forked else []  # a spawned follower inherits none
        rendezvous = _Rendezvous(rank, world_size, devices[rank], os.getpid(), heartbeat_timeout_s)
        process = context.Process(target=_follower, args=(rendezvous, serve, from_rank0, rank0_ends),
                                  name=f"rank-{rank}")
        process.start()
        logger.info("rank %d of %d on %s: pid %d, %s", rank, world_size, devices[rank], process.pid,
                    "forked" if forked else "spawned")
        from_rank0.close()  # the follower holds the only reading end: it sees end of file when rank 0 ends
        followers.append(process)
    stopping = threading.Event()
    abandoned, abandon = context.Pipe(duplex=False)
    watcher = threading.Thread(target=_watch_followers, args=(followers, stopping, abandoned), name="group-watch",
                               daemon=True)
    watcher.start()
    rendezvous = _Rendezvous(0, world_size, devices[0], os.getpid(), heartbeat_timeout_s)
    try:
        store = dist.TCPStore(MASTER_ADDR, 0, world_size, is_master=True, timeout=JOIN_TIMEOUT,
                              wait_for_workers=False)
        for pipe in pipes:
            with contextlib.suppress(OSError):  # that follower is gone: the watcher ends the group
                pipe.send(store.port)
        member, heartbeat = _join(rendezvous, store, stopping,
                                  functools.partial(_rank0_failed, followers, heartbeat_timeout_s),
                                  functools.partial(_rank0_stalled, followers))
        serve(member)
    except BaseException:
        _end_followers(followers, abandon, watcher, stopping)
        raise
    watcher.join(join_timeout_s)  # it returns once every follower has left in order
    if watcher.is_alive():
        logger.warning("followers %s did not stop within %.0f s: killed",
                       [process.name for process in followers if process.is_alive()], join_timeout_s)
        _end_followers(followers, abandon, watcher, stopping)
    heartbeat.join()  # it ends in the round that sees the group stopping, or at its timeout
    for pipe in pipes:
        pipe.close()
    dist.destroy_process_group()


def _can_fork() -> bool:
    """Whether the followers are forked: this process runs one thread, on Linux (the module docstring)."""
    return sys.platform.startswith("linux") and len(os.listdir("/proc/self/task")) == 1


def _end_followers(followers: list[BaseProcess], abandon: multiprocessing.connection.Connection,
                   watcher: threading.Thread, stopping: threading.Event) -> None:
    """Kills the followers rank 0 gives up on, once neither the watcher nor the heartbeat takes
    their end for a death."""
    stopping.set()
    abandon.send(None)
    watcher.join()
    for process in followers:
        process.kill()
        process.join()
