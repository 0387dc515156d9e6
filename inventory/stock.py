"""Guarded stock writes on the system of record, shared by every strategy.

Every decrement here is a conditional UPDATE (`stock >= qty`, and a version check where the
caller read one), so a write made on stale information changes nothing instead of overselling.

Where an item's units live: an item sold by `segmented` or `lua` keeps them in stock rows
(`StockShard`, one set per sale: shards or stripes), and a sale writes only the rows it takes
from, never the item row, so buyers on different rows never queue behind each other. Every
other item keeps them in its own row. Lock order: writes that touch several stock rows lock
them in index order; the reconciler locks a sale's rows before the item row; nothing locks the
item row and then a stock row. So no two writers can deadlock.

A sale is one SQL statement (`sell`): the guarded decrements, the buyer's allowance and the
order row, committed together or not at all. One statement means one round trip, and a row it
decrements stays locked only from its UPDATE to the commit that ends the same statement, never
across a round trip to the client.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    OperationalError,
    connection,
    connections,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from django.db.models import F
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init
from django.utils import timezone

from . import deadline
from .exceptions import NotWritten, OutcomeUnknown
from .models import BuyerAllowance, Item, Order, OrderStatus, StockShard, new_public_id

if TYPE_CHECKING:
    from .strategies.base import Allocation


@dataclass(frozen=True)
class StockRow:
    stock: int
    version: int


def read_stock(item_id: int) -> StockRow:
    stock, version = Item.objects.values_list("stock", "version").get(pk=item_id)
    return StockRow(stock=stock, version=version)


class RowLockTimeout(Exception):
    """A row the sale needs (the item's, a shard's, the buyer's allowance) stayed locked longer
    than FLASHSALE_ROW_LOCK_TIMEOUT_MS: another transaction holds it."""


def lock_stock_row(item_id: int) -> StockRow:
    """Read the item's stock holding its row lock until the transaction ends.

    Call inside a transaction. Waits at most FLASHSALE_ROW_LOCK_TIMEOUT_MS, then raises
    RowLockTimeout (the transaction is then unusable: let it roll back).
    """
    with connection.cursor() as cursor:
        cursor.execute(
            f"SET LOCAL lock_timeout = '{int(settings.FLASHSALE_ROW_LOCK_TIMEOUT_MS)}ms'"
        )
    try:
        stock, version = (
            Item.objects.select_for_update().values_list("stock", "version").get(pk=item_id)
        )
    except OperationalError as exc:
        raise RowLockTimeout(str(exc)) from exc
    return StockRow(stock=stock, version=version)


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


#: Order's columns, in the order `Order.from_db` takes them.
_ORDER_FIELDS = [model_field.attname for model_field in Order._meta.concrete_fields]
#: Each column None: the value of those a sale leaves unset.
_NO_ORDER_FIELDS = dict.fromkeys(_ORDER_FIELDS)


def committed_order(fields: dict[str, Any], item: Item) -> Order:
    """The `Order` of a row a sale statement has just committed with these fields, built
    without reading it back: a checkout builds one per sale.

    As the ORM builds a row it read (`Model.from_db`: an instance that is not `adding`, of the
    default database), less its per-field work: `Model.__init__` sets each of the fourteen
    fields through its descriptor, which cost a fifth of a `lua` checkout's CPU in the buying
    process. Nothing is lost while nobody listens to `pre_init`/`post_init` (the signals
    `__init__` sends); while anyone does, the order is built through `from_db` after all.
    """
    values = {**_NO_ORDER_FIELDS, **fields, "item_id": item.pk}
    if pre_init.receivers or post_init.receivers:
        order = Order.from_db(DEFAULT_DB_ALIAS, _ORDER_FIELDS, [values[n] for n in _ORDER_FIELDS])
    else:
        order = Order.__new__(Order)
        order.__dict__.update(values)
        state = order._state = ModelState()
        state.adding = False
        state.db = DEFAULT_DB_ALIAS
    order._state.fields_cache["item"] = item
    return order


class SaleRestarted(Exception):
    """The item's sale was restarted since the item was read: read it again and retry."""


class Fenced(Exception):
    """The item row refused the sale's fencing token: it has accepted a later holder's of the
    same lock, so this holder's lock expired under it. Nothing was written."""


class HalfDone(Exception):
    """A sale statement took from some of its rows but not all: PostgreSQL rolled it back."""


#: SQLSTATE raised by `inventory_all_or_nothing` (migration 0004).
HALF_DONE_SQLSTATE = "FS001"
#: PostgreSQL's lock_not_available: a row-lock wait ran past lock_timeout.
LOCK_NOT_AVAILABLE_SQLSTATE = "55P03"
#: PostgreSQL's query_canceled: a statement ran past statement_timeout.
QUERY_CANCELED_SQLSTATE = "57014"


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

    Gates: a `gated` allocation first takes, for each row it writes, that row's writer gate (a
    PostgreSQL advisory lock, `pg_try_advisory_xact_lock`, held to the commit) without waiting,
    and writes nothing when another gated writer holds one (None, or HalfDone part way, as for
    a lost race). The writers that decide by no lock (`optimistic`, and the fallback through
    it) thus keep at most one connection on a row, however many processes sell: the others
    back off in their own process instead of queueing on the row, where every commit would
    wake them all to find its version changed. A gate lives in the database, so it holds with
    Redis down and across hosts; `wait_for_gates` waits for gates in turn instead.

    Raises IntegrityError when the allowance would pass the limit (constraint
    `allowance_within_limit`) or the idempotency key is taken, and RowLockTimeout when a row
    it must write stayed locked by another transaction for FLASHSALE_ROW_LOCK_TIMEOUT_MS (then
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
    }
    for n, (index, taken) in enumerate(shards):
        params[f"si{n}"] = index
        params[f"su{n}"] = taken
        if shard_fences is not None:
            params[f"sf{n}"] = shard_fences[index]
        if gated:
            params[f"sg{n}"] = _gate(item.current_sale_id or 0, index)[1]
    if gated and not shards:
        params["gate"] = _gate(item.pk)[1]
    return PreparedSale(
        order=order,
        params=params,
        public_id=public_id,
        served_by=served_by,
        fallback=fallback,
        units=units,
        shape={
            "absolute": set_stock is not None,
            "versioned": expected_version is not None,
            "limited": limit is not None,
            "fenced": fence is not None or shard_fences is not None,
            "gated": gated,
        },
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
    #: The statement's form, as `_sale_sql` takes it.
    shape: dict[str, bool]
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
            params["fence"], shape = fence, {**shape, "fenced": True}
        fenced_by = params["fence"]
        params["now"] = now = timezone.now()
        params["lock_timeout"] = _row_lock_wait(item.sku)
        database = self.cursor.db
        backend = database.connection.info.backend_pid
        try:
            self.cursor.execute(_sale_sql(len(units or ()), **shape), params)
            row = self.cursor.fetchone()
        except DatabaseError as exc:
            sqlstate = getattr(exc.__cause__, "sqlstate", None)
            if sqlstate == HALF_DONE_SQLSTATE:
                raise HalfDone(str(exc.__cause__)) from None
            if sqlstate in (LOCK_NOT_AVAILABLE_SQLSTATE, QUERY_CANCELED_SQLSTATE):
                raise RowLockTimeout(str(exc.__cause__)) from None
            if connection_lost(database) and not database.in_atomic_block:
                # Sent outside a transaction: it may have committed before the answer was lost.
                placed = _resolve([str(self.public_id)], backend)
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


class Outcome(StrEnum):
    """What a batch did with one of its sales (`sell_batch`)."""

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


def sell_batch(requests: list[dict[str, Any]]) -> list[Written]:
    """Write many checkouts' sales from stock rows in one statement and one commit (group
    commit); one answer per request, in order.

    Each request is what `SaleRecorder.request` builds plus `rows` ({index: units}). Each is
    its own sale with its own guards: a refusal writes nothing for that request and never
    undoes the others. A lock holder's request (`segmented`'s) also has `fences` ({index:
    token}) and `"levels": true`: its rows refuse a token older than one they have accepted, its
    `SOLD` answer carries its rows' levels after the batch, and when the batch is refused it is
    answered `AGAIN`, written nowhere: its holder writes it itself. Raises RowLockTimeout when a
    row stayed locked by another transaction past FLASHSALE_ROW_LOCK_TIMEOUT_MS or the
    checkout's deadline (then nothing of the batch is written). Outside a transaction it
    commits on return; inside one, its sales are part of that transaction (a refusal rolls back
    to a savepoint of its own).

    The batch is first written whole by one set-based statement (`_BATCH_SQL`), which sells
    every request or none; only when one of them is refused is the batch written again a request
    at a time (`inventory_sell_batch`, migration 0006), to tell each its own answer. A refusal
    is rare where Redis decides who gets a unit, and the set-based statement costs PostgreSQL a
    third to a half less per sale than a subtransaction per request.

    When the connection is lost before the answer (the database restarted, the connection
    killed), the commit may or may not have happened: the sales are looked up by their public
    ids on a new connection (`_resolve`), and answered as found; NotWritten when none is,
    OutcomeUnknown when the database does not answer.
    """
    at = timezone.now()
    wait = _row_lock_wait("the batch")
    database = connections[DEFAULT_DB_ALIAS]
    inside = database.in_atomic_block
    backend = None  # until the statement is sent
    try:
        # Inside a caller's transaction, a savepoint keeps it usable after a refusal.
        with transaction.atomic() if inside else nullcontext(), prepared_cursor() as cursor:
            backend = database.connection.info.backend_pid
            cursor.execute(_BATCH_SQL, _batch_parameters(requests, at, wait))
            found = cursor.fetchall()
    except DatabaseError as exc:
        if backend is not None and not inside and connection_lost(database):
            # One statement commits all of its orders or none.
            placed = _resolve([request["public_id"] for request in requests], backend)
            return [Written(Outcome.SOLD, placed[request["public_id"]], at) for request in requests]
        answers = _after_refusal(
            getattr(exc.__cause__, "sqlstate", None), str(exc.__cause__), requests, at, wait
        )
        if answers is None:
            raise
        return answers
    placed = {public_id: order_id for public_id, order_id, _ in found}
    return _sold(requests, placed, at, found[0][2] if found else None)


def connection_lost(database: Any) -> bool:
    """Whether the error just raised on `database` (a Django database wrapper) left its
    connection unusable (lost, closed by the server): then a statement sent on it may have
    committed or not, and only the database, asked again, knows."""
    raw = database.connection
    return raw is None or raw.closed or raw.broken


#: How long a checkout whose connection was lost mid-statement keeps asking the database whether
#: its sale committed (a restart, a failover), in seconds, before it answers that it cannot tell.
RESOLVE_SECONDS = 30.0


def _resolve(public_ids: list[str], backend_pid: int | None) -> dict[str, int]:
    """The orders of a statement whose connection was lost, found once the backend that wrote
    them is gone: {public id: order id} of those that exist (NotWritten when none does).

    Asked on a new connection; the backend, if it still runs (the connection was cut, not the
    server), is terminated first and waited for, so that nothing it had in flight can commit
    after the answer. Raises OutcomeUnknown when the database does not answer within
    RESOLVE_SECONDS."""
    database = connections[DEFAULT_DB_ALIAS]
    give_up = time.monotonic() + RESOLVE_SECONDS
    pause = 0.05
    while True:
        database.close()
        try:
            with database.cursor() as cursor:
                if backend_pid is not None:
                    cursor.execute(
                        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                        " WHERE pid = %s",
                        [backend_pid],
                    )
                cursor.execute(
                    f"SELECT public_id::text, id FROM {_ORDER} WHERE public_id = ANY(%s::uuid[])",
                    [public_ids],
                )
                found = dict(cursor.fetchall())
            break
        except DatabaseError:
            if time.monotonic() >= give_up:
                raise OutcomeUnknown(public_ids[0]) from None
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
    if not found:
        raise NotWritten(
            "the database connection was lost mid-statement, and the sale was not committed",
            retry_after=settings.FLASHSALE_BUSY_RETRY_AFTER,
        )
    # PostgreSQL spells a uuid in lower case; a request may have spelt it otherwise.
    return {
        public_id: found[str(uuid.UUID(public_id))]
        for public_id in public_ids
        if str(uuid.UUID(public_id)) in found
    }


def _after_refusal(
    sqlstate: str | None,
    message: str,
    requests: list[dict[str, Any]],
    at: datetime,
    wait: str,
) -> list[Written] | None:
    """When the set-based statement failed with `sqlstate`: the batch written again a request
    at a time if it was refused, RowLockTimeout if a row stayed locked, None for any other
    error (the caller's to raise)."""
    if sqlstate in (LOCK_NOT_AVAILABLE_SQLSTATE, QUERY_CANCELED_SQLSTATE):
        raise RowLockTimeout(message)
    if sqlstate not in _REFUSED_SQLSTATES:
        return None
    if len(requests) == 1 and not requests[0].get("levels") and sqlstate in _ONE_REFUSED:
        # A batch of one: the refusal names its reason, no need to write it again to learn it.
        return [Written(_ONE_REFUSED[sqlstate], None, at)]
    # A lock holder's request (fenced, answered its levels) is answered `AGAIN`: its holder
    # writes it on its own (`sell`), which tells a short row from a refused token.
    others = [request for request in requests if not request.get("levels")]
    answers = iter(_sell_one_by_one(others, at, wait) if others else [])
    return [
        Written(Outcome.AGAIN, None, at) if request.get("levels") else next(answers)
        for request in requests
    ]


def _row_lock_wait(sku: str) -> str:
    """How long a statement may wait for a row lock: FLASHSALE_ROW_LOCK_TIMEOUT_MS, or what is
    left of the checkout's deadline if less (Busy when none is)."""
    return f"{deadline.wait_ms(settings.FLASHSALE_ROW_LOCK_TIMEOUT_MS, sku=sku)}ms"


def _sold(
    requests: list[dict[str, Any]], placed: dict[str, int], at: datetime, levels: str | None
) -> list[Written]:
    """The answers of a batch the set-based statement sold whole (`placed`: order id by
    public id; `levels`: the rows it wrote, as JSON [[sale, index, stock, version], ...]).
    A request for a lock holder (`"levels": true`) is also answered its rows' levels and
    versions after the batch, for the holder's hints."""
    rows = (
        {(sale, index): (left, version) for sale, index, left, version in json.loads(levels)}
        if levels and any(request.get("levels") for request in requests)
        else {}
    )
    answers = []
    for request in requests:
        # PostgreSQL spells a uuid in lower case; a request may have spelt it otherwise.
        order_id = placed.get(request["public_id"]) or placed[str(uuid.UUID(request["public_id"]))]
        answers.append(
            Written(
                Outcome.SOLD,
                order_id,
                at,
                {int(index): rows[request["sale"], int(index)] for index in request["rows"]}
                if request.get("levels")
                else None,
            )
        )
    return answers


def _sell_one_by_one(requests: list[dict[str, Any]], at: datetime, wait: str) -> list[Written]:
    """The batch written a request at a time (`inventory_sell_batch`), each with its own
    answer: after the set-based statement refused it whole. Its locks are taken in the set-based
    statement's order: every stock row first, by (sale, index), then the requests by (sale,
    buyer), so that a batch in flight beside it never waits for it while it waits for that."""
    order = sorted(range(len(requests)), key=lambda i: (requests[i]["sale"], requests[i]["buyer"]))
    parameters = _batch_parameters([requests[i] for i in order], at, wait)
    database = connections[DEFAULT_DB_ALIAS]
    inside = database.in_atomic_block
    backend = None  # until the statement is sent
    try:
        with transaction.atomic() if inside else nullcontext(), prepared_cursor() as cursor:
            backend = database.connection.info.backend_pid
            cursor.execute(_ONE_BY_ONE_SQL, parameters)
            rows = cursor.fetchall()
    except DatabaseError as exc:
        if backend is not None and not inside and connection_lost(database):
            return _resolve_each(requests, backend, at)
        if getattr(exc.__cause__, "sqlstate", None) in (
            LOCK_NOT_AVAILABLE_SQLSTATE,
            QUERY_CANCELED_SQLSTATE,
        ):
            raise RowLockTimeout(str(exc.__cause__)) from None
        raise
    answers: list[Written] = [Written(Outcome.RESTARTED, None, at)] * len(requests)
    for n, order_id, outcome in rows:
        answers[order[n - 1]] = Written(Outcome(outcome), order_id, at)
    return answers


def _resolve_each(
    requests: list[dict[str, Any]], backend: int | None, at: datetime
) -> list[Written]:
    """`_sell_one_by_one`'s answers when its connection was lost: the orders found are sold;
    the rest were refused for a reason the lost answer held, answered SHORT (the caller
    rebuilds its counters from the database and tries again: nothing was written for them)."""
    placed = _resolve([request["public_id"] for request in requests], backend)
    return [
        Written(Outcome.SOLD, placed[request["public_id"]], at)
        if request["public_id"] in placed
        else Written(Outcome.SHORT, None, at)
        for request in requests
    ]


# `inventory_sell_batch` locks each request's rows as it writes it; the stock rows of the whole
# batch are locked first here, in lock order (the uncorrelated condition on `locked` is checked
# once, before the function runs), after the lock wait is bounded as the function bounds it.
_ONE_BY_ONE_SQL = f"""WITH bound AS MATERIALIZED (
    SELECT set_config('lock_timeout', %(wait)s::text, true)
),
locked AS MATERIALIZED (
    SELECT row.id
    FROM {StockShard._meta.db_table} row
    JOIN unnest(%(sales)s::bigint[], %(indexes)s::integer[]) AS needed (sale, index)
      ON row.sale_id = needed.sale AND row.index = needed.index
    WHERE row.sale_id = ANY(%(sales)s::bigint[]) AND EXISTS (SELECT 1 FROM bound)
    ORDER BY row.sale_id, row.index
    FOR NO KEY UPDATE OF row
)
SELECT n, order_id, outcome FROM inventory_sell_batch(%(batch)s::jsonb, %(at)s, %(wait)s)
WHERE (SELECT count(*) FROM locked) >= 0
"""


#: What makes the set-based statement refuse a whole batch: a row short or a sale restarted
#: (HALF_DONE_SQLSTATE), an idempotency key taken, a buyer's allowance exceeded.
_REFUSED_SQLSTATES = frozenset({"FS001", "23505", "23514"})
#: What the refusal of a batch of one says of its one sale, where it says it for sure (a row
#: short and a sale restarted raise the same FS001).
_ONE_REFUSED = {"23505": Outcome.DUPLICATE, "23514": Outcome.LIMIT}


#: How the batch statement's JSON is written: without spaces, keys that are not strings written
#: as strings (as `json.dumps` does). orjson's: the standard library's encoder costs five times
#: what orjson's does (3.4 us against 0.4 for a buyer's request, 2026-11-28).
JSON_OPTIONS = orjson.OPT_NON_STR_KEYS


def compact_json(value: Any) -> str:
    return orjson.dumps(value, option=JSON_OPTIONS).decode()


def _batch_parameters(requests: list[dict[str, Any]], at: datetime, wait: str) -> dict[str, Any]:
    """`_BATCH_SQL`'s parameters: the batch as one JSON array, and the stock rows it takes
    from, each once with the units the batch takes from it, in lock order (sale, index), and
    the lowest and highest fencing token its requests hold for it (None: written under no
    lock). A row takes the lowest as its guard and keeps the highest: as if the requests were
    written one after another, in the order of their tokens."""
    needed: dict[tuple[int, int, int], int] = {}
    fences: dict[tuple[int, int, int], list[int]] = {}
    for request in requests:
        if not request.get("public_id"):
            request["public_id"] = str(new_public_id())
        sale, item = request["sale"], request["item"]
        held = request.get("fences") or {}
        for index, units in request["rows"].items():
            row = (sale, int(index), item)
            needed[row] = needed.get(row, 0) + units
            if index in held:
                fences.setdefault(row, []).append(held[index])
    rows = sorted(needed)
    return {
        "batch": compact_json(requests),
        "at": at,
        "wait": wait,
        "sales": [sale for sale, _, _ in rows],
        "indexes": [index for _, index, _ in rows],
        "items": [item for _, _, item in rows],
        "units": [needed[row] for row in rows],
        "fences": [min(fences[row]) if row in fences else None for row in rows],
        "top_fences": [max(fences[row]) if row in fences else None for row in rows],
    }


# The batch arrives as one JSON array (cheaper to build than an array parameter per column,
# and PostgreSQL reads it in C), the stock rows it takes from as arrays in lock order, each row
# once. Lock order: the stock rows are locked first, in (sale, index) order, as every other
# writer of several rows locks them; the UPDATE then finds them locked by its own transaction.
# The rows are found through the (sale, index) index among the batch's sales' rows only, not by
# hashing the table: the table holds every sale's rows, and its planner estimates would
# otherwise pick a scan of all of them (0.2-0.5 ms a statement at a few thousand rows, growing
# with every sale). A row that holds too few units, or belongs to a sale that is no longer
# current, is not taken: the count check at the end (`inventory_all_or_nothing(taken + 1,
# needed + 1)`, which raises FS001 unless the two are equal) aborts the statement, as does a
# taken idempotency key (unique violation) or an allowance past its limit (check violation),
# and nothing of the batch is written. Batches of several web processes may be in flight at
# once: each takes its locks in one order, the stock rows by (sale, index), then the buyers'
# allowances by (sale, buyer), then the orders' idempotency keys by key, so that one may wait
# for the other's commit but never both for each other.
_BATCH_SQL = f"""WITH bound AS MATERIALIZED (
    SELECT set_config('lock_timeout', %(wait)s::text, true)
),
needed AS (
    SELECT * FROM unnest(
        %(sales)s::bigint[], %(indexes)s::integer[], %(items)s::bigint[], %(units)s::integer[],
        %(fences)s::bigint[], %(top_fences)s::bigint[]
    ) AS needed (sale, index, item, units, fence, top_fence)
),
locked AS MATERIALIZED (
    SELECT row.id, needed.units, needed.fence, needed.top_fence
    FROM {StockShard._meta.db_table} row
    JOIN needed ON row.sale_id = needed.sale AND row.index = needed.index
    WHERE row.sale_id = ANY(%(sales)s::bigint[])
      AND EXISTS (SELECT 1 FROM bound)
      AND EXISTS (
          SELECT 1 FROM {Item._meta.db_table} item
          WHERE item.id = needed.item AND item.current_sale_id = needed.sale
      )
    ORDER BY row.sale_id, row.index
    FOR NO KEY UPDATE OF row
),
taken AS (
    UPDATE {StockShard._meta.db_table} row
    SET stock = row.stock - locked.units, version = row.version + 1,
        fence = coalesce(locked.top_fence, row.fence)
    FROM locked
    WHERE row.id = locked.id AND row.stock >= locked.units
      AND (locked.fence IS NULL OR row.fence <= locked.fence)
      AND row.sale_id = ANY(%(sales)s::bigint[])
    RETURNING row.sale_id, row.index, row.stock, row.version
),
request AS MATERIALIZED (
    SELECT * FROM jsonb_to_recordset(%(batch)s::jsonb) AS r (
        item bigint, sale bigint, qty integer, buyer text, key text, "limit" integer,
        served_by text, fallback boolean, public_id uuid, rows jsonb
    )
),
allowance AS (
    INSERT INTO {BuyerAllowance._meta.db_table} (item_id, sale_id, buyer, units, unit_limit)
    SELECT item, sale, buyer, sum(qty), min("limit")
    FROM request WHERE "limit" IS NOT NULL
    GROUP BY item, sale, buyer
    ORDER BY sale, buyer
    ON CONFLICT (sale_id, buyer)
    DO UPDATE SET units = {BuyerAllowance._meta.db_table}.units + EXCLUDED.units
),
placed AS (
    INSERT INTO {Order._meta.db_table} (
        public_id, item_id, sale_id, buyer, qty, status, idempotency_key, served_by, fallback,
        shard_units, created_at, updated_at
    )
    SELECT public_id, item, sale, buyer, qty, 'pending', key, served_by, fallback, rows,
           %(at)s::timestamptz, %(at)s::timestamptz
    FROM request
    ORDER BY key
    RETURNING public_id, id
)
SELECT public_id::text, id,
    (SELECT json_agg(json_build_array(sale_id, index, stock, version)) FROM taken)::text
FROM placed
WHERE inventory_all_or_nothing(
    (SELECT count(*) FROM taken)::integer + 1, cardinality(%(indexes)s::integer[]) + 1
)
"""


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

    def request(self, *, served_by: str) -> dict[str, Any]:
        """The sale as `sell_batch` takes it, less its `rows`."""
        return {
            "public_id": str(new_public_id()),
            "item": self.item.pk,
            "sale": self.item.current_sale_id,
            "qty": self.qty,
            "buyer": self.buyer,
            "key": self.idempotency_key or None,
            "limit": self.limit,
            "served_by": served_by,
            "fallback": self.fallback,
        }

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


def checked_connection(database: Any = None) -> BaseDatabaseWrapper:
    """`database` (a Django database wrapper; the thread's default one unless given), connected,
    its connection replaced first if the server has closed it (a restart, a failover,
    `pg_terminate_backend`, an idle timeout), so that no statement is sent on a dead one.

    Django checks a reused connection once, at the start of a request or task
    (CONN_HEALTH_CHECKS); one terminated later (mid-request, between a batch's statements, in
    a thread that serves none) would go unchecked. So it is checked before each statement sent
    outside a transaction: a look at its socket, no round trip (`shop.postgresql`). Inside one
    it is never replaced (the transaction would be lost with it).
    """
    # once: each `connection.x` is a thread-local lookup
    wrapper: BaseDatabaseWrapper = database or connections[DEFAULT_DB_ALIAS]
    if wrapper.autocommit and not wrapper.in_atomic_block:
        wrapper.health_check_done = False  # type: ignore[attr-defined]  # (not in the stubs)
    wrapper.close_if_health_check_failed()
    wrapper.ensure_connection()
    return wrapper


class _PreparingCursor(psycopg.Cursor):
    """A server-side binding cursor whose statements are prepared on their first execution."""

    def execute(self, query, params=None, *, prepare=True, binary=None):
        return super().execute(query, params, prepare=prepare, binary=binary)


def prepared_cursor(database: Any = None) -> Any:
    """A Django cursor (error wrapping, debug log, execute wrappers) that prepares statements.

    For the statements every checkout runs (reading the item, the sale statement): prepared
    once per connection, PostgreSQL skips parsing and planning them, about 40% of what a sale
    costs it. Django keeps prepared statements off by default for the sake of
    poolers in transaction mode: with `DJANGO_DB_PREPARED_STATEMENTS=false` the connection has
    no `prepare_threshold` and psycopg ignores `prepare=True`, so the same code runs unprepared.
    On `database` (a Django database wrapper) when given, else the thread's default connection.
    """
    wrapper = checked_connection(database)
    raw = _PreparingCursor(wrapper.connection)
    if wrapper.queries_logged:
        return _PreparedDebugWrapper(raw, wrapper)
    # make_cursor wraps any DB-API cursor (its stub names Django's own cursor type).
    return wrapper.make_cursor(raw)  # type: ignore[arg-type]


class _PreparedDebugWrapper(CursorDebugWrapper):
    """Django's debug cursor, logging the statement with its parameters filled in.

    Django reads the text of what ran back from the cursor, which a server-binding cursor does
    not keep: it would log None (in `connection.queries`, the debug toolbar, the SQL log).
    """

    def execute(self, sql, params=None):
        with self.debug_sql(self.db.ops.compose_sql(sql, params), params):
            return CursorWrapper.execute(self, sql, params)


#: Advisory-lock namespaces of the writer gates (the first key of PostgreSQL's two-key form;
#: the second names the row). Distinct values, should another program share the database.
GATE_ITEM_ROW = 0x46530001
GATE_STOCK_ROW = 0x46530002


def _gate(row: int, index: int | None = None) -> tuple[int, int]:
    """The advisory lock of a row's writer gate: the item row `row`, or stock row `index` of
    sale `row`. Two rows may share a gate (the key is 31 bits): that only makes one wait."""
    if index is None:
        return GATE_ITEM_ROW, row & 0x7FFFFFFF
    return GATE_STOCK_ROW, ((row << 10) ^ index) & 0x7FFFFFFF


def wait_for_gates(item: Item) -> None:
    """Take the writer gates of every row `item`'s current sale sells from (its stock rows in
    index order, else the item row), waiting for each at most FLASHSALE_ROW_LOCK_TIMEOUT_MS
    (then RowLockTimeout). Call inside a transaction: they are held until it ends, and its
    gated sale statements find them held already."""
    if item.shard_count:
        sale = item.current_sale_id or 0
        gates = [_gate(sale, index) for index in range(item.shard_count)]
    else:
        gates = [_gate(item.pk)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SET LOCAL lock_timeout = '{int(settings.FLASHSALE_ROW_LOCK_TIMEOUT_MS)}ms'"
        )
        try:
            for namespace, key in gates:
                cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [namespace, key])
        except OperationalError as exc:
            raise RowLockTimeout(str(exc)) from exc


