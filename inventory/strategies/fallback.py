"""Composition, as Django's `cached_db` sessions: Redis first, the database behind it."""

from __future__ import annotations

from .. import metrics
from ..breaker import CircuitBreaker
from ..models import Item, Order
from ..redis_client import REDIS_DOWN_ERRORS
from .base import RecordOrder, StockStrategy


class RedisWithFallback(StockStrategy):
    """Serve through `primary`; when Redis is unreachable, through `fallback` instead.

    Only connection errors and timeouts switch over (a busy lock is an answer, not an outage),
    and only while nothing is committed: the primary's contract guarantees that. The breaker
    keeps later checkouts off Redis until it answers again and has been rebuilt.
    """

    uses_redis = True

    def __init__(
        self, primary: StockStrategy, fallback: StockStrategy, breaker: CircuitBreaker
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.breaker = breaker
        self.name = primary.name
        self.label = primary.label
        self.oversells = primary.oversells
        self.shard_count = primary.shard_count
        self.counts_in_redis = primary.counts_in_redis
        self.holds_locks = primary.holds_locks
        # The fallback decides from the database rows of the sale (and refuses a sale that is
        # no longer current) just as well.
        self.item_may_be_remembered = primary.item_may_be_remembered

    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        if self.breaker.allow():
            try:
                return self.primary.take(item=item, qty=qty, record=record)
            except REDIS_DOWN_ERRORS as exc:
                self.breaker.record_failure(exc)
        metrics.FALLBACK_CHECKOUTS.labels(self.name).inc()
        return self.fallback.take(item=item, qty=qty, record=record.as_fallback())

    def sync_redis(self, *, item: Item, force: bool = False) -> None:
        self.primary.sync_redis(item=item, force=force)

    def return_units(self, *, item: Item, order: Order) -> None:
        self.primary.return_units(item=item, order=order)

    def add_units(self, *, item: Item, units: int, rows: dict[int, int]) -> None:
        self.primary.add_units(item=item, units=units, rows=rows)

    def redis_stock(self, *, item: Item) -> int | None:
        return self.primary.redis_stock(item=item)

    def redis_settled(self, *, item: Item) -> bool:
        return self.primary.redis_settled(item=item)
