"""`optimistic`: the database alone. Read the version, write only if it is unchanged, retry."""

from __future__ import annotations

from django.db import transaction

from ..exceptions import Busy, SoldOut
from ..models import Item, Order
from ..row_locks import lock_stock_row, wait_for_gates
from ..sale_values import Allocation, HalfDone, RanPastDeadline, RowLockTimeout, Sold
from ..stock import plan_rows, read_stock, shard_stocks
from .base import RecordOrder, StockStrategy
from .waits import back_off, simulate_work

#: Version-checked attempts before one that queues for the rows' gates: enough that a loser
#: under ordinary contention wins by retrying, few enough that under a flood it queues
#: before its back-offs add up to the checkout's deadline.
MAX_ATTEMPTS = 20


class OptimisticStrategy(StockStrategy):
    """Version-checked write with bounded, jittered retries; also the fallback for Redis.

    Its writes are gated (`Allocation.gated`): a write whose row another optimistic writer is
    writing loses at once and retries after its back-off, instead of queueing on the row (to
    find, once let in, that the version it read has changed). However many processes fall
    back, at most one connection of theirs is on a row at a time.

    After MAX_ATTEMPTS lost races, one last attempt waits for the rows'
    gates, then their row locks (at most ROW_LOCK_TIMEOUT_MS each, else `503 busy`):
    under heavy contention a loser would otherwise keep losing to writers that commit first.

    Works for any item: when the item keeps stock rows (it sells through `segmented` or `lua`),
    the same statement takes the units from those rows instead of the item row, each guarded by
    `stock >= units`, starting at a random row so that fallback buyers spread over them as the
    strategies they stand in for do.
    """

    name = "optimistic"
    label = "version-checked UPDATE (the fallback while Redis is down)"
    # It reads the stock itself on every attempt, and its write refuses a restarted sale.
    item_may_be_remembered = True

    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        attempts = MAX_ATTEMPTS
        for attempt in range(attempts):
            allocation = self._plan(item, qty, locked=False)
            simulate_work()
            try:
                sold = record(allocation)
            except HalfDone:
                sold = None  # a row moved between its read and the write: a lost race
            if sold is not None:
                return sold.order
            back_off(attempt)
        return self._take_queued(item, qty, record)

    def _take_queued(self, item: Item, qty: int, record: RecordOrder) -> Order:
        """Every attempt lost a race: queue for the rows' writer gates instead (each waiter on
        a gate, none on a row, so a loser cannot starve and the rows' queues stay short), then
        for the row locks, which only writers under a lock still hold."""
        try:
            with transaction.atomic():
                wait_for_gates(item)
                allocation = self._plan(item, qty, locked=True)
                simulate_work()
                sold: Sold | None = record(allocation)
        except RanPastDeadline:
            raise  # the checkout's deadline, not a row: answered as such
        except (RowLockTimeout, HalfDone):
            sold = None
        if sold is None:
            # Only a sale restarted meanwhile refuses a write under its row locks.
            raise Busy(
                f"{item.sku}: its stock rows stayed locked or changed after "
                f"{MAX_ATTEMPTS} lost races",
            )
        return sold.order

    def _plan(self, item: Item, qty: int, *, locked: bool) -> Allocation:
        """What to write for qty units, from the rows read now (`locked`: read FOR UPDATE, the
        stock rows in index order as every writer of several of them locks them); SoldOut
        when they hold fewer."""
        if item.shard_count:
            levels = shard_stocks(item.current_sale_id, for_update=locked)
            left = sum(levels.values())
            if left >= qty:
                return Allocation(
                    strategy=self.name, shard_units=plan_rows(levels, qty), gated=True
                )
        else:
            seen = lock_stock_row(item) if locked else read_stock(item.pk)
            left = seen.stock
            if left >= qty:
                return Allocation(strategy=self.name, expected_version=seen.version, gated=True)
        raise SoldOut(sku=item.sku, requested=qty, remaining=left)
