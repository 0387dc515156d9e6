"""`optimistic`: the database alone. Read the version, UPDATE only if it is unchanged, retry."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from ..exceptions import Busy, SoldOut
from ..models import Item, Order
from ..stock import (
    RowLockTimeout,
    back_off,
    lock_stock_row,
    read_stock,
    simulate_work,
    take_from_shards,
    take_item_units,
)
from .base import Allocation, RecordOrder, StockStrategy


class OptimisticStrategy(StockStrategy):
    """Version-checked UPDATE with bounded, jittered retries; also the fallback for Redis.

    After FLASHSALE_OPTIMISTIC_MAX_ATTEMPTS lost races, one last attempt waits for the item's
    row lock (at most FLASHSALE_ROW_LOCK_TIMEOUT_MS, else `503 busy`): under heavy contention
    a loser would otherwise keep losing to writers that commit while it waits.

    Works for any item: when the item keeps stock shards (it sells through `segmented`), the
    same transaction takes the units from its shards too, so the fallback keeps them true.
    """

    name = "optimistic"

    def take(self, *, item: Item, qty: int, buyer: str, record: RecordOrder) -> Order:
        attempts = settings.FLASHSALE_OPTIMISTIC_MAX_ATTEMPTS
        for attempt in range(attempts):
            seen = read_stock(item.pk)
            if seen.stock < qty:
                raise SoldOut(sku=item.sku, requested=qty, remaining=seen.stock)
            with transaction.atomic():
                simulate_work()
                if take_item_units(item.pk, qty, expected_version=seen.version):
                    shard_units = take_from_shards(item.pk, qty) if item.shard_count else None
                    return record(Allocation(strategy=self.name, shard_units=shard_units))
            back_off(attempt)
        return self._take_queued(item, qty, record)

    def _take_queued(self, item: Item, qty: int, record: RecordOrder) -> Order:
        """Every attempt lost a race (a writer holding the row lock commits a new version while
        we wait for it): queue for the row lock instead, so a loser cannot starve."""
        try:
            with transaction.atomic():
                seen = lock_stock_row(item.pk)
                if seen.stock < qty:
                    raise SoldOut(sku=item.sku, requested=qty, remaining=seen.stock)
                simulate_work()
                take_item_units(item.pk, qty, expected_version=seen.version)  # ours: we hold it
                shard_units = take_from_shards(item.pk, qty) if item.shard_count else None
                return record(Allocation(strategy=self.name, shard_units=shard_units))
        except RowLockTimeout:
            raise Busy(
                f"{item.sku}: the item row stayed locked after "
                f"{settings.FLASHSALE_OPTIMISTIC_MAX_ATTEMPTS} lost races",
                retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
            ) from None
