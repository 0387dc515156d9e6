"""How a writer waits for a stock row: each wait bounded, and the writer gates.

A row-lock or gate wait never outlasts ROW_LOCK_TIMEOUT_MS, nor what is left of the
checkout's deadline (`row_lock_wait`); past it the statement raises RowLockTimeout and writes
nothing. A writer gate is a PostgreSQL advisory lock per row, held to the commit: the writers
that decide by no lock (`optimistic`, the fallback) try it before they write (never waiting:
the sale statement's `gated` form) so that at most one of their connections queues on a row;
after too many lost races they queue on the gates (`wait_for_gates`).
Lock order: stock rows in index order, then the item row. Decision record:
docs/decisions/0002-units-off-the-hot-row.md.
"""

from __future__ import annotations

from django.db import OperationalError, connection
from django.db.backends.utils import CursorWrapper

from . import deadline
from .models import Item
from .sale_values import RowLockTimeout, StockRow

#: Advisory-lock namespaces of the writer gates (the first key of PostgreSQL's two-key form;
#: the second names the row). Distinct values, should another program share the database
#: (`inventory.orders.RECONCILE_LOCK` is the next one).
GATE_ITEM_ROW = 0x46530001
GATE_STOCK_ROW = 0x46530002

#: The longest a writer waits for a stock row another transaction holds (ms): a row held
#: longer than a few seconds is held by something stuck, and the checkout's deadline (3 s by
#: default) cuts the wait shorter anyway.
ROW_LOCK_TIMEOUT_MS = 3000


def gate(row: int, index: int | None = None) -> tuple[int, int]:
    """The advisory lock of a row's writer gate: the item row `row`, or stock row `index` of
    sale `row`. Two rows may share a gate (the key is 31 bits): that only makes one wait."""
    if index is None:
        return GATE_ITEM_ROW, row & 0x7FFFFFFF
    return GATE_STOCK_ROW, ((row << 10) ^ index) & 0x7FFFFFFF


def row_lock_wait(sku: str) -> str:
    """How long a statement may wait for a row lock, as `lock_timeout` takes it:
    ROW_LOCK_TIMEOUT_MS, or what is left of the checkout's deadline if less (Busy
    when none is)."""
    return f"{deadline.wait_ms(ROW_LOCK_TIMEOUT_MS, sku=sku)}ms"


def _bound_lock_waits(cursor: CursorWrapper, sku: str) -> None:
    """The transaction's next lock wait: at most ROW_LOCK_TIMEOUT_MS, or what is left of the
    checkout's deadline (Busy when none is)."""
    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [row_lock_wait(sku)])


def lock_stock_row(item: Item) -> StockRow:
    """Read the item's stock holding its row lock until the transaction ends.

    Call inside a transaction. Waits at most ROW_LOCK_TIMEOUT_MS or what is left of the
    checkout's deadline, then raises RowLockTimeout (the transaction is then unusable: let it
    roll back).
    """
    with connection.cursor() as cursor:
        _bound_lock_waits(cursor, item.sku)
    try:
        stock, version = (
            Item.objects.select_for_update().values_list("stock", "version").get(pk=item.pk)
        )
    except OperationalError as exc:
        raise RowLockTimeout(str(exc)) from exc
    return StockRow(stock=stock, version=version)


def wait_for_gates(item: Item) -> None:
    """Take the writer gates of every row `item`'s current sale sells from (its stock rows in
    index order, else the item row), waiting for each at most ROW_LOCK_TIMEOUT_MS or what is
    left of the checkout's deadline (then RowLockTimeout). Call inside a transaction: they are
    held until it ends, and its gated sale statements find them held already."""
    if item.shard_count:
        sale = item.current_sale_id or 0
        gates = [gate(sale, index) for index in range(item.shard_count)]
    else:
        gates = [gate(item.pk)]
    with connection.cursor() as cursor:
        try:
            for namespace, key in gates:
                _bound_lock_waits(cursor, item.sku)
                cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [namespace, key])
        except OperationalError as exc:
            raise RowLockTimeout(str(exc)) from exc
