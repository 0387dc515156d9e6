"""`lua`: one atomic script takes the units from Redis counters; no lock at all.

The sale's units live in stock rows (stripes: FLASHSALE_STRIPES rows in the database, one Redis
counter each). The script takes the units from one counter that holds them all, the counters
tried in turn, so concurrent buyers land on different rows; the database write that follows
decrements that row only, guarded by `stock >= units`. No database row is written by every
buyer: lua pays for Redis and its own row, not for a queue on the item row.

If the database refuses, a counter was too high (it was rebuilt while other processes still
sold through the fallback): the counters are set from the database and the take is tried once
more. If anything else fails before commit, the units go back to the counters.
"""

from __future__ import annotations

import logging

from django.conf import settings

from ..breaker import breaker
from ..exceptions import Busy, SoldOut
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS, get_redis_client
from ..stock import HalfDone, Sold, shard_stocks, simulate_work
from . import rows
from .base import Allocation, RecordOrder, StockStrategy

logger = logging.getLogger(__name__)

#: Takes tried before a buyer refused by the database is told sold out (or busy).
ATTEMPTS = 2


class LuaStrategy(StockStrategy):
    name = "lua"
    uses_redis = True
    counts_in_redis = True
    shard_count = settings.FLASHSALE_STRIPES

    def take(self, *, item: Item, qty: int, buyer: str, record: RecordOrder) -> Order:
        counter = rows.counter()
        keys = rows.row_keys(item)
        cursor = rows.sale_key(item, "turn")
        for _ in range(ATTEMPTS):
            plan = counter.take_spread(cursor, keys, qty)
            if plan is None:
                # Redis restarted empty or was never warmed: seed it from the database, once.
                self._seed(item)
                plan = counter.take_spread(cursor, keys, qty)
                if plan is None:
                    raise Busy(f"{item.sku}: stock counters are being rebuilt")
            if not plan:
                raise SoldOut(sku=item.sku, requested=qty)
            sold = self._record(item, plan, record)
            if sold is not None:
                return sold.order
            # The database holds fewer units than Redis granted: the counters were too high.
            self._resync(item)
        left = sum(shard_stocks(item.current_sale_id).values())
        if left < qty:
            raise SoldOut(sku=item.sku, requested=qty, remaining=left)
        raise Busy(
            f"{item.sku}: its stock counters disagreed with the database",
            retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
        )

    def _record(self, item: Item, plan: dict[int, int], record: RecordOrder) -> Sold | None:
        try:
            simulate_work()
            return record(Allocation(strategy=self.name, shard_units=plan))
        except HalfDone:
            return None  # refused part way: nothing written, the counters get resynced
        except BaseException:
            self._give_back(item, plan)
            raise

    def _seed(self, item: Item) -> None:
        levels = shard_stocks(item.current_sale_id)
        pipe = get_redis_client().pipeline(transaction=False)
        for index, units in levels.items():
            pipe.set(rows.row_key(item, index), units, nx=True)
        pipe.execute()

    def _resync(self, item: Item) -> None:
        try:
            rows.sync_rows(item)
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            logger.warning("could not resync %s from the database: Redis is down", item.sku)

    def _give_back(self, item: Item, plan: dict[int, int]) -> None:
        try:
            rows.counter().give_back_many({rows.row_key(item, i): u for i, u in plan.items()})
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            # The counters are now low; rebuilding them from the database when Redis is
            # reachable again restores them.
            logger.warning("could not give %s units of %s back: Redis is down", plan, item.sku)

    def sync_redis(self, *, item: Item) -> None:
        rows.sync_rows(item)

    def return_units(self, *, item: Item, order: Order) -> None:
        rows.give_back_rows(item, order)

    def redis_stock(self, *, item: Item) -> int | None:
        return rows.rows_total(item)
