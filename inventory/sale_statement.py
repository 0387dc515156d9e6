"""The sale statement: one checkout's sale written by one SQL statement, shared by every strategy.

Every decrement is a conditional UPDATE (`stock >= qty`, and a version check where the caller
read one), so a write made on stale information changes nothing instead of overselling. The
guarded decrements, the buyer's allowance and the order row are committed together or not at
all; one statement is one round trip, and a row it decrements stays locked only from its
UPDATE to the commit that ends the same statement. Where an item's units live: an item sold by
`segmented` or `lua` keeps them in stock rows of its sale (`StockShard`) and a sale writes only
the rows it takes from; every other item keeps them in its own row. Lock order: stock rows in
index order; nothing locks the item row and then a stock row. Many sales at once:
`inventory.batch_statement`; the statement's text: `inventory.sale_sql`. Design:
docs/design.md#the-sale-statement.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from django.db import DatabaseError
from django.utils import timezone

from . import deadline
from .fastpath import prepared_cursor
from .lost_connection import connection_lost, resolve
from .models import Item, OrderStatus, new_public_id
from .row_locks import gate, row_lock_wait
from .sale_sql import Shape, sale_sql
from .sale_values import (
    WAITED_TOO_LONG,
    Allocation,
    Fenced,
    HalfDone,
    SaleRequest,
    SaleRestarted,
    Sold,
    SqlState,
    waited_too_long,
)


@dataclass(frozen=True)
class SaleRecorder:
    """Writes one checkout's sale (the `RecordOrder` strategies are handed): the buyer's side of
    the order is fixed here, each call says where the units come from."""

    item: Item
    qty: int
    buyer: str
    idempotency_key: str | None = None
    limit: int | None = None
    #: Served by the database fallback while Redis is down.
    fallback: bool = False

    def __call__(self, allocation: Allocation) -> Sold | None:
        return sell(self, allocation)

    def prepare(self, allocation: Allocation) -> PreparedSale:
        return prepare_sale(self, allocation)

    def as_fallback(self) -> SaleRecorder:
        return replace(self, fallback=True)

    def request(
        self, *, served_by: str, rows: dict[int, int], fences: dict[int, int] | None = None
    ) -> SaleRequest:
        """The sale as `sell_batch` takes it: `rows` the units to take from each stock row,
        `fences` (a lock holder's) the fencing token of each row's lock."""
        request: SaleRequest = {
            "public_id": str(new_public_id()),
            "item": self.item.pk,
            "sale": self.item.current_sale_id,
            "qty": self.qty,
            "buyer": self.buyer,
            "key": self.idempotency_key or None,
            "limit": self.limit,
            "served_by": served_by,
            "fallback": self.fallback,
            "rows": rows,
        }
        if fences is not None:
            request["fences"] = fences
        return request

    def sold(
        self,
        *,
        order_id: int,
        public_id: str,
        served_by: str,
        shard_units: dict[int, int],
        placed_at: datetime,
    ) -> Sold:
        """The sale `sell_batch` committed for this checkout (`public_id`: its request's)."""
        fields = self.order_fields(
            order_id=order_id,
            public_id=uuid.UUID(public_id),
            served_by=served_by,
            fallback=self.fallback,
            shard_units={str(index): taken for index, taken in sorted(shard_units.items())},
            placed_at=placed_at,
        )
        return Sold(item=self.item, order_fields=fields, item_stock=None)

    def order_fields(
        self,
        *,
        order_id: int,
        public_id: uuid.UUID,
        served_by: str,
        fallback: bool,
        shard_units: dict[str, int] | None,
        placed_at: datetime,
    ) -> dict[str, Any]:
        """The committed order row's fields, for building its `Order` without reading it."""
        return {
            "id": order_id,
            "public_id": public_id,
            "sale_id": self.item.current_sale_id,
            "buyer": self.buyer,
            "qty": self.qty,
            "status": OrderStatus.PENDING,
            "idempotency_key": self.idempotency_key or None,
            "served_by": served_by,
            "fallback": fallback,
            "shard_units": shard_units,
            "created_at": placed_at,
            "updated_at": placed_at,
        }


def sell(order: SaleRecorder, allocation: Allocation) -> Sold | None:
    """Take the order's units of its item's current sale and write the order, in one statement:
    `order` says what the buyer takes (item, quantity, buyer, key, limit), `allocation` where
    the units come from and which strategy serves them.

    Where the units come from:
    - an item sold from stock rows (`item.shard_count > 0`) gives `shard_units`, the units to
      take from each of its sale's rows; each row's decrement is guarded by `stock >= units`,
      and the item row is only read (is this sale still the item's current one?), never
      written, so buyers on different rows never wait for each other;
    - any other item takes qty from the item row, guarded by `stock >= qty` (and by
      `version = expected_version` when given) and by the sale still being current.

    Either every guard passes and everything is written (decrements, the buyer's allowance for
    the sale when `limit` is set, the order row), or nothing is: a refusal returns None; a
    refusal that comes after some rows were decremented aborts the statement and raises
    HalfDone. A sale restarted since `item` was read refuses and raises SaleRestarted (the
    units it would take belong to another sale).

    `set_stock` replaces the item row's guarded decrement by an absolute, unguarded write: the
    lost update that `unsafe` and the pitfall lab's trust-the-lock demonstrate.

    Fencing: a sale made under a lock passes the lock's fencing token (`fence` for the item
    row, `shard_fences` for each stock row). A row refuses it when it has accepted a later
    token (a later holder of the lock has written: this one's lock expired under it) and
    otherwise records it, so a holder paused past its lock's TTL cannot write when it wakes.
    Writes under no lock (the fallback, `lua`, restocks, give-backs) leave the token alone. An
    item row that refused the token raises Fenced (a stock row's refusal returns None, as a
    short row's does).

    Gates: a `gated` allocation first takes, for each row it writes, that row's writer gate
    (`inventory.row_locks`: a PostgreSQL advisory lock, `pg_try_advisory_xact_lock`, held to
    the commit) without waiting, and writes nothing when another gated writer holds one (None,
    or HalfDone part way, as for a lost race). The writers that decide by no lock
    (`optimistic`, and the fallback through it) thus keep at most one connection on a row,
    however many processes sell: the others back off in their own process instead of queueing
    on the row, where every commit would wake them all to find its version changed. A gate
    lives in the database, so it holds with Redis down and across hosts;
    `row_locks.wait_for_gates` waits for gates in turn instead.

    Raises IntegrityError when the allowance would pass the limit (constraint
    `allowance_within_limit`) or the idempotency key is taken, and RowLockTimeout when a row
    it must write stayed locked by another transaction for ROW_LOCK_TIMEOUT_MS, or
    RanPastDeadline when the database held the statement past the checkout's deadline (then
    nothing is written). Outside a transaction the statement commits on return; inside one it
    is part of it, and the lock timeout it sets holds until that transaction ends.
    """
    with prepare_sale(order, allocation) as sale:
        return sale()


def prepare_sale(order: SaleRecorder, allocation: Allocation) -> PreparedSale:
    """`sell`'s statement, built and with a cursor open, to run later (`PreparedSale`): a lock
    holder prepares its sale before it asks for the lock, so that what it holds the lock for
    is the statement's round trip and little else. Raises ValueError for an allocation `sell`
    refuses."""
    item, qty = order.item, order.qty
    shard_units, set_stock = allocation.shard_units, allocation.set_stock
    expected_version, limit = allocation.expected_version, order.limit
    served_by, fallback = allocation.strategy, order.fallback or allocation.fallback
    fence, shard_fences, gated = allocation.fence, allocation.shard_fences, allocation.gated
    shards = sorted((shard_units or {}).items())
    if shards and (expected_version is not None or set_stock is not None or fence is not None):
        raise ValueError(
            "a sale from stock rows takes no item version, absolute stock or item fence"
        )
    if shard_fences is not None and set(shard_fences) != {index for index, _ in shards}:
        raise ValueError("shard_fences names a fence for each row the sale takes from")
    if bool(shards) != bool(item.shard_count):
        raise ValueError(
            f"{item.sku} keeps {item.shard_count} stock rows: "
            f"{'name the rows to take from' if item.shard_count else 'it has none to take from'}"
        )
    units = {str(index): units for index, units in shards} or None
    public_id = new_public_id()
    params: dict[str, object] = {
        "public_id": public_id,
        "item": item.pk,
        "sale": item.current_sale_id,
        "qty": qty,
        "buyer": order.buyer,
        "key": order.idempotency_key or None,
        "served_by": served_by,
        "fallback": fallback,
        "shard_units": None if units is None else json.dumps(units),
        "now": None,  # when it runs
        "limit": limit,
        "set_stock": set_stock,
        "version": expected_version,
        "fence": fence,
        "lock_timeout": None,  # when it runs: what is left of the checkout's deadline
        "until": None,  # when it runs: the checkout's deadline, as a time of day
    }
    for n, (index, taken) in enumerate(shards):
        params[f"si{n}"] = index
        params[f"su{n}"] = taken
        if shard_fences is not None:
            params[f"sf{n}"] = shard_fences[index]
        if gated:
            params[f"sg{n}"] = gate(item.current_sale_id or 0, index)[1]
    if gated and not shards:
        params["gate"] = gate(item.pk)[1]
    return PreparedSale(
        order=order,
        params=params,
        public_id=public_id,
        served_by=served_by,
        fallback=fallback,
        units=units,
        shape=Shape(
            rows=len(shards),
            absolute=set_stock is not None,
            versioned=expected_version is not None,
            limited=limit is not None,
            fenced=fence is not None or shard_fences is not None,
            gated=gated,
        ),
    )


@dataclass
class PreparedSale:
    """One sale statement ready to run (`prepare_sale`): its parameters built and a cursor
    open. Call it once, with the lock's fencing token for the item row when it was not in
    the allocation, to run it (as `sell` does, returning the same); use it as a context
    manager, so that its cursor is closed whether it runs or not."""

    order: SaleRecorder
    params: dict[str, object]
    public_id: uuid.UUID
    served_by: str
    fallback: bool
    #: The units taken from each stock row ({index: units}); None for a sale from the item row.
    units: dict[str, int] | None
    #: The statement's form (`sale_sql`).
    shape: Shape
    cursor: Any = None

    def __enter__(self) -> PreparedSale:
        self.cursor = prepared_cursor()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cursor.close()

    def __call__(self, *, fence: int | None = None) -> Sold | None:
        params, order, units = self.params, self.order, self.units
        item = order.item
        shape = self.shape
        if fence is not None:
            # The item row's fence, known only once the lock is held.
            if units is not None:
                raise ValueError("a sale from stock rows takes no item fence")
            params["fence"], shape = fence, shape._replace(fenced=True)
        fenced_by = params["fence"]
        params["now"] = now = timezone.now()
        params["lock_timeout"] = row_lock_wait(item.sku)
        params["until"] = deadline.time_of_day()
        database = self.cursor.db
        backend = database.connection.info.backend_pid
        try:
            self.cursor.execute(sale_sql(shape), params)
            row = self.cursor.fetchone()
        except DatabaseError as exc:
            sqlstate = getattr(exc.__cause__, "sqlstate", None)
            if sqlstate == SqlState.HALF_DONE:
                raise HalfDone(str(exc.__cause__)) from None
            if sqlstate in WAITED_TOO_LONG:
                raise waited_too_long(sqlstate, str(exc.__cause__)) from None
            if connection_lost(database) and not database.in_atomic_block:
                # Sent outside a transaction: it may have committed before the answer was lost.
                placed = resolve([str(self.public_id)], backend)
                row = (placed[str(self.public_id)], None, item.current_sale_id, None)
            else:
                raise
        order_id, item_stock, current_sale = row[0], row[1], row[2]
        if order_id is None:
            if current_sale != item.current_sale_id:
                raise SaleRestarted(f"{item.sku}: sale {item.current_sale_id} is over")
            if fenced_by is not None and row[3] > fenced_by:
                raise Fenced(f"{item.sku}: the item row has accepted a later lock holder's sale")
            return None
        fields = order.order_fields(
            order_id=order_id,
            public_id=self.public_id,
            served_by=self.served_by,
            fallback=self.fallback,
            shard_units=units,
            placed_at=now,
        )
        rows = {int(index): pair for index, pair in (row[3] or {}).items()} if units else {}
        return Sold(
            item=item,
            order_fields=fields,
            item_stock=item_stock,
            shard_levels={index: left for index, (left, _) in rows.items()},
            shard_versions={index: version for index, (_, version) in rows.items()},
        )