@cache
def _sale_sql(
    shard_count: int,
    *,
    absolute: bool,
    versioned: bool,
    limited: bool,
    fenced: bool,
    gated: bool = False,
) -> str:
    """The text of the sale statement for one shape of sale (built once per shape)."""
    # Bounds every row-lock wait of this statement (and of the transaction it is part of): the
    # setting is made by a one-time filter of each UPDATE, before it scans, so before any wait.
    ctes = ["bound AS MATERIALIZED (SELECT set_config('lock_timeout', %(lock_timeout)s, true))"]
    bounded = " AND EXISTS (SELECT 1 FROM bound)"
    if gated:
        # Each row's gate is tried (never waited for) by a one-time filter of its UPDATE,
        # before the row is scanned, so before any wait on the row.
        if shard_count:
            ctes += [
                f"g{n} AS MATERIALIZED (SELECT pg_try_advisory_xact_lock("
                f"{GATE_STOCK_ROW}, %(sg{n})s) AS held)"
                for n in range(shard_count)
            ]
        else:
            ctes.append(
                f"gate AS MATERIALIZED (SELECT pg_try_advisory_xact_lock({GATE_ITEM_ROW}, "
                "%(gate)s) AS held)"
            )
            bounded += " AND (SELECT held FROM gate)"
    # Stock rows: the item row is read (is the sale still current?), never written; a plain
    # read takes no row lock.
    current = (
        f" AND EXISTS (SELECT 1 FROM {_ITEM} WHERE id = %(item)s AND current_sale_id = %(sale)s)"
    )
    ctes += [
        f"s{n} AS (UPDATE {_SHARD} SET stock = stock - %(su{n})s, version = version + 1"
        + (f", fence = %(sf{n})s" if fenced else "")
        + f" WHERE sale_id = %(sale)s AND index = %(si{n})s AND stock >= %(su{n})s{bounded}"
        + (f" AND (SELECT held FROM g{n})" if gated else "")
        + (f" AND fence <= %(sf{n})s" if fenced else "")
        + f"{current} RETURNING index, stock, version)"
        for n in range(shard_count)
    ]
    if shard_count:
        taken = " AND ".join(f"EXISTS (SELECT 1 FROM s{n})" for n in range(shard_count))
        ctes.append(f"taken AS (SELECT NULL::integer AS stock WHERE {taken})")
    else:
        if absolute:
            assignment, guard = "stock = %(set_stock)s", bounded
        else:
            assignment, guard = "stock = stock - %(qty)s", f" AND stock >= %(qty)s{bounded}"
        if versioned:
            guard += " AND version = %(version)s"
        if fenced:
            assignment += ", fence = %(fence)s"
            guard += " AND fence <= %(fence)s"
        ctes.append(
            f"taken AS (UPDATE {_ITEM} SET {assignment}, version = version + 1"
            f" WHERE id = %(item)s AND current_sale_id = %(sale)s{guard} RETURNING stock)"
        )
    if limited:
        ctes.append(
            f"allowance AS (INSERT INTO {_ALLOWANCE} (item_id, sale_id, buyer, units, unit_limit)"
            " SELECT %(item)s, %(sale)s, %(buyer)s, %(qty)s, %(limit)s FROM taken"
            f" ON CONFLICT (sale_id, buyer) DO UPDATE SET units = {_ALLOWANCE}.units"
            " + EXCLUDED.units)"
        )
    ctes.append(
        f"placed AS (INSERT INTO {_ORDER} (public_id, item_id, sale_id, buyer, qty, status,"
        " idempotency_key, served_by, fallback, shard_units, created_at, updated_at)"
        " SELECT %(public_id)s, %(item)s, %(sale)s, %(buyer)s, %(qty)s, 'pending', %(key)s,"
        " %(served_by)s, %(fallback)s, %(shard_units)s::jsonb, %(now)s, %(now)s FROM taken"
        " RETURNING id)"
    )
    columns = [
        "(SELECT id FROM placed)",
        "(SELECT stock FROM taken)",
        f"(SELECT current_sale_id FROM {_ITEM} WHERE id = %(item)s)",
    ]
    if fenced and not shard_count:
        columns.append(f"(SELECT fence FROM {_ITEM} WHERE id = %(item)s)")
    if shard_count:
        levels = " UNION ALL ".join(
            f"SELECT index, stock, version FROM s{n}" for n in range(shard_count)
        )
        parts = " + ".join(
            ["(SELECT count(*) FROM taken)"]
            + [f"(SELECT count(*) FROM s{n})" for n in range(shard_count)]
        )
        columns.append(
            "(SELECT json_object_agg(index, json_build_array(stock, version))"
            f" FROM ({levels}) AS levels)"
        )
        columns.append(f"inventory_all_or_nothing(({parts})::int, {shard_count + 1})")
    return f"WITH {', '.join(ctes)} SELECT {', '.join(columns)}"


