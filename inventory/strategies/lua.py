"""`lua`: one atomic script checks the Redis counter and DECRBYs it; no lock at all.

Redis decides who gets a unit; the database write that follows is guarded (`stock >= qty`). If
the database refuses, the counter was too high (it was rebuilt while other processes still sold
through the fallback): the counter is set from the database and the buyer told it is sold out.
If anything else fails before commit, the units go back to the counter.
"""

from __future__ import annotations

import logging

from locking import StockCounter

from ..breaker import breaker
from ..exceptions import Busy, SoldOut
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS, get_redis_client, redis_key
from ..stock import read_stock, simulate_work
from .base import Allocation, RecordOrder, StockStrategy

logger = logging.getLogger(__name__)


def stock_key(item: Item) -> str:
    # Keyed by sale: a restarted sale never meets a counter left by the previous one.
    return redis_key("item", item.sku, "sale", item.current_sale_id, "stock")


def returned_marker(order: Order) -> str:
    """Set once an order's units are back in Redis, so a retried give-back adds nothing."""
    return redis_key("order", order.pk, "returned")


class LuaStrategy(StockStrategy):
    name = "lua"
    uses_redis = True
    counts_in_redis = True

    def _counter(self) -> StockCounter:
        return StockCounter(get_redis_client())

    def take(self, *, item: Item, qty: int, buyer: str, record: RecordOrder) -> Order:
        counter = self._counter()
        key = stock_key(item)
        left = counter.take(key, qty)
        if left == StockCounter.MISSING:
            # Redis restarted empty or was never warmed: seed it from the database, once.
            get_redis_client().set(key, read_stock(item.pk).stock, nx=True)
            left = counter.take(key, qty)
            if left == StockCounter.MISSING:
                raise Busy(f"{item.sku}: stock counter is being rebuilt")
        if left == StockCounter.INSUFFICIENT:
            raise SoldOut(sku=item.sku, requested=qty)
        try:
            simulate_work()
            sold = record(Allocation(strategy=self.name))
        except BaseException:
            self._give_back(counter, key, qty)
            raise
        if sold is None:
            # The database holds fewer units than Redis granted: the counter was too high.
            self._resync(counter, key, item)
            raise SoldOut(sku=item.sku, requested=qty)
        return sold.order

    def _resync(self, counter: StockCounter, key: str, item: Item) -> None:
        try:
            counter.set(key, read_stock(item.pk).stock)
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            logger.warning("could not resync %s from the database: Redis is down", key)

    def _give_back(self, counter: StockCounter, key: str, qty: int) -> None:
        try:
            counter.give_back(key, qty)
        except REDIS_DOWN_ERRORS as exc:
            breaker.record_failure(exc)
            # The counter is now low by qty; rebuilding it from the database when Redis is
            # reachable again restores it.
            logger.warning("could not give %s units back to %s: Redis is down", qty, key)

    def sync_redis(self, *, item: Item) -> None:
        self._counter().set(stock_key(item), read_stock(item.pk).stock)

    def return_units(self, *, item: Item, order: Order) -> None:
        self._counter().give_back_once(returned_marker(order), {stock_key(item): order.qty})

    def redis_stock(self, *, item: Item) -> int | None:
        return self._counter().get(stock_key(item))
