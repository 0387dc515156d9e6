"""What a sale write is asked, what it answers and how it refuses: the values the strategies and
the sale statements (`inventory.sale_statement`, `inventory.batch_statement`) pass each other.

It imports neither side, so both import it and neither imports the other. A refusal changes
nothing: a guard that fails writes no row. Design: docs/design.md#the-sale-statement.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from functools import cached_property
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from .fastpath import committed_order

if TYPE_CHECKING:
    from .models import Item, Order


@dataclass(frozen=True)
class StockRow:
    """A stock row's units and version, as read from the database (the item row or a shard's)."""

    stock: int
    version: int


@dataclass(frozen=True)
class Allocation:
    """What a checkout takes and where from, handed to the order recorder.

    The recorder writes it in one statement (`inventory.sale_statement.sell`): the guarded
    decrement of the item row (or of the stock rows in `shard_units`; only at
    `expected_version` and `fence` when given), the buyer's allowance and the order row.
    """

    strategy: str
    shard_units: dict[int, int] | None = None
    fallback: bool = False
    expected_version: int | None = None
    #: Write this absolute stock instead of a guarded decrement (the `unsafe` lost update).
    set_stock: int | None = None
    #: The fencing token of the lock the write is made under (`locking.Lock.fence`): the item
    #: row refuses it when it has accepted a later one. None: a write under no fenced lock.
    fence: int | None = None
    #: The same per stock row in `shard_units` (each row's own lock's fence), or None.
    shard_fences: dict[int, int] | None = None
    #: Take each row's writer gate first (`inventory.row_locks`) and refuse, as a lost race,
    #: when another gated writer holds one: so the writers that decide by no lock (`optimistic`,
    #: and through it the fallback) never queue on a row, however many processes sell.
    gated: bool = False

    def as_fallback(self) -> Allocation:
        return replace(self, fallback=True)


@dataclass(frozen=True)
class Sold:
    """A committed sale: the order row, and the units left where they were taken from.

    The Order object is built on first use: a strategy that holds a lock can release it first.
    """

    item: Item
    order_fields: dict[str, Any]
    #: Units left on the item row (None when the sale took from stock rows instead).
    item_stock: int | None
    #: Units left on each stock row the sale took from (empty when it took from none).
    shard_levels: dict[int, int] = field(default_factory=dict)
    #: The version of each of those rows the sale wrote.
    shard_versions: dict[int, int] = field(default_factory=dict)

    @cached_property
    def order(self) -> Order:
        return committed_order(self.order_fields, self.item)


class SaleRequest(TypedDict):
    """One checkout's sale in a batch (`inventory.batch_statement.sell_batch`), built by its
    recorder (`SaleRecorder.request`). The batch goes to PostgreSQL as one JSON array, whose
    objects `inventory_sell_batch` (migrations 0006, 0009) reads by these keys."""

    #: The order's public id (a UUID's text), made before the statement is sent.
    public_id: str
    item: int
    sale: int | None
    qty: int
    buyer: str
    #: The idempotency key, or None.
    key: str | None
    #: The per-buyer limit, or None.
    limit: int | None
    served_by: str
    fallback: bool
    #: Units to take from each stock row ({index: units}).
    rows: dict[int, int]
    #: A lock holder's sale (`segmented`'s): the fencing token of each of its rows' locks. Its
    #: answer carries its rows' levels; when its batch is refused it is answered `AGAIN`.
    fences: NotRequired[dict[int, int]]


class Outcome(StrEnum):
    """What a batch did with one of its sales (`inventory.batch_statement.sell_batch`); the
    values are those `inventory_sell_batch` (migration 0006) answers with."""

    SOLD = "sold"
    #: A stock row held fewer units than the sale takes.
    SHORT = "short"
    #: The item's sale was restarted since the checkout read it.
    RESTARTED = "restarted"
    #: The idempotency key is taken (by a twin that committed first).
    DUPLICATE = "duplicate"
    #: The buyer's allowance would pass the per-buyer limit.
    LIMIT = "limit"
    #: A lock holder's sale in a refused batch: written nowhere, its holder writes it alone.
    AGAIN = "again"


@dataclass(frozen=True)
class Written:
    """One sale's answer from `sell_batch`."""

    outcome: Outcome
    #: The order row's id (a sale `SOLD`), else None.
    order_id: int | None
    placed_at: datetime
    #: A lock holder's sale `SOLD`: {index: (stock, version)} of its rows after the batch.
    levels: dict[int, tuple[int, int]] | None = None


class SqlState(StrEnum):
    """The SQLSTATEs PostgreSQL answers a sale statement with when it refuses or waits too long."""

    #: Raised by `inventory_all_or_nothing` (migration 0004): a statement took from some of its
    #: rows but not all (a row short, or the sale restarted), and was rolled back.
    HALF_DONE = "FS001"
    #: lock_not_available: a row-lock wait ran past lock_timeout.
    LOCK_NOT_AVAILABLE = "55P03"
    #: query_canceled: a statement ran past statement_timeout.
    QUERY_CANCELED = "57014"
    #: unique_violation: the idempotency key is taken.
    UNIQUE_VIOLATION = "23505"
    #: check_violation: the buyer's allowance would pass the limit (`allowance_within_limit`).
    CHECK_VIOLATION = "23514"
    #: Raised by `inventory_in_time` (migration 0017): the statement ran past its checkout's
    #: deadline (the database stopped or slow), and was rolled back.
    DEADLINE_PASSED = "FS002"


#: What a statement that waited too long is answered with: a row that stayed locked, or a
#: statement that ran past its checkout's deadline.
WAITED_TOO_LONG = frozenset(
    {SqlState.LOCK_NOT_AVAILABLE, SqlState.QUERY_CANCELED, SqlState.DEADLINE_PASSED}
)


class RowLockTimeout(Exception):
    """A row the sale needs (the item's, a shard's, the buyer's allowance) stayed locked longer
    than ROW_LOCK_TIMEOUT_MS: another transaction holds it."""


class RanPastDeadline(RowLockTimeout):
    """The sale statement ran past its checkout's deadline (the database stopped or slow, not a
    row held): PostgreSQL rolled it back."""


def waited_too_long(sqlstate: str | None, message: str) -> RowLockTimeout:
    """What a statement refused with one of WAITED_TOO_LONG raises."""
    if sqlstate == SqlState.DEADLINE_PASSED:
        return RanPastDeadline(message)
    return RowLockTimeout(message)


class SaleRestarted(Exception):
    """The item's sale was restarted since the item was read: read it again and retry."""


class Fenced(Exception):
    """The item row refused the sale's fencing token: it has accepted a later holder's of the
    same lock, so this holder's lock expired under it. Nothing was written."""


class HalfDone(Exception):
    """A sale statement took from some of its rows but not all: PostgreSQL rolled it back."""
