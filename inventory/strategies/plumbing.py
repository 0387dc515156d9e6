"""Redis plumbing the strategies share: their locks, and the counters that mirror a sale's
stock rows. Every key comes from `inventory.keys`.

Locks (`lock`, `segmented`): built from settings by `new_lock`, taken with `acquire_lock` (which
remembers a lock a Redis failure left in doubt, released on recovery) and given up with
`release_quietly`; `lock_wait_seconds` tells the API how long a checkout waited for them.

Counters (`segmented`, `lua`): one per stock row of the current sale, what Redis believes the
row holds. `segmented` keeps them as hints, copied from the database with the row's version
(`write_hints`: the lock holder after each commit, a give-back or restock after its commit; a
copy never replaces a later one, whatever order they arrive in); `lua` decides with them (its
script takes units from them before the database write, a give-back adds them back).
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

from locking import Lock, LockNotOwnedError, QuorumLock, StockCounter
from locking import watchdog as lock_watchdog
from locking.cluster import by_slot, is_cluster

from .. import deadline, keys, metrics
from ..breaker import breaker, remember_unsettled
from ..exceptions import LockLost
from ..fences import next_fence
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS, get_lock_clients, get_redis_client
from ..stock import StockRow, shard_rows, shard_stocks

logger = logging.getLogger(__name__)


# -- locks ----------------------------------------------------------------------------------


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
    waits through the process's wake hub (`locking.wakes`) when FLASHSALE_LOCK_WAKE_HUB is on.
    `quorum` (the `lock` strategy's item lock): held on a majority of REDIS_LOCK_URLS' masters
    instead (`locking.QuorumLock`, its fences from the database), when that lists any.
    """
    if quorum and settings.REDIS_LOCK_URLS:
        held: Any = QuorumLock(
            get_lock_clients(),
            name,
            timeout=settings.FLASHSALE_LOCK_TTL_MS / 1000,
            blocking_timeout=settings.FLASHSALE_LOCK_WAIT_MS / 1000,
            watchdog=settings.FLASHSALE_LOCK_WATCHDOG,
            fence_source=next_fence,
        )
        _lock_strategy[held] = strategy
        return held
    factory = _lock_factory(settings.FLASHSALE_LOCK_FACTORY) if peers else Lock
    options: dict[str, Any] = {}
    if settings.FLASHSALE_LOCK_WAKE_HUB and isinstance(factory, type) and issubclass(factory, Lock):
        options["wake_hub"] = keys.key("lock-wakes")
    lock = factory(
        get_redis_client(),
        name,
        timeout=settings.FLASHSALE_LOCK_TTL_MS / 1000,
        blocking_timeout=settings.FLASHSALE_LOCK_WAIT_MS / 1000,
        watchdog=settings.FLASHSALE_LOCK_WATCHDOG,
        **options,
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
        raise LockLost(
            f"{sku}: lock lost before commit", retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER
        )


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


# -- stock-row counters ---------------------------------------------------------------------


def counter() -> StockCounter:
    return _counter(get_redis_client())


@lru_cache(maxsize=16)
def _counter(client: object) -> StockCounter:
    # One per client: building one registers its scripts.
    return StockCounter(client)


def write_rows(item: Item, levels: dict[int, int]) -> list[int]:
    """Set the counters of the rows in `levels`; return every row's level (0 where not given)."""
    counter().set_many({keys.row(item, index): units for index, units in levels.items()})
    return [levels.get(index, 0) for index in range(item.shard_count)]


def sync_rows(item: Item) -> list[int]:
    """Set every row's counter from the database."""
    return write_rows(item, shard_stocks(item.current_sale_id))


def write_hints(
    item: Item, rows: dict[int, StockRow], *, create: bool = True, force: bool = False
) -> list[int]:
    """Copy the rows' levels read from the database to their counters, unless a counter holds
    a later version of its row already (see `StockCounter.set_newer`); return every row's
    level as given (0 where not given)."""
    counter().set_newer(
        {keys.row(item, index): (row.stock, row.version) for index, row in rows.items()},
        create=create,
        force=force,
    )
    return [rows[index].stock if index in rows else 0 for index in range(item.shard_count)]


def release_with_hints(item: Item, locks: dict[int, Lock], rows: dict[int, StockRow]) -> None:
    """Release each shard's lock (`release_quietly`), its hint copied from `rows` (the levels
    its holder's statement returned) in the same call to Redis where the lock is ours and on
    the hint's slot: one round trip per shard instead of two, and the next holder finds the
    hint current. Hints of shards not locked here, or behind another kind of lock, are written
    on their own first."""
    alone: dict[int, StockRow] = {}
    paired: dict[int, tuple[str, list[Any], list[Any]]] = {}
    for index, row in rows.items():
        lock = locks.get(index)
        hint = keys.row(item, index)
        if not isinstance(lock, Lock) or (
            is_cluster(get_redis_client()) and len(by_slot([hint, lock.name], str)) > 1
        ):
            alone[index] = row
            continue
        paired[index] = counter().set_newer_call({hint: (row.stock, row.version)})
    if alone:
        try:
            write_hints(item, alone)
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            logger.warning("could not update %s shard hints: Redis is down", item.sku)
    for index, lock in locks.items():
        release_quietly(lock, after=paired.get(index))


def refresh_hints(
    item: Item,
    indexes: Iterable[int] | None = None,
    *,
    create: bool = True,
    force: bool = False,
) -> list[int]:
    """`write_hints` from the rows as the database holds them now (those in `indexes`)."""
    return write_hints(item, shard_rows(item.current_sale_id, indexes), create=create, force=force)


def add_to_rows(item: Item, units: dict[int, int]) -> None:
    """Raise the counters of the rows in `units` by that many (a restock; missing counters stay
    missing: they are seeded from the database, which has the units already)."""
    amounts = {keys.row(item, index): added for index, added in units.items() if added}
    if amounts:
        counter().give_back_many(amounts)


def give_back_rows(item: Item, order: Order) -> None:
    """Add a failed or expired order's units back to the counters it took them from, once."""
    amounts = {
        keys.row(item, int(index)): units for index, units in (order.shard_units or {}).items()
    }
    if amounts:
        counter().give_back_once(keys.returned_marker(item, order.pk), amounts)


def rows_total(item: Item) -> int | None:
    """Units the counters hold together; None when a counter is missing."""
    if not item.shard_count:
        return None
    levels = counter().get_many(keys.rows(item))
    held = [level for level in levels if level is not None]
    return sum(held) if len(held) == len(levels) else None
