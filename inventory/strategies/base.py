"""The contract every stock strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime
from typing import Protocol

from ..models import Item, Order
from ..sale_values import Allocation, SaleRequest, Sold


class PreparedWrite(Protocol):
    """One sale's statement made ready before it may be written (`RecordOrder.prepare`): used
    as a context manager (which frees what it holds, whether it ran or not), and called once
    to write it."""

    def __enter__(self) -> PreparedWrite: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def __call__(self, *, fence: int | None = None) -> Sold | None:
        """Write it, as the recorder's call does, with `fence` (a lock's fencing token for the
        item row, known only once the lock is held) when given."""


class RecordOrder(Protocol):
    """Writes the checkout's sale (`inventory.sale_statement.SaleRecorder`)."""

    @property
    def idempotency_key(self) -> str | None:
        """The checkout's idempotency key, if it has one (the database enforces it; a strategy
        may use it to keep twin retries apart)."""

    def __call__(self, allocation: Allocation) -> Sold | None:
        """Take the allocation's units and write the order row (and anything else the checkout
        records) all at once: the committed sale, or None when a guard refused and nothing
        changed. Raises `inventory.sale_values.HalfDone` when a multi-row allocation was
        refused part way (nothing changed either)."""

    def prepare(self, allocation: Allocation) -> PreparedWrite:
        """The same write as a call with `allocation`, made ready (its statement built, a
        cursor open) to run later: a lock holder prepares it before it asks for the lock."""

    def as_fallback(self) -> RecordOrder:
        """The same checkout, recorded as served by the database fallback."""

    def request(
        self, *, served_by: str, rows: dict[int, int], fences: dict[int, int] | None = None
    ) -> SaleRequest:
        """The sale as `inventory.batch_statement.sell_batch` takes it, for group commit: `rows`
        the units to take from each stock row, `fences` (a lock holder's) each row's lock's
        fencing token."""

    def sold(
        self,
        *,
        order_id: int,
        public_id: str,
        served_by: str,
        shard_units: dict[int, int],
        placed_at: datetime,
    ) -> Sold:
        """The sale `inventory.batch_statement.sell_batch` committed for this checkout."""


class StockStrategy(ABC):
    """Decides who gets a unit of an item, and keeps whatever it keeps in Redis true.

    Contract of `take`:
    - it either has `record(allocation)` take exactly qty units off the item in the database and
      write the order, returning that order once committed; or it takes nothing and raises;
    - the write is guarded (`stock >= qty`, a version check, shard guards), so no interleaving,
      expired lock or stale Redis counter makes it sell a unit the database does not hold;
      only `unsafe` (and the pitfall lab's naive code) asks for an unguarded write, on purpose;
    - `SoldOut` when fewer than qty units are left, `Busy` when contention outlasted the wait;
    - a Redis connection or timeout error escapes only while nothing is committed, so that a
      fallback may serve the same checkout; after commit Redis failures are absorbed;
    - if `record` raises, the strategy undoes its own effects (Redis included) and re-raises.
    """

    name: str
    #: What it does, in a few words (the admin and the docs show it beside the name).
    label: str
    #: Whether it may sell more than the stock (`unsafe`, the baseline that shows the damage):
    #: every other strategy must never oversell, and the tools fail a run where one does.
    oversells: bool = False
    #: Whether the strategy needs Redis (and so runs behind the database fallback).
    uses_redis: bool = False
    #: Whether its checkouts hold Redis locks (their waits, renewals and losses are counted).
    holds_locks: bool = False
    #: Whether the strategy keeps a count of the units left in Redis (checked by the audit).
    counts_in_redis: bool = False
    #: How many stock rows the strategy keeps for an item's sale (0: the item row alone).
    shard_count: int = 0
    #: Whether a checkout may use an item read a moment ago (`services.ITEM_MEMORY_MS`): true
    #: when everything the strategy decides with is kept per sale and checked at the write,
    #: and it raises `inventory.sale_values.SaleRestarted` when it finds the sale restarted.
    item_may_be_remembered: bool = False

    @abstractmethod
    def take(self, *, item: Item, qty: int, record: RecordOrder) -> Order:
        """Take qty units of item for buyer and record the order; see the class contract."""

    def sync_redis(self, *, item: Item, force: bool = False) -> None:  # noqa: B027 - optional hook
        """Rebuild this strategy's Redis state for item from the database. `force`: overwrite
        what Redis holds even where it looks as new as the database (a repair)."""

    def return_units(self, *, item: Item, order: Order) -> None:  # noqa: B027 - optional hook
        """Give a failed or expired order's units back to this strategy's Redis state.

        Called after the database got them back; must be safe to call again for the same
        order (a redelivered task does), adding the units at most once.
        """

    def add_units(self, *, item: Item, units: int, rows: dict[int, int]) -> None:  # noqa: B027
        """Tell this strategy's Redis state of units a restock added (`units` to the item row,
        or `rows`: units per stock row), after the database has them. Only ever raise it by
        increments: a checkout may be taking units at the same moment."""

    def redis_stock(self, *, item: Item) -> int | None:
        """Units Redis believes are left, or None when the strategy keeps no count in Redis."""
        return None

    def redis_settled(self, *, item: Item) -> bool:
        """Whether what Redis counts for item's sale may be compared with the database now,
        and repaired from it: not while processes hold units of it taken ahead, which they
        give back themselves, unless one of them died holding some."""
        return True
