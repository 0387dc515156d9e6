"""Redis plumbing the strategies share: their locks, and the counters that mirror a sale's
stock rows. Every key comes from `inventory.keys`.

Locks (`lock`, `segmented`): built from settings by `new_lock`, taken with `acquire_lock` (which
remembers a lock a Redis failure left in doubt, released on recovery) and given up with
`release_quietly`; `lock_wait_seconds` tells the API how long a checkout waited for them.

Counters (`segmented`, `lua`): one per stock row of the current sale, what Redis believes the
row holds. `segmented` keeps them as hints (set from the database by the lock holder after each
commit); `lua` decides with them (its script takes units from them before the database write).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

from locking import Lock, LockError, LockNotOwnedError, StockCounter
from locking.combining import GroupCommit

from .. import keys
from ..breaker import breaker
from ..exceptions import Busy
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS, get_redis_client
from ..stock import shard_stocks

logger = logging.getLogger(__name__)


# -- locks ----------------------------------------------------------------------------------


def new_lock(name: str) -> Lock:
    """A lock configured from settings: TTL, how long to wait, watchdog renewal.

    Built by FLASHSALE_LOCK_FACTORY (`locking.Lock`, ours, unless set): the seam through which
    the benchmark runs the very code of `lock` and `segmented` with a peer's lock. A factory
    takes (client, name, *, timeout, blocking_timeout, watchdog) and returns an object with
    Lock's acquire(token=...), release(), owned(), `local.token`, `name` and `lost`.
    """
    return _lock_factory(settings.FLASHSALE_LOCK_FACTORY)(
        get_redis_client(),
        name,
        timeout=settings.FLASHSALE_LOCK_TTL_MS / 1000,
        blocking_timeout=settings.FLASHSALE_LOCK_WAIT_MS / 1000,
        watchdog=settings.FLASHSALE_LOCK_WATCHDOG,
    )


@lru_cache(maxsize=8)
def _lock_factory(path: str) -> Callable[..., Lock]:
    return import_string(path)


def ensure_still_held(lock: Lock, sku: str) -> None:
    """Refuse to commit once the watchdog has reported the lock lost.

    If it was lost because Redis went away, the GET raises a connection error and the fallback
    serves the checkout; if someone else holds it now, the buyer is told to retry.
    """
    if lock.lost and not lock.owned():
        raise Busy(
            f"{sku}: lock lost before commit", retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER
        )


#: Locks this process may hold without knowing it: a SET NX or a release that timed out may
#: still run on the server (a paused Redis runs it when it wakes). Released on recovery, so
#: waiters need not sit out the lock's TTL.
_unsettled: set[tuple[str, bytes]] = set()
_unsettled_lock = threading.Lock()


#: Seconds this checkout spent waiting for locks (reported to load tools as Server-Timing).
lock_wait_seconds: ContextVar[float] = ContextVar("lock_wait_seconds", default=0.0)


def acquire_lock(lock: Lock, **options: Any) -> bool:
    """`lock.acquire(**options)`, remembering the token if Redis fails mid-way."""
    token = uuid.uuid4().hex.encode()
    started = time.perf_counter()
    try:
        return lock.acquire(token=token, **options)
    except REDIS_DOWN_ERRORS:
        with _unsettled_lock:
            _unsettled.add((lock.name, token))
        raise
    finally:
        lock_wait_seconds.set(lock_wait_seconds.get() + time.perf_counter() - started)


def remember_unsettled(locks: Iterable[tuple[str, bytes]]) -> None:
    """Locks (name, token) a Redis failure left in doubt: released on recovery if ours."""
    with _unsettled_lock:
        _unsettled.update(locks)


def release_quietly(lock: Lock) -> None:
    """Release after the work is done; by then a failure must not undo a committed order."""
    token = lock.local.token  # release() forgets it before it talks to Redis
    try:
        lock.release()
    except LockNotOwnedError:
        logger.info("lock %s had expired before release", lock.name)
    except REDIS_DOWN_ERRORS as exc:
        breaker.record_failure(exc)
        if token is not None:
            with _unsettled_lock:
                _unsettled.add((lock.name, token))
        logger.warning("could not release %s: Redis is down; released on recovery", lock.name)


def release_unsettled_locks() -> None:
    """Release, if still ours, every lock a Redis failure left in doubt (on recovery)."""
    with _unsettled_lock:
        pending = list(_unsettled)
    client = get_redis_client()
    for name, token in pending:
        lock = Lock(client, name)
        lock.local.token = token
        try:
            lock.release()
        except LockError:
            pass  # never taken, or expired already
        with _unsettled_lock:
            _unsettled.discard((name, token))


# -- stock-row counters ---------------------------------------------------------------------


def counter() -> StockCounter:
    return _counter(get_redis_client())


@lru_cache(maxsize=16)
def _counter(client: object) -> StockCounter:
    # One per client: building one registers its scripts.
    return StockCounter(client)


def group_commit(item: Item) -> GroupCommit:
    """The queue and combiner lock through which `lua` writes item's sales in batches."""
    return GroupCommit(
        get_redis_client(),
        queue=keys.commits(item),
        lock=keys.combiner(item),
        reply_prefix=keys.answer_prefix(item),
        lock_ttl_ms=settings.FLASHSALE_LOCK_TTL_MS,
        batch=settings.FLASHSALE_GROUP_COMMIT_BATCH,
    )


def write_rows(item: Item, levels: dict[int, int]) -> list[int]:
    """Set the counters of the rows in `levels`; return every row's level (0 where not given)."""
    counter().set_many({keys.row(item, index): units for index, units in levels.items()})
    return [levels.get(index, 0) for index in range(item.shard_count)]


def sync_rows(item: Item) -> list[int]:
    """Set every row's counter from the database."""
    return write_rows(item, shard_stocks(item.current_sale_id))


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
        counter().give_back_once(keys.returned_marker(order.pk), amounts)


def rows_total(item: Item) -> int | None:
    """Units the counters hold together; None when a counter is missing."""
    if not item.shard_count:
        return None
    levels = counter().get_many(keys.rows(item))
    held = [level for level in levels if level is not None]
    return sum(held) if len(held) == len(levels) else None
