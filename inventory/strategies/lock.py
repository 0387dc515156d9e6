"""`lock`: one Redis lock per item around a guarded database update."""

from __future__ import annotations

from django.conf import settings

from .. import keys
from ..exceptions import Busy, SoldOut
from ..models import Item, Order
from ..stock import read_stock, simulate_work
from .base import Allocation, RecordOrder, StockStrategy
from .plumbing import acquire_lock, ensure_still_held, new_lock, release_quietly


class LockStrategy(StockStrategy):
    """One Redis lock per item; under it, the guarded write of the sale.

    The lock makes contention cheap: buyers queue in Redis, not on the item row. The write
    under it is still guarded (`stock >= qty`), so a holder whose lock expired mid-work, or the
    database fallback writing from outside the lock while Redis recovers, cannot oversell.
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
        lock = new_lock(keys.item_lock(item))
        if not acquire_lock(lock):
            raise Busy(
                f"{item.sku}: lock still held after {settings.FLASHSALE_LOCK_WAIT_MS} ms",
                retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
            )
        try:
            simulate_work()
            ensure_still_held(lock, item.sku)
            sold = record(Allocation(strategy=self.name))
        finally:
            release_quietly(lock)
        if sold is None:
            item.stock = read_stock(item.pk).stock
            raise SoldOut(sku=item.sku, requested=qty, remaining=item.stock)
        if sold.item_stock is not None:
            item.stock = sold.item_stock  # what a checkout using this item read next will see
        return sold.order
