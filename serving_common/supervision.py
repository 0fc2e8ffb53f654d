"""A supervised service dies with its supervisor, even one killed with SIGKILL (``deploy/pod.py``).

The supervisor puts its pid in ``DIFFUSION_PARENT_PID`` for its children; each child's ``main`` calls
:func:`die_with_parent` first thing, which asks Linux for SIGTERM when the parent dies
(``prctl(PR_SET_PDEATHSIG)``): the child then drains and exits as on any SIGTERM.

Why this way: the kernel sends the signal however the parent ends, and the child needs no thread,
pipe or event loop to notice. It is set here, after exec, rather than in a ``preexec_fn`` between
fork and exec, which can deadlock in a parent that runs threads (the pod copies its children's
output on threads, and restarts the runner while they run). A parent that died before the call is
seen by the pid check. The death signal comes when the parent's thread that started the child ends,
so the supervisor starts its children from its main thread. The supervisor itself asks the same of
whatever started it (:func:`die_with_launcher`): ``make run`` killed with SIGKILL takes the pod, and
the pod its children.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_PID_ENV = "DIFFUSION_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """SIGTERM for this process when the one named in ``DIFFUSION_PARENT_PID`` dies (Linux; elsewhere nothing).

    Exits at once when that parent is already gone. Without the variable, nothing changes."""
    parent = os.environ.pop(PARENT_PID_ENV, "")  # not for this process's own children
    if parent:
        _terminate_when_gone(int(parent))


def die_with_launcher() -> None:
    """SIGTERM for this supervisor when the process that started it dies (``make``, a shell), as its
    children ask when it dies: a ``make run`` killed with SIGKILL leaves nothing serving."""
    _terminate_when_gone(os.getppid())


def _terminate_when_gone(parent: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        raise SystemExit(f"the parent process {parent} is gone: not starting")
