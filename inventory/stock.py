"""Stock rows outside the sale statement: reading them, planning a sale over them, giving
units back, and splitting a sale's stock over its rows.

Where an item's units live: an item sold by `segmented` or `lua` keeps them in stock rows
(`StockShard`, one set per sale: shards or stripes); every other item in its own row. Writes
here keep every writer's lock order: stock rows by (sale, index), then the item rows, then the
allowances; the reconciler locks a sale's rows before the item row, and nothing locks the item
row and then a stock row. The sale itself is written by `inventory.sale_statement` (one
checkout) and `inventory.batch_statement` (many). Decision record:
docs/decisions/0002-units-off-the-hot-row.md.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from django.db.models import F

from .models import BuyerAllowance, Item, Order, StockShard
from .sale_values import SaleRestarted, StockRow


def read_stock(item_id: int) -> StockRow:
    """The item row's units and version, as they are now (no lock taken)."""
    stock, version = Item.objects.values_list("stock", "version").get(pk=item_id)
    return StockRow(stock=stock, version=version)


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
