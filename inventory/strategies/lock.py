"""`lock`: one Redis lock per item around a guarded database update."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable
from contextvars import ContextVar

from django.conf import settings

from locking import Lock, LockError, LockNotOwnedError

from ..breaker import breaker
from ..exceptions import Busy, SoldOut
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS, get_redis_client, redis_key
from ..stock import Sold, read_stock, simulate_work
from .base import Allocation, RecordOrder, StockStrategy

logger = logging.getLogger(__name__)


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


class LockStrategy(StockStrategy):
    """One Redis lock per item; under it, the guarded write of the sale.

    The lock makes contention cheap: buyers queue in Redis, not on the item row. The write
    under it is still guarded (`stock >= qty`), so a holder whose lock expired mid-work, or the
    database fallback writing from outside the lock while Redis recovers, cannot oversell.
    """

    name = "lock"
    uses_redis = True
    # Its write refuses a sale restarted since the item was read, and the stock it checks
    # before taking the lock is only a shortcut (kept up to date by each sale of this process,
    # read again before a sold-out answer).
    item_may_be_remembered = True

    def take(self, *, item: Item, qty: int, buyer: str, record: RecordOrder) -> Order:
        # The stock read with the item (or left by the last sale of this process), no decision:
        # it spares the lock once the item is gone. A remembered read may be old, so "gone" is
        # read again from the database before it is answered.
        if item.stock < qty:
            item.stock = read_stock(item.pk).stock
            if item.stock < qty:
                raise SoldOut(sku=item.sku, requested=qty, remaining=item.stock)
        lock = new_lock(redis_key("lock", "item", item.sku))
        if not acquire_lock(lock):
            raise Busy(
                f"{item.sku}: lock still held after {settings.FLASHSALE_LOCK_WAIT_MS} ms",
                retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
            )
        try:
            if settings.FLASHSALE_LOCK_GUARDED_WRITE:
                simulate_work()
                ensure_still_held(lock, item.sku)
                sold = record(Allocation(strategy=self.name))
            else:
                sold = self._take_unguarded(item, qty, record, lock)
        finally:
            release_quietly(lock)
        if sold is None:
            item.stock = read_stock(item.pk).stock
            raise SoldOut(sku=item.sku, requested=qty, remaining=item.stock)
        if sold.item_stock is not None:
            item.stock = sold.item_stock  # what a checkout using this item read next will see
        return sold.order

    def _take_unguarded(self, item: Item, qty: int, record: RecordOrder, lock: Lock) -> Sold:
        """Pitfall toggle: trust the lock and write back what was read, as naive code does.

        Once a lock expires mid-work, two holders overlap and it oversells.
        """
        seen = read_stock(item.pk)
        if seen.stock < qty:
            raise SoldOut(sku=item.sku, requested=qty, remaining=seen.stock)
        simulate_work()
        ensure_still_held(lock, item.sku)
        return record(Allocation(strategy=self.name, set_stock=seen.stock - qty))
