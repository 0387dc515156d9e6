"""`unsafe`: read, think, write back an absolute value. No lock, no guard: it oversells.

It is the baseline that shows what oversell looks like; never use it for a real sale.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.db import transaction

from ..exceptions import SoldOut
from ..models import Item, Order
from ..stock import read_stock, simulate_work
from .base import Allocation, RecordOrder, StockStrategy


class UnsafeStrategy(StockStrategy):
    name = "unsafe"

    def take(self, *, item: Item, qty: int, buyer: str, record: RecordOrder) -> Order:
        seen = read_stock(item.pk)
        if seen.stock < qty:
            raise SoldOut(sku=item.sku, requested=qty, remaining=seen.stock)
        if settings.FLASHSALE_UNSAFE_DELAY_MS > 0:
            time.sleep(settings.FLASHSALE_UNSAFE_DELAY_MS / 1000)
        with transaction.atomic():
            simulate_work()
            # The lost update, on purpose: the value written back was computed from a stale read.
            Item.objects.filter(pk=item.pk).update(stock=seen.stock - qty, version=seen.version + 1)
            return record(Allocation(strategy=self.name))
