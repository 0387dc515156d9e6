"""`optimistic`: the database alone. Read the version, write only if it is unchanged, retry."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from ..exceptions import Busy, SoldOut
from ..models import Item, Order
from ..stock import (
    HalfDone,
    RowLockTimeout,
    Sold,
    back_off,
    lock_stock_row,
    read_stock,
    shard_stocks,
    simulate_work,
)
from .base import Allocation, RecordOrder, StockStrategy


class OptimisticStrategy(StockStrategy):
    """Version-checked write with bounded, jittered retries; also the fallback for Redis.

    After FLASHSALE_OPTIMISTIC_MAX_ATTEMPTS lost races, one last attempt waits for the item's
    row lock (at most FLASHSALE_ROW_LOCK_TIMEOUT_MS, else `503 busy`): under heavy contention
    a loser would otherwise keep losing to writers that commit while it waits.

    Works for any item: when the item keeps stock shards (it sells through `segmented`), the
    same statement takes the units from its shards too, lowest index first, so the fallback
    keeps them true.
    """

    name = "optimistic"

    def take(self, *, item: Item, qty: int, buyer: str, record: RecordOrder) -> Order:
        attempts = settings.FLASHSALE_OPTIMISTIC_MAX_ATTEMPTS
        for attempt in range(attempts):
            seen = read_stock(item.pk)
            if seen.stock < qty:
                raise SoldOut(sku=item.sku, requested=qty, remaining=seen.stock)
            simulate_work()
            try:
                sold = record(
                    Allocation(
                        strategy=self.name,
                        expected_version=seen.version,
                        shard_units=_plan(item, qty) if item.shard_count else None,
                    )
                )
            except HalfDone:
                sold = None  # a shard moved between its read and the write: a lost race
            if sold is not None:
                return sold.order
            back_off(attempt)
        return self._take_queued(item, qty, record)

    def _take_queued(self, item: Item, qty: int, record: RecordOrder) -> Order:
        """Every attempt lost a race (a writer holding the row lock commits a new version while
        we wait for it): queue for the row lock instead, so a loser cannot starve."""
        try:
            with transaction.atomic():
                if item.shard_count:
                    # The lock order: shards first, then the item row.
                    levels = shard_stocks(item.pk, for_update=True)
                seen = lock_stock_row(item.pk)
                if seen.stock < qty:
                    raise SoldOut(sku=item.sku, requested=qty, remaining=seen.stock)
                simulate_work()
                sold: Sold | None = record(
                    Allocation(
                        strategy=self.name,
                        expected_version=seen.version,
                        shard_units=_split(levels, qty) if item.shard_count else None,
                    )
                )
                if sold is None:  # cannot happen: every row it writes is locked by now
                    raise RuntimeError(f"{item.sku}: a write under its row locks was refused")
                return sold.order
        except RowLockTimeout:
            raise Busy(
                f"{item.sku}: the item row stayed locked after "
                f"{settings.FLASHSALE_OPTIMISTIC_MAX_ATTEMPTS} lost races",
                retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
            ) from None


def _plan(item: Item, qty: int) -> dict[int, int]:
    return _split(shard_stocks(item.pk), qty)


def _split(levels: dict[int, int], qty: int) -> dict[int, int]:
    """Units to take per shard for qty, lowest index first (short when the shards are)."""
    plan: dict[int, int] = {}
    needed = qty
    for index in sorted(levels):
        if needed and levels[index] > 0:
            plan[index] = min(levels[index], needed)
            needed -= plan[index]
    if needed:
        # Fewer units on the shards than the item row claims: ask for them anyway, so the
        # guards refuse and the caller retries or reports sold out.
        last = max(levels, default=0)
        plan[last] = plan.get(last, 0) + needed
    return plan
