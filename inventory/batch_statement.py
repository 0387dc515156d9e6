"""The batch statement: many checkouts' sales from stock rows in one statement and one commit
(group commit), each its own sale with its own guards, as `inventory.sale_statement` writes one.

The batch is first written whole by one set-based statement (`_BATCH_SQL`), which sells every
request or none; only when one is refused is it written again a request at a time
(`inventory_sell_batch`, migration 0006), to tell each its own answer. Lock order: stock rows
by (sale, index), then allowances by (sale, buyer), then idempotency keys, so batches of
several processes in flight at once never wait for each other both ways. Decision record:
docs/decisions/0001-group-commit-in-the-web-process.md.
"""

from __future__ import annotations

import json
import uuid
from contextlib import nullcontext
from datetime import datetime
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, transaction
from django.utils import timezone

from . import deadline
from .fastpath import DirectStatement, compact_json, prepared_cursor
from .lost_connection import checked_connection, connection_lost, resolve
from .models import BuyerAllowance, Item, Order, StockShard, new_public_id
from .row_locks import row_lock_wait
from .sale_values import WAITED_TOO_LONG, Outcome, SaleRequest, SqlState, Written, waited_too_long


def sell_batch(requests: list[SaleRequest]) -> list[Written]:
    """Write many checkouts' sales from stock rows in one statement and one commit; one answer
    per request, in order.

    Each request is what `SaleRecorder.request` builds. Each is its own sale with its own
    guards: a refusal writes nothing for that request and never undoes the others. A lock
    holder's request (`segmented`'s, with `fences`) is refused by a row that has accepted a
    later token; its `SOLD` answer carries its rows' levels after the batch, and when the batch
    is refused it is answered `AGAIN`, written nowhere: its holder writes it itself. Raises
    RowLockTimeout when a row stayed locked by another transaction past
    ROW_LOCK_TIMEOUT_MS or the checkout's deadline (then nothing of the batch is
    written). Outside a transaction it commits on return; inside one, its sales are part of
    that transaction (a refusal rolls back to a savepoint of its own).

    A refusal is rare where Redis decides who gets a unit, and the set-based statement costs
    PostgreSQL a third to a half less per sale than a subtransaction per request.

    When the connection is lost before the answer (the database restarted, the connection
    killed), the commit may or may not have happened: the sales are looked up by their public
    ids on a new connection (`lost_connection.resolve`), and answered as found; NotWritten
    when none is, OutcomeUnknown when the database does not answer.
    """
    at = timezone.now()
    wait = row_lock_wait("the batch")
    database = connections[DEFAULT_DB_ALIAS]
    inside = database.in_atomic_block
    backend = None  # until the statement is sent
    try:
        # Inside a caller's transaction, a savepoint keeps it usable after a refusal.
        with transaction.atomic() if inside else nullcontext():
            backend = checked_connection(database).connection.info.backend_pid
            found = _BATCH.rows(_batch_parameters(requests, at, wait), database)
    except DatabaseError as exc:
        if backend is not None and not inside and connection_lost(database):
            # One statement commits all of its orders or none.
            placed = resolve([request["public_id"] for request in requests], backend)
            return [Written(Outcome.SOLD, placed[request["public_id"]], at) for request in requests]
        answers = _after_refusal(
            getattr(exc.__cause__, "sqlstate", None), str(exc.__cause__), requests, at, wait
        )
        if answers is None:
            raise
        return answers
    placed = {public_id: order_id for public_id, order_id, _, _ in found}
    return _sold(requests, placed, at, found[0][2] if found else None)


def _held(request: SaleRequest) -> bool:
    """Whether the request is a lock holder's (fenced, answered its rows' levels)."""
    return "fences" in request


def _after_refusal(
    sqlstate: str | None,
    message: str,
    requests: list[SaleRequest],
    at: datetime,
    wait: str,
) -> list[Written] | None:
    """When the set-based statement failed with `sqlstate`: the batch written again a request
    at a time if it was refused, RowLockTimeout if a row stayed locked (RanPastDeadline if
    the statement ran past the deadline), None for any other error (the caller's to raise)."""
    if sqlstate in WAITED_TOO_LONG:
        raise waited_too_long(sqlstate, message)
    if sqlstate not in _REFUSED:
        return None
    if len(requests) == 1 and not _held(requests[0]) and sqlstate in _ONE_REFUSED:
        # A batch of one: the refusal names its reason, no need to write it again to learn it.
        return [Written(_ONE_REFUSED[sqlstate], None, at)]
    # A lock holder's request (fenced, answered its levels) is answered `AGAIN`: its holder
    # writes it on its own (`sell`), which tells a short row from a refused token.
    others = [request for request in requests if not _held(request)]
    answers = iter(_sell_one_by_one(others, at, wait) if others else [])
    return [
        Written(Outcome.AGAIN, None, at) if _held(request) else next(answers)
        for request in requests
    ]