_ITEM = Item._meta.db_table
_SHARD = StockShard._meta.db_table
_ORDER = Order._meta.db_table
_ALLOWANCE = BuyerAllowance._meta.db_table


def return_units(order: Order) -> None:
    """Put a failed or expired order's units back (`return_units_of`, for one order)."""
    return_units_of([order])


def return_units_of(orders: Iterable[Order]) -> None:
    """Put failed or expired orders' units back where their sales took them from, and take them
    off their buyers' allowances. Call once per order, in the transaction that moves it to
    failed or expired.

    Units taken from stock rows go back to those rows (they belong to the order's sale alone).
    Units taken from the item row go back only while the order's sale is still the item's
    current one: a restarted sale set the row afresh, and the old sale's units are not its own.

    Rows are written in the lock order of every writer: the stock rows by (sale, index), then
    the item rows, then the allowances by (sale, buyer), each once however many of the orders
    took from it; a batch of sales writing the same rows meanwhile waits for this transaction,
    or this for it, never both for each other.
    """
    rows: dict[tuple[int, int], int] = {}
    items: dict[tuple[int, int], int] = {}
    allowances: dict[tuple[int, str], int] = {}
    for order in orders:
        for index, units in (order.shard_units or {}).items():
            key = (order.sale_id, int(index))
            rows[key] = rows.get(key, 0) + units
        if not order.shard_units:
            key = (order.item_id, order.sale_id)
            items[key] = items.get(key, 0) + order.qty
        owed = (order.sale_id, order.buyer)
        allowances[owed] = allowances.get(owed, 0) + order.qty
    for (sale_id, index), units in sorted(rows.items()):
        StockShard.objects.filter(sale_id=sale_id, index=index).update(
            stock=F("stock") + units, version=F("version") + 1
        )
    for (item_id, sale_id), units in sorted(items.items()):
        Item.objects.filter(pk=item_id, current_sale_id=sale_id).update(
            stock=F("stock") + units, version=F("version") + 1
        )
    for (sale_id, buyer), units in sorted(allowances.items()):
        BuyerAllowance.objects.filter(sale_id=sale_id, buyer=buyer).update(units=F("units") - units)


