"""`unsafe`: read, think, write back an absolute value. No lock, no guard: it oversells.

It is the baseline that shows what oversell looks like; never use it for a real sale.
"""

from __future__ import annotations

import time

from django.conf import settings

from ..exceptions import SoldOut
from ..models import Item, Order
from ..sale_values import Allocation
from .base import RecordOrder, StockStrategy
from .waits import simulate_work


class UnsafeStrategy(StockStrategy):
    name = "unsafe"
    label = "read-modify-write, no lock (oversells)"
    oversells = True

    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        seen = item.stock  # read with the item, a moment ago
        if seen < qty:
            raise SoldOut(sku=item.sku, requested=qty, remaining=seen)
        # The lab widens the race (FLASHSALE_UNSAFE_DELAY_MS, shop.lab_settings).
        delay_ms = getattr(settings, "FLASHSALE_UNSAFE_DELAY_MS", 0)
        if delay_ms > 0:
            time.sleep(delay_ms / 1000)
        simulate_work()
        # The lost update, on purpose: the value written back was computed from a stale read.
        sold = record(Allocation(strategy=self.name, set_stock=seen - qty))
        if sold is None:  # an absolute write has no guard that could refuse it
            raise RuntimeError(f"{item.sku}: the unguarded write was refused")
        return sold.order
