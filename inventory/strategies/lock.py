"""`lock`: one Redis lock per item around a version-checked database update."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextvars import ContextVar

from django.conf import settings
from django.db import transaction

from locking import Lock, LockError, LockNotOwnedError

from ..breaker import breaker
from ..exceptions import Busy, SoldOut
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS, get_redis_client, redis_key
from ..stock import (
    RowLockTimeout,
    back_off,
    lock_stock_row,
    read_stock,
    simulate_work,
    take_item_units,
)
from .base import Allocation, RecordOrder, StockStrategy

logger = logging.getLogger(__name__)

_CONFLICT_RETRIES = 10


def new_lock(name: str) -> Lock:
    """A lock configured from settings: TTL, how long to wait, watchdog renewal."""
    return Lock(
        get_redis_client(),
        name,
        timeout=settings.FLASHSALE_LOCK_TTL_MS / 1000,
        blocking_timeout=settings.FLASHSALE_LOCK_WAIT_MS / 1000,
        watchdog=settings.FLASHSALE_LOCK_WATCHDOG,
    )


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


def acquire_lock(lock: Lock, **options: object) -> bool:
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


class LockStrategy(StockStrategy):
    name = "lock"
    uses_redis = True

    def take(self, *, item: Item, qty: int, buyer: str, record: RecordOrder) -> Order:
        # A plain read, no decision: it spares the lock once the item is gone.
        seen = read_stock(item.pk)
        if seen.stock < qty:
            raise SoldOut(sku=item.sku, requested=qty, remaining=seen.stock)
        lock = new_lock(redis_key("lock", "item", item.sku))
        if not acquire_lock(lock):
            raise Busy(
                f"{item.sku}: lock still held after {settings.FLASHSALE_LOCK_WAIT_MS} ms",
                retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
            )
        try:
            # Under the lock a version conflict means a write from outside it: the database
            # fallback of another process while Redis recovers, or a holder whose lock expired.
            for attempt in range(_CONFLICT_RETRIES):
                order = self._take_locked(item, qty, record, lock)
                if order is not None:
                    return order
                back_off(attempt)
            # Still losing: queue for the row lock rather than race on.
            return self._take_locked(item, qty, record, lock, queued=True)
        except RowLockTimeout:
            raise Busy(
                f"{item.sku}: the item row stayed locked by writers outside the lock",
                retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
            ) from None
        finally:
            release_quietly(lock)

    def _take_locked(
        self, item: Item, qty: int, record: RecordOrder, lock: Lock, *, queued: bool = False
    ) -> Order | None:
        """One read-check-write under the lock; None when the version moved meanwhile.

        `queued` reads holding the item's row lock, so the version cannot move.
        """
        with transaction.atomic():
            seen = lock_stock_row(item.pk) if queued else read_stock(item.pk)
            if seen.stock < qty:
                raise SoldOut(sku=item.sku, requested=qty, remaining=seen.stock)
            simulate_work()
            if settings.FLASHSALE_LOCK_GUARDED_WRITE:
                # The version check makes a lock that expired mid-work harmless.
                if not take_item_units(item.pk, qty, expected_version=seen.version):
                    return None
            else:
                # Pitfall toggle: trust the lock and write back what was read, as naive code
                # does. Once a lock expires mid-work, two holders overlap and it oversells.
                Item.objects.filter(pk=item.pk).update(
                    stock=seen.stock - qty, version=seen.version + 1
                )
            order = record(Allocation(strategy=self.name))
            ensure_still_held(lock, item.sku)
        return order
