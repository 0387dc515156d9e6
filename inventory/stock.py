"""Guarded stock writes on the system of record, shared by every strategy.

Every decrement here is a conditional UPDATE (`stock >= qty`, and a version check where the
caller read one), so a write made on stale information changes nothing instead of overselling.
Transactions that touch an item lock its row first and its shards after, in index order, so two
of them can never deadlock.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import OperationalError, connection
from django.db.models import F

from .models import BuyerAllowance, Item, Order, StockShard


@dataclass(frozen=True)
class StockRow:
    stock: int
    version: int


def read_stock(item_id: int) -> StockRow:
    stock, version = Item.objects.values_list("stock", "version").get(pk=item_id)
    return StockRow(stock=stock, version=version)


class RowLockTimeout(Exception):
    """The item row stayed locked longer than FLASHSALE_ROW_LOCK_TIMEOUT_MS."""


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


def take_item_units(item_id: int, qty: int, *, expected_version: int | None = None) -> bool:
    """Take qty units off the item if it has them (and is still at `expected_version`)."""
    rows = Item.objects.filter(pk=item_id, stock__gte=qty)
    if expected_version is not None:
        rows = rows.filter(version=expected_version)
    return rows.update(stock=F("stock") - qty, version=F("version") + 1) == 1


def take_shard_units(item_id: int, index: int, qty: int) -> int | None:
    """Take qty units off one shard if it has them; return the shard's new stock, else None."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {StockShard._meta.db_table} SET stock = stock - %s, version = version + 1"
            " WHERE item_id = %s AND index = %s AND stock >= %s RETURNING stock",
            [qty, item_id, index, qty],
        )
        row = cursor.fetchone()
    return None if row is None else row[0]


def take_from_shards(item_id: int, qty: int) -> dict[int, int]:
    """Take qty units from an item's shards, lowest index first; return units per shard.

    Call inside the transaction that has just taken the same units off the item row: shards add
    up to the item's stock, so they hold enough.
    """
    plan: dict[int, int] = {}
    needed = qty
    shards = StockShard.objects.select_for_update().filter(item_id=item_id, stock__gt=0)
    for index, stock in shards.order_by("index").values_list("index", "stock"):
        if needed == 0:
            break
        units = min(stock, needed)
        plan[index] = units
        needed -= units
    if needed:
        raise RuntimeError(f"item {item_id}: shards hold fewer units than the item row")
    for index, units in plan.items():
        StockShard.objects.filter(item_id=item_id, index=index).update(
            stock=F("stock") - units, version=F("version") + 1
        )
    return plan


def return_units(order: Order) -> None:
    """Put a failed or expired order's units back on its item, its shards and its buyer's
    allowance. Call once, in the transaction that moves the order to failed or expired."""
    Item.objects.filter(pk=order.item_id).update(
        stock=F("stock") + order.qty, version=F("version") + 1
    )
    for index, units in sorted((int(i), u) for i, u in (order.shard_units or {}).items()):
        StockShard.objects.filter(item_id=order.item_id, index=index).update(
            stock=F("stock") + units, version=F("version") + 1
        )
    BuyerAllowance.objects.filter(item_id=order.item_id, buyer=order.buyer).update(
        units=F("units") - order.qty
    )


def set_shard_stock(item_id: int, index: int, units: int) -> None:
    StockShard.objects.filter(item_id=item_id, index=index).update(
        stock=units, version=F("version") + 1
    )


def shard_stocks(item_id: int) -> dict[int, int]:
    return dict(StockShard.objects.filter(item_id=item_id).values_list("index", "stock"))


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