#: What makes the set-based statement refuse a whole batch: a row short or a sale restarted
#: (HALF_DONE), an idempotency key taken, a buyer's allowance exceeded.
_REFUSED = frozenset({SqlState.HALF_DONE, SqlState.UNIQUE_VIOLATION, SqlState.CHECK_VIOLATION})
#: What the refusal of a batch of one says of its one sale, where it says it for sure (a row
#: short and a sale restarted raise the same HALF_DONE).
_ONE_REFUSED: dict[str, Outcome] = {
    SqlState.UNIQUE_VIOLATION: Outcome.DUPLICATE,
    SqlState.CHECK_VIOLATION: Outcome.LIMIT,
}


def _sold(
    requests: list[SaleRequest], placed: dict[str, int], at: datetime, levels: str | None
) -> list[Written]:
    """The answers of a batch the set-based statement sold whole (`placed`: order id by
    public id; `levels`: the rows it wrote, as JSON [[sale, index, stock, version], ...]).
    A lock holder's request is also answered its rows' levels and versions after the batch,
    for the holder's hints."""
    rows = (
        {(sale, index): (left, version) for sale, index, left, version in json.loads(levels)}
        if levels and any(_held(request) for request in requests)
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
                if _held(request)
                else None,
            )
        )
    return answers


def _sell_one_by_one(requests: list[SaleRequest], at: datetime, wait: str) -> list[Written]:
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
        sqlstate = getattr(exc.__cause__, "sqlstate", None)
        if sqlstate in WAITED_TOO_LONG:
            raise waited_too_long(sqlstate, str(exc.__cause__)) from None
        raise
    answers: list[Written] = [Written(Outcome.RESTARTED, None, at)] * len(requests)
    for n, order_id, outcome, _ in rows:
        answers[order[n - 1]] = Written(Outcome(outcome), order_id, at)
    return answers


def _resolve_each(requests: list[SaleRequest], backend: int | None, at: datetime) -> list[Written]:
    """`_sell_one_by_one`'s answers when its connection was lost: the orders found are sold;
    the rest were refused for a reason the lost answer held, answered SHORT (the caller
    rebuilds its counters from the database and tries again: nothing was written for them)."""
    placed = resolve([request["public_id"] for request in requests], backend)
    return [
        Written(Outcome.SOLD, placed[request["public_id"]], at)
        if request["public_id"] in placed
        else Written(Outcome.SHORT, None, at)
        for request in requests
    ]


def _batch_parameters(requests: list[SaleRequest], at: datetime, wait: str) -> dict[str, Any]:
    """`_BATCH_SQL`'s parameters: the batch as one JSON array, and the stock rows it takes
    from, each once with the units the batch takes from it, in lock order (sale, index), and
    the lowest and highest fencing token its requests hold for it (None: written under no
    lock). A row takes the lowest as its guard and keeps the highest: as if the requests were
    written one after another, in the order of their tokens. A request without a public id is
    given one."""
    needed: dict[tuple[int | None, int, int], int] = {}
    fences: dict[tuple[int | None, int, int], list[int]] = {}
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
        "until": deadline.time_of_day(),
        "sales": [sale for sale, _, _ in rows],
        "indexes": [index for _, index, _ in rows],
        "items": [item for _, _, item in rows],
        "units": [needed[row] for row in rows],
        "fences": [min(fences[row]) if row in fences else None for row in rows],
        "top_fences": [max(fences[row]) if row in fences else None for row in rows],
    }


# `inventory_sell_batch` locks each request's rows as it writes it; the stock rows of the whole
# batch are locked first here, in lock order (the uncorrelated condition on `locked` is checked
# once, before the function runs), after the lock wait is bounded as the function bounds it.
# The deadline is checked once the function has written every request (`_BATCH_SQL`, below).
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
SELECT n, order_id, outcome, inventory_in_time(%(until)s::timestamptz)
FROM inventory_sell_batch(%(batch)s::jsonb, %(at)s, %(wait)s)
WHERE (SELECT count(*) FROM locked) >= 0
"""


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
# and nothing of the batch is written; so does the deadline of its earliest checkout, passed
# by the database's clock once each order row is written (`inventory_in_time`, FS002: the
# database held the statement).
# Batches of several web processes may be in flight at once: each takes its locks in one
# order, the stock rows by (sale, index), then the buyers' allowances by (sale, buyer), then
# the orders' idempotency keys by key, so that one may wait for the other's commit but never
# both for each other.
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
    (SELECT json_agg(json_build_array(sale_id, index, stock, version)) FROM taken)::text,
    inventory_in_time(%(until)s::timestamptz)
FROM placed
WHERE inventory_all_or_nothing(
    (SELECT count(*) FROM taken)::integer + 1, cardinality(%(indexes)s::integer[]) + 1
)
"""
_BATCH = DirectStatement(_BATCH_SQL)
