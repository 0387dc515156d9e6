"""Helpers for the child processes the tooling starts and watches.

`die_with_parent` is the `preexec_fn` every long-lived child gets: the kernel sends it SIGTERM
if its starter dies without stopping it, so none outlives the process that started it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable


def pid_alive(pid: int) -> bool:
    return _signal_reaches(os.kill, pid)


def group_alive(group: int) -> bool:
    """Whether any process of process group `group` is left (one not yet reaped counts)."""
    return _signal_reaches(os.killpg, group)


def signal_group(group: int, signum: int) -> None:
    """Send `signum` to process group `group`; nothing when none of it is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)


def _signal_reaches(send: Callable[[int, int], None], target: int) -> bool:
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent() -> None:
    """preexec_fn: have the kernel SIGTERM this child if the runner itself is killed."""
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode
