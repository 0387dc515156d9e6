"""The contract every stock strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from ..models import Item, Order


@dataclass(frozen=True)
class Allocation:
    """Where a checkout's units came from, handed to the order recorder."""

    strategy: str
    shard_units: dict[int, int] | None = None
    fallback: bool = False

    def as_fallback(self) -> Allocation:
        return replace(self, fallback=True)


#: Writes the order row (and anything else the checkout records) for an allocation. Strategies
#: call it inside the same database transaction as their stock decrement.
RecordOrder = Callable[[Allocation], Order]


class StockStrategy(ABC):
    """Decides who gets a unit of an item, and keeps whatever it keeps in Redis true.

    Contract of `take`:
    - it either takes exactly qty units off the item in the database and calls
      `record(allocation)` in the same transaction, returning the order after commit; or it takes
      nothing and raises;
    - its final database write is guarded (version check or `stock >= qty`), so no interleaving,
      expired lock or stale Redis counter makes it sell a unit the database does not hold;
      only `unsafe` breaks this, on purpose;
    - `SoldOut` when fewer than qty units are left, `Busy` when contention outlasted the wait;
    - a Redis connection or timeout error escapes only while nothing is committed, so that a
      fallback may serve the same checkout; after commit Redis failures are absorbed;
    - if `record` raises, the strategy undoes its own effects (Redis included) and re-raises.
    """

    name: ClassVar[str]
    #: Whether the strategy needs Redis (and so runs behind the database fallback).
    uses_redis: ClassVar[bool] = False
    #: Whether the strategy keeps a count of the units left in Redis (checked by the audit).
    counts_in_redis: ClassVar[bool] = False
    #: How many stock shards the strategy keeps for an item (0: the item row alone).
    shard_count: ClassVar[int] = 0

    @abstractmethod
    def take(self, *, item: Item, qty: int, buyer: str, record: RecordOrder) -> Order:
        """Take qty units of item for buyer and record the order; see the class contract."""

    def sync_redis(self, *, item: Item) -> None:  # noqa: B027 - optional hook
        """Rebuild this strategy's Redis state for item from the database."""

    def return_units(self, *, item: Item, order: Order) -> None:  # noqa: B027 - optional hook
        """Give a failed or expired order's units back to this strategy's Redis state.

        Called after the database got them back; must be safe to call again for the same
        order (a redelivered task does), adding the units at most once.
        """

    def redis_stock(self, *, item: Item) -> int | None:
        """Units Redis believes are left, or None when the strategy keeps no count in Redis."""
        return None
