"""The strategies' Redis locks (`lock`'s item lock, `segmented`'s shard locks): built from
settings, taken within the checkout's deadline, given up without undoing a committed order, and
counted in the metrics by strategy.

`acquire_lock` remembers a lock a Redis failure left in doubt (released on recovery,
`inventory.breaker`); `release_quietly` absorbs what fails after the commit;
`lock_wait_seconds` tells the API how long a checkout waited. The lock itself is
`locking.Lock`; `locking.WakeHubLock` when WAKE_HUB is on; for `lock`'s item lock,
`locking.QuorumLock` when REDIS_LOCK_URLS lists masters; for the benchmark's and the lab's peer
locks, FLASHSALE_LOCK_FACTORY's (a seam of shop.lab_settings).
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from functools import lru_cache, partial
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from locking import Lock, LockNotOwnedError, QuorumLock, WakeHubLock
from locking import watchdog as lock_watchdog

from .. import deadline, keys, metrics
from ..breaker import breaker, remember_unsettled
from ..exceptions import LockLost
from ..fences import next_fence
from ..redis_client import REDIS_DOWN_ERRORS, get_lock_clients, get_redis_client

logger = logging.getLogger(__name__)


#: Whether this process's lock waiters wait through one wake-up channel (`locking.wakes`: one
#: list, one connection), so that its connections do not grow with its waiters. Off: each
#: waiter blocks on a connection of its own, which a process with a few waiters at a time (the
#: shop's workers of four threads) hands over faster (docs/decisions/0013). A single Redis only.
WAKE_HUB = False

#: The strategy and grant time of each lock this process holds or made (for its metrics).
_lock_strategy: weakref.WeakKeyDictionary[Lock, str] = weakref.WeakKeyDictionary()
_held_since: weakref.WeakKeyDictionary[Lock, float] = weakref.WeakKeyDictionary()


def new_lock(name: str, *, strategy: str, quorum: bool = False, peers: bool = False) -> Lock:
    """A lock configured from settings: TTL, how long to wait, watchdog renewal; its waits and
    holds are counted as `strategy`'s.

    `peers` (the `lock` strategy's item lock): built by FLASHSALE_LOCK_FACTORY (`locking.Lock`,
    ours, unless set), the seam through which the benchmark runs the very code of `lock` with a
    peer's lock; without it always `locking.Lock` (`segmented`'s shards, whose first try takes
    and releases them by `locking.Lock`'s own scripts). A factory
    takes (client, name, *, timeout, blocking_timeout, watchdog) and returns an object with
    Lock's acquire(token=...), release(), owned(), `local.token`, `name` and `lost`. Ours
    waits through the process's wake hub (`locking.WakeHubLock`) when WAKE_HUB is on.
    `quorum` (the `lock` strategy's item lock): held on a majority of REDIS_LOCK_URLS' masters
    instead (`locking.QuorumLock`, its fences from the database), when that lists any.
    """
    # The lab turns the watchdog off to show a lock expiring under its holder.
    watchdog = getattr(settings, "FLASHSALE_LOCK_WATCHDOG", True)
    if quorum and settings.REDIS_LOCK_URLS:
        held: Any = QuorumLock(
            get_lock_clients(),
            name,
            timeout=settings.FLASHSALE_LOCK_TTL_MS / 1000,
            blocking_timeout=settings.FLASHSALE_LOCK_WAIT_MS / 1000,
            watchdog=watchdog,
            fence_source=next_fence,
        )
        _lock_strategy[held] = strategy
        return held
    factory_path = getattr(settings, "FLASHSALE_LOCK_FACTORY", "locking.Lock")
    factory = _lock_factory(factory_path) if peers else Lock
    if WAKE_HUB and factory is Lock:
        if settings.REDIS_CLUSTER_NODES:
            raise ImproperlyConfigured(
                "WAKE_HUB cannot be used with REDIS_CLUSTER_NODES: a release pushes the "
                "hand-over onto the hub's one list, which lives in one slot, while the locks "
                "live in many"
            )
        factory = partial(WakeHubLock, hub_prefix=keys.key("lock-wakes"))
    lock = factory(
        get_redis_client(),
        name,
        timeout=settings.FLASHSALE_LOCK_TTL_MS / 1000,
        blocking_timeout=settings.FLASHSALE_LOCK_WAIT_MS / 1000,
        watchdog=watchdog,
    )
    _lock_strategy[lock] = strategy
    return lock


def _count_renewal(lock: Lock, renewed: bool) -> None:
    strategy = _lock_strategy.get(lock, "none")
    metrics.WATCHDOG_RENEWALS.labels(strategy, "renewed" if renewed else "failed").inc()


if _count_renewal not in lock_watchdog.listeners:
    lock_watchdog.listeners.append(_count_renewal)


@lru_cache(maxsize=8)
def _lock_factory(path: str) -> Callable[..., Lock]:
    return import_string(path)


def ensure_still_held(lock: Lock, sku: str) -> None:
    """Refuse to commit once the watchdog has reported the lock lost.

    If it was lost because Redis went away, the GET raises a connection error and the fallback
    serves the checkout; if someone else holds it now, the buyer is told to retry.
    """
    if lock.lost and not lock.owned():
        metrics.LOCKS_LOST.labels(_lock_strategy.get(lock, "none"), "watchdog").inc()
        raise LockLost(f"{sku}: lock lost before commit")


def fence_of(lock: Lock) -> int | None:
    """The fencing token of the lock's current acquisition, for the guarded write made under it;
    None for a peer's lock (the benchmark's), which hands out none: its writes go unfenced."""
    return getattr(lock, "fence", None)


#: Seconds this checkout spent waiting for locks (reported to load tools as Server-Timing).
lock_wait_seconds: ContextVar[float] = ContextVar("lock_wait_seconds", default=0.0)


def acquire_lock(lock: Lock, **options: Any) -> bool:
    """`lock.acquire(**options)`, remembering the token if Redis fails mid-way."""
    if options.get("blocking", True):
        # No wait outlasts the checkout's deadline.
        bound = options.get("blocking_timeout", settings.FLASHSALE_LOCK_WAIT_MS / 1000)
        left = deadline.seconds_left()
        if left <= 0:
            raise deadline.passed(lock.name)
        options["blocking_timeout"] = min(bound, left)
    token = uuid.uuid4().hex.encode()
    started = time.perf_counter()
    try:
        acquired = lock.acquire(token=token, **options)
    except REDIS_DOWN_ERRORS:
        remember_unsettled([(lock.name, token)])
        raise
    finally:
        now = time.perf_counter()
        lock_wait_seconds.set(lock_wait_seconds.get() + now - started)
    strategy = _lock_strategy.get(lock, "none")
    if acquired:
        metrics.LOCK_WAIT.labels(strategy).observe(now - started)
        _held_since[lock] = now
    elif options.get("blocking", True):
        metrics.LOCK_TIMEOUTS.labels(strategy).inc()
    return acquired


def release_quietly(lock: Lock, *, after: tuple[str, list[Any], list[Any]] | None = None) -> None:
    """Release after the work is done; by then a failure must not undo a committed order.
    `after`: a script call to send with the release (`Lock.release(after=...)`)."""
    token = lock.local.token  # release() forgets it before it talks to Redis
    _record_hold(lock)
    try:
        if after is None:
            lock.release()  # (a peer's lock, in the benchmark, takes no `after`)
        else:
            lock.release(after=after)
    except LockNotOwnedError:
        logger.info("lock %s had expired before release", lock.name)
    except REDIS_DOWN_ERRORS as exc:
        breaker.record_failure(exc)
        if token is not None:
            remember_unsettled([(lock.name, token)])
        logger.warning("could not release %s: Redis is down; released on recovery", lock.name)


def _record_hold(lock: Lock) -> None:
    held_since = _held_since.pop(lock, None)
    if held_since is not None:
        hold = time.perf_counter() - held_since
        metrics.LOCK_HOLD.labels(_lock_strategy.get(lock, "none")).observe(hold)