def set_shard_stock(sale_id: int, index: int, units: int) -> None:
    StockShard.objects.filter(sale_id=sale_id, index=index).update(
        stock=units, version=F("version") + 1
    )


def ensure_current(item: Item) -> None:
    """Raise SaleRestarted unless item's sale is still its current one."""
    if not Item.objects.filter(pk=item.pk, current_sale_id=item.current_sale_id).exists():
        raise SaleRestarted(f"{item.sku}: sale {item.current_sale_id} is over")


def shard_stocks(sale_id: int | None, *, for_update: bool = False) -> dict[int, int]:
    """Units on each stock row of a sale; `for_update` locks them, in index order. No sale,
    no rows."""
    if sale_id is None:
        return {}
    shards = StockShard.objects.filter(sale_id=sale_id).order_by("index")
    if for_update:
        shards = shards.select_for_update()
    return dict(shards.values_list("index", "stock"))


def shard_rows(sale_id: int | None, indexes: Iterable[int] | None = None) -> dict[int, StockRow]:
    """Units and version of each stock row of a sale (of those in `indexes`, when given)."""
    if sale_id is None:
        return {}
    shards = StockShard.objects.filter(sale_id=sale_id)
    if indexes is not None:
        shards = shards.filter(index__in=list(indexes))
    return {
        index: StockRow(stock=stock, version=version)
        for index, stock, version in shards.values_list("index", "stock", "version")
    }


