"""The sale statement's text (`inventory.sale_statement`), one per shape of sale: a chain of
steps (CTEs) that PostgreSQL runs in order, then one row of answers.

Every write hangs on the step `taken`: when a guard refuses, nothing after it is written, and
when a refusal comes after some stock rows were decremented, `inventory_all_or_nothing`
(migration 0004) aborts the statement. Each row-lock wait is bounded before the first UPDATE
scans (`bound`), and a gated writer's gates are tried before it (`g<n>`, `gate`). Design:
docs/design.md#the-sale-statement.
"""

from __future__ import annotations

from typing import NamedTuple

from .fastpath import built_once_per_shape
from .models import BuyerAllowance, Item, Order, StockShard
from .row_locks import GATE_ITEM_ROW, GATE_STOCK_ROW


class Shape(NamedTuple):
    """The form of one sale statement: what it writes and which guards it has."""

    #: How many stock rows it takes from (0: it takes from the item row).
    rows: int
    #: It writes an absolute stock to the item row, unguarded (`Allocation.set_stock`).
    absolute: bool = False
    #: Its item-row decrement is guarded by the version the caller read.
    versioned: bool = False
    #: It counts the units in the buyer's allowance (a per-buyer limit).
    limited: bool = False
    #: Its rows refuse a lock's fencing token older than one they accepted, and record it.
    fenced: bool = False
    #: It tries each row's writer gate first.
    gated: bool = False


_ITEM = Item._meta.db_table
_SHARD = StockShard._meta.db_table
_ORDER = Order._meta.db_table
_ALLOWANCE = BuyerAllowance._meta.db_table


@built_once_per_shape
def sale_sql(shape: Shape) -> str:
    """The text of the sale statement of one shape: a chain of steps (CTEs), then one row of
    answers. For a sale of one stock row with a per-buyer limit, it reads:

        WITH bound AS MATERIALIZED (SELECT set_config('lock_timeout', %(lock_timeout)s, true)),
        s0 AS (UPDATE inventory_stockshard SET stock = stock - %(su0)s, version = version + 1
               WHERE sale_id = %(sale)s AND index = %(si0)s AND stock >= %(su0)s
                 AND EXISTS (SELECT 1 FROM bound)
                 AND EXISTS (SELECT 1 FROM inventory_item
                             WHERE id = %(item)s AND current_sale_id = %(sale)s)
               RETURNING index, stock, version),
        taken AS (SELECT NULL::integer AS stock WHERE EXISTS (SELECT 1 FROM s0)),
        allowance AS (INSERT INTO inventory_buyerallowance ... SELECT ... FROM taken
                      ON CONFLICT (sale_id, buyer) DO UPDATE SET units = units + EXCLUDED.units),
        placed AS (INSERT INTO inventory_order (...) SELECT ... FROM taken RETURNING id)
        SELECT (SELECT id FROM placed), (SELECT stock FROM taken),
               (SELECT current_sale_id FROM inventory_item WHERE id = %(item)s),
               (the row's level and version, as JSON),
               inventory_all_or_nothing((the steps that wrote a row)::int, 2),
               inventory_in_time(%(until)s::timestamptz)

    Every write hangs on `taken`: when a guard refuses, nothing after it is written.
    """
    steps = [_BOUND, *_gates(shape)]
    if shape.rows:
        steps += [_row_decrement(n, shape) for n in range(shape.rows)]
        taken = " AND ".join(f"EXISTS (SELECT 1 FROM s{n})" for n in range(shape.rows))
        steps.append(f"taken AS (SELECT NULL::integer AS stock WHERE {taken})")
    else:
        steps.append(_item_decrement(shape))
    if shape.limited:
        steps.append(_ALLOWANCE_STEP)
    steps.append(_PLACED_STEP)
    return f"WITH {', '.join(steps)} SELECT {', '.join(_answers(shape))}"


# Bounds every row-lock wait of this statement (and of the transaction it is part of): the
# setting is made by a one-time filter of each UPDATE (`_IS_BOUND`), before it scans, so
# before any wait.
_BOUND = "bound AS MATERIALIZED (SELECT set_config('lock_timeout', %(lock_timeout)s, true))"
_IS_BOUND = "EXISTS (SELECT 1 FROM bound)"
# The statement's last answer: its checkout's deadline not passed by the database's clock once
# it has written (`inventory_in_time`, migration 0017), else FS002 and nothing is written.
_IN_TIME = "inventory_in_time(%(until)s::timestamptz)"
# A stock row is taken only while its sale is the item's current one; a plain read of the item
# row takes no row lock.
_SALE_IS_CURRENT = (
    f"EXISTS (SELECT 1 FROM {_ITEM} WHERE id = %(item)s AND current_sale_id = %(sale)s)"
)


