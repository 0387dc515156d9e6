"""`Lock`: the shop's Redis lock, redis-py's API with a fencing token, composed of its core and
the features around it, each in a module of its own:

* `core`: SET NX PX with an owner token, compare-and-delete release, extend, the fence;
* `handover`: waiters queue in Redis and a release hands the lock to the first (FIFO);
* `watchdog`: renews a held lock's TTL and reports a lock that slipped away;
* `reentrant` and `replicas`: the reentrant mode and the replica check.

Code written against :class:`redis.lock.Lock` works with it unchanged (its exceptions are
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
from .watchdog import Watchdog


class Lock(Reentrant, Replicated, Watchdog, FifoHandOver):
    """A distributed lock stored in Redis under ``name``; API of :class:`redis.lock.Lock`.

    The contract is the core's (:class:`~locking.core.LockCore`) and the hand-over's
    (:class:`~locking.handover.FifoHandOver`), always; the others' when their arguments ask:
    ``watchdog`` and ``on_lost`` (:class:`~locking.watchdog.Watchdog`), ``reentrant``
    (:class:`~locking.reentrant.Reentrant`), ``replicas`` and ``replica_timeout``
    (:class:`~locking.replicas.Replicated`); ``max_wait_slice`` and ``wake_hub`` tune the
    hand-over's waits. The positional arguments are redis-py's.
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
        max_wait_slice: Number | None = None,
        replicas: int = 0,
        replica_timeout: Number = 0.1,
        reentrant: bool = False,
        wake_hub: str | None = None,
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
            reentrant=reentrant,
            replicas=replicas,
            replica_timeout=replica_timeout,
            watchdog=watchdog,
            on_lost=on_lost,
            max_wait_slice=max_wait_slice,
            wake_hub=wake_hub,
        )