def plan_rows(levels: dict[int, int], qty: int) -> dict[int, int]:
    """Units to take per stock row for qty: from one row that holds them all when one does
    (picked at random, to spread buyers over the rows), else from several in index order.
    The caller checked that the rows hold qty between them."""
    whole = [index for index, units in levels.items() if units >= qty]
    if whole:
        return {random.choice(whole): qty}
    plan: dict[int, int] = {}
    needed = qty
    for index in sorted(levels):
        if needed and levels[index] > 0:
            plan[index] = min(levels[index], needed)
            needed -= plan[index]
    return plan


def split_stock(total: int, shard_count: int) -> list[int]:
    """Split total units over shard_count shards as evenly as possible, the first ones larger."""
    base, extra = divmod(total, shard_count)
    return [base + (1 if index < extra else 0) for index in range(shard_count)]


_BACKOFF_BASE_SECONDS = 0.001
_BACKOFF_CAP_SECONDS = 0.025


def back_off(attempt: int) -> None:
    """Sleep a random, growing while (full jitter) before retrying a write that lost a race."""
    time.sleep(random.uniform(0, min(_BACKOFF_CAP_SECONDS, _BACKOFF_BASE_SECONDS * 2**attempt)))


def simulate_work() -> None:
    """Sleep FLASHSALE_HOLD_DELAY_MS inside a critical section, to make races and expiry visible."""
    if settings.FLASHSALE_HOLD_DELAY_MS > 0:
        time.sleep(settings.FLASHSALE_HOLD_DELAY_MS / 1000)