def _gates(shape: Shape) -> list[str]:
    """Each row's writer gate, tried (never waited for) by a one-time filter of its UPDATE,
    before the row is scanned, so before any wait on the row."""
    if not shape.gated:
        return []
    if shape.rows:
        return [
            f"g{n} AS MATERIALIZED (SELECT pg_try_advisory_xact_lock("
            f"{GATE_STOCK_ROW}, %(sg{n})s) AS held)"
            for n in range(shape.rows)
        ]
    return [
        f"gate AS MATERIALIZED (SELECT pg_try_advisory_xact_lock({GATE_ITEM_ROW}, "
        "%(gate)s) AS held)"
    ]


def _row_decrement(n: int, shape: Shape) -> str:
    """Step `s{n}`: the guarded decrement of the sale's n-th stock row to take from."""
    changes = [f"stock = stock - %(su{n})s", "version = version + 1"]
    guards = ["sale_id = %(sale)s", f"index = %(si{n})s", f"stock >= %(su{n})s", _IS_BOUND]
    if shape.fenced:
        changes.append(f"fence = %(sf{n})s")
    if shape.gated:
        guards.append(f"(SELECT held FROM g{n})")
    if shape.fenced:
        guards.append(f"fence <= %(sf{n})s")
    guards.append(_SALE_IS_CURRENT)
    return (
        f"s{n} AS (UPDATE {_SHARD} SET {', '.join(changes)} WHERE {' AND '.join(guards)}"
        " RETURNING index, stock, version)"
    )


def _item_decrement(shape: Shape) -> str:
    """Step `taken`, for a sale from the item row: its guarded decrement (or absolute write)."""
    changes = ["stock = %(set_stock)s" if shape.absolute else "stock = stock - %(qty)s"]
    guards = ["id = %(item)s", "current_sale_id = %(sale)s"]
    if not shape.absolute:
        guards.append("stock >= %(qty)s")
    guards.append(_IS_BOUND)
    if shape.gated:
        guards.append("(SELECT held FROM gate)")
    if shape.versioned:
        guards.append("version = %(version)s")
    if shape.fenced:
        changes.append("fence = %(fence)s")
        guards.append("fence <= %(fence)s")
    changes.append("version = version + 1")
    return (
        f"taken AS (UPDATE {_ITEM} SET {', '.join(changes)} WHERE {' AND '.join(guards)}"
        " RETURNING stock)"
    )


_ALLOWANCE_STEP = (
    f"allowance AS (INSERT INTO {_ALLOWANCE} (item_id, sale_id, buyer, units, unit_limit)"
    " SELECT %(item)s, %(sale)s, %(buyer)s, %(qty)s, %(limit)s FROM taken"
    f" ON CONFLICT (sale_id, buyer) DO UPDATE SET units = {_ALLOWANCE}.units + EXCLUDED.units)"
)
_PLACED_STEP = (
    f"placed AS (INSERT INTO {_ORDER} (public_id, item_id, sale_id, buyer, qty, status,"
    " idempotency_key, served_by, fallback, shard_units, created_at, updated_at)"
    " SELECT %(public_id)s, %(item)s, %(sale)s, %(buyer)s, %(qty)s, 'pending', %(key)s,"
    " %(served_by)s, %(fallback)s, %(shard_units)s::jsonb, %(now)s, %(now)s FROM taken"
    " RETURNING id)"
)


def _answers(shape: Shape) -> list[str]:
    """The statement's row of answers: the order's id (NULL: refused), the item row's units
    left, the item's current sale; the item row's fence (fenced, from the item row), or each
    stock row's level and version; for stock rows, the all-or-nothing check (FS001 unless
    every row's step wrote its row); last, the deadline check (FS002 once it has passed)."""
    answers = [
        "(SELECT id FROM placed)",
        "(SELECT stock FROM taken)",
        f"(SELECT current_sale_id FROM {_ITEM} WHERE id = %(item)s)",
    ]
    if shape.fenced and not shape.rows:
        answers.append(f"(SELECT fence FROM {_ITEM} WHERE id = %(item)s)")
    if shape.rows:
        levels = " UNION ALL ".join(
            f"SELECT index, stock, version FROM s{n}" for n in range(shape.rows)
        )
        written = " + ".join(
            ["(SELECT count(*) FROM taken)"]
            + [f"(SELECT count(*) FROM s{n})" for n in range(shape.rows)]
        )
        answers.append(
            "(SELECT json_object_agg(index, json_build_array(stock, version))"
            f" FROM ({levels}) AS levels)"
        )
        answers.append(f"inventory_all_or_nothing(({written})::int, {shape.rows + 1})")
    answers.append(_IN_TIME)
    return answers
