"""`lock`: one Redis lock per item around a guarded database update."""

from __future__ import annotations

from django.conf import settings

from .. import keys, metrics
from ..exceptions import Busy, LockLost, SoldOut
from ..models import Item, Order
from ..stock import Fenced, read_stock, simulate_work
from .base import Allocation, RecordOrder, StockStrategy
from .plumbing import (
    acquire_lock,
    ensure_still_held,
    fence_of,
    new_lock,
    release_quietly,
)


class LockStrategy(StockStrategy):
    """One Redis lock per item; under it, the guarded write of the sale.

    The lock makes contention cheap: buyers queue in Redis, not on the item row. The write
    under it is still guarded (`stock >= qty`), so a holder whose lock expired mid-work, or the
    database fallback writing from outside the lock while Redis recovers, cannot oversell; and
    fenced (the lock's fencing token, which the row refuses once a later holder has written),
    so a holder paused past its lock's TTL cannot write at all when it wakes.
    """

    name = "lock"
    label = "one Redis lock per item"
    uses_redis = True
    # Its write refuses a sale restarted since the item was read, and the stock it checks
    # before taking the lock is only a shortcut (kept up to date by each sale of this process,
    # read again before a sold-out answer).
    item_may_be_remembered = True

    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        # The stock read with the item (or left by the last sale of this process), no decision:
        # it spares the lock once the item is gone. A remembered read may be old, so "gone" is
        # read again from the database before it is answered.
        if item.stock < qty:
            item.stock = read_stock(item.pk).stock
            if item.stock < qty:
                raise SoldOut(sku=item.sku, requested=qty, remaining=item.stock)
        lock = new_lock(keys.item_lock(item), strategy=self.name, quorum=True)
        # The sale's statement is built and a cursor opened before the lock is asked for: the
        # lock is held for the statement's round trip and little else.
        with record.prepare(Allocation(strategy=self.name)) as write:
            if not acquire_lock(lock):
                raise Busy(
                    f"{item.sku}: lock still held after {settings.FLASHSALE_LOCK_WAIT_MS} ms",
                    retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
                )
            try:
                simulate_work()
                ensure_still_held(lock, item.sku)
                sold = write(fence=fence_of(lock))
            except Fenced as refused:
                metrics.LOCKS_LOST.labels(self.name, "fenced").inc()
                raise LockLost(
                    f"lock lost before commit: {refused}",
                    retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
                ) from None
            finally:
                release_quietly(lock)
        if sold is None:
            item.stock = read_stock(item.pk).stock
            raise SoldOut(sku=item.sku, requested=qty, remaining=item.stock)
        if sold.item_stock is not None:
            item.stock = sold.item_stock  # what a checkout using this item read next will see
        return sold.order
