"""`Lock`: the shop's Redis lock, redis-py's API with a fencing token, composed of its core and
the features around it, each in a module of its own; its variants are small classes composed
the same way, not constructor flags:

* `core`: SET NX PX with an owner token, compare-and-delete release, extend, the fence;
* `handover`: waiters queue in Redis and a release hands the lock to the first (FIFO);
* `watchdog`: renews a held lock's TTL and reports a lock that slipped away;
* `reentrant`, `replicas`, `wakes`: `ReentrantLock`, `ReplicatedLock`, `WakeHubLock`.

Code written against :class:`redis.lock.Lock` works with `Lock` unchanged (its exceptions are
redis-py's own); ``sleep`` is accepted, and unused: waiters are woken, they do not poll.
See docs/design.md#locks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .core import Number
from .handover import FifoHandOver
from .reentrant import Reentrant
from .replicas import Replicated
from .wakes import HubWoken
from .watchdog import Watchdog


class Lock(Watchdog, FifoHandOver):
    """A distributed lock stored in Redis under ``name``; API of :class:`redis.lock.Lock`.

    The contract is the core's (:class:`~locking.core.LockCore`) and the hand-over's
    (:class:`~locking.handover.FifoHandOver`); ``watchdog`` and ``on_lost`` are the
    watchdog's (:class:`~locking.watchdog.Watchdog`). The positional arguments are redis-py's.
    """

    def __init__(
        self,
        redis: Any,
        name: str,
        timeout: Number | None = None,
        sleep: Number = 0.1,
        blocking: bool = True,
        blocking_timeout: Number | None = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
        *,
        watchdog: bool = False,
        on_lost: Callable[[Lock], object] | None = None,
    ) -> None:
        super().__init__(
            redis,
            name,
            timeout,
            sleep,
            blocking,
            blocking_timeout,
            thread_local,
            raise_on_release_error,
            watchdog=watchdog,
            on_lost=on_lost,
        )


class ReentrantLock(Reentrant, Lock):
    """A :class:`Lock` the thread holding it takes again at once, counted, released at the
    last release (:class:`~locking.reentrant.Reentrant`). `Lock`'s arguments."""


class ReplicatedLock(Replicated, Lock):
    """A :class:`Lock` granted only once ``replicas`` replicas hold it, acknowledged within
    ``replica_timeout`` seconds (0.1 by default; :class:`~locking.replicas.Replicated`).
    `Lock`'s arguments, and those two keywords."""


class WakeHubLock(HubWoken, Lock):
    """A :class:`Lock` whose waiters wait through their process's wake hub, one connection for
    all of them, its list named from ``hub_prefix`` (:class:`~locking.wakes.HubWoken`).
    `Lock`'s arguments, and that keyword."""
