"""Selectors: the reads. What the API, the pages and the audit show."""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db import close_old_connections, connection
from django.db.models import Count, QuerySet, Sum

from .breaker import breaker
from .exceptions import NotOnSale, UnknownSku
from .fastpath import read_item_with_sale
from .models import (
    LIVE_STATUSES,
    SKU_PATTERN,
    Item,
    Order,
    OrderStatus,
    SaleRepair,
)
from .redis_client import REDIS_DOWN_ERRORS, ping
from .stock import shard_stocks
from .strategies import get_strategy


def database_now() -> datetime:
    """The database's clock: the one every web host and command agrees on (a sale opens by it,
    whatever the clock of the host that started it or of the one serving a checkout)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


def get_item(sku: str) -> Item:
    """The item sold as sku, with its current sale and its units left: what
    `Item.objects.with_units_left().select_related("current_sale").get(sku=sku)` returns, in one
    hand-written, prepared query (`fastpath.read_item_with_sale`), as every item page and
    `GET /api/items/<sku>` (a crowd's other request) runs it."""
    if not SKU_PATTERN.fullmatch(sku):
        raise UnknownSku(sku)  # (never sent to the database: a NUL byte is not even valid there)
    item = read_item_with_sale(sku)
    if item is None:
        raise UnknownSku(sku)
    return item


def items_on_sale() -> QuerySet[Item]:
    """Items with a current sale (started or about to open), as the storefront lists them."""
    return (
        Item.objects.with_units_left()
        .select_related("current_sale")
        .filter(current_sale__isnull=False)
    )


def items_by_sku(skus: list[str]) -> list[Item]:
    """The items named, in the order named (unknown ones left out, repeats once)."""
    found = (
        Item.objects.with_units_left()
        .select_related("current_sale")
        .in_bulk(skus, field_name="sku")
    )
    return [found[sku] for sku in dict.fromkeys(skus) if sku in found]


def redis_stock_of(item: Item) -> int | None:
    """What Redis believes is left of item, or None (unused by its strategy, or Redis down)."""
    try:
        return get_strategy(item.strategy).redis_stock(item=item)
    except REDIS_DOWN_ERRORS:
        return None


#: sku -> (monotonic expiry, its answer): the answers `item_page` gave a moment ago.
_item_pages: dict[str, tuple[float, dict[str, Any]]] = {}
#: The most items whose answers one process keeps (past it, it starts afresh).
MAX_ITEM_PAGES = 1000


def item_page(sku: str) -> dict[str, Any]:
    """GET /api/items/<sku>'s answer: the item as `item_payload` has it, and Redis's figure
    (`redis_stock`), as this process read them at most FLASHSALE_ITEM_PAGE_MS ago.

    The item page polls it every second, and a flash crowd looks at the item between its
    checkouts: each look that reads costs a database query and a Redis call, on the host that
    sells. Its stock is at most that long behind the sales; a sale (re)started or restocked by
    this process is read afresh at once, by the others within that time. An unknown sku
    (UnknownSku) is not remembered.
    """
    memory = settings.FLASHSALE_ITEM_PAGE_MS
    now = time.monotonic()
    if memory:
        remembered = _item_pages.get(sku)
        if remembered is not None and remembered[0] > now:
            return remembered[1]
    item = get_item(sku)
    payload = item_payload(item)
    payload["redis_stock"] = redis_stock_of(item)
    if memory:
        if len(_item_pages) >= MAX_ITEM_PAGES:
            _item_pages.clear()
        _item_pages[sku] = (now + memory / 1000, payload)
    return payload


def forget_item_page(sku: str) -> None:
    """Drop this process's remembered answer for sku (its sale was restarted or restocked)."""
    _item_pages.pop(sku, None)


def forget_item_pages() -> None:
    """Drop every answer this process remembers (`item_page`)."""
    _item_pages.clear()


def item_payload(item: Item) -> dict[str, Any]:
    sale = item.current_sale
    return {
        "sku": item.sku,
        "name": item.name,
        "price": str(item.price),
        "stock": item.units_left,
        "strategy": item.strategy,
        "per_buyer_limit": item.per_buyer_limit,
        "initial_stock": sale.initial_stock if sale else None,
        "sale_started_at": sale.started_at.isoformat() if sale else None,
        "opens_at": sale.opens_at.isoformat() if sale else None,
    }


def order_payload(order: Order) -> dict[str, Any]:
    return {
        "order": str(order.public_id),
        "sku": order.item.sku,
        "qty": order.qty,
        "buyer": order.buyer,
        "status": order.status,
        "strategy": order.served_by,
        "fallback": order.fallback,
        "created_at": order.created_at.isoformat(),
    }


def checkout_payload(order: Order) -> dict[str, Any]:
    """The answer to a checkout: the order as accepted. A retry with the same idempotency key
    gets the very same body; the order's live status is at GET /api/orders/<id>."""
    return {**order_payload(order), "status": OrderStatus.PENDING}


def get_order(public_id: UUID) -> Order:
    """The order whose public id this is (Order.DoesNotExist when none is)."""
    return Order.objects.select_related("item").get(public_id=public_id)


def audit_sale(sku: str) -> dict[str, Any]:
    """The invariants of sku's current sale, from the orders, the item row, shards and Redis."""
    item = get_item(sku)
    sale = item.current_sale
    if sale is None:
        raise NotOnSale(sku)
    orders = Order.objects.filter(sale=sale)
    by_status = {
        row["status"]: (row["orders"], row["units"])
        for row in orders.values("status").annotate(orders=Count("pk"), units=Sum("qty"))
    }
    accepted = sum(units for status, (_, units) in by_status.items() if status in LIVE_STATUSES)
    supply = sale.supply
    shards = shard_stocks(sale.pk) if item.shard_count else None
    db_stock = sum(shards.values()) if shards is not None else item.stock
    redis_stock = redis_stock_of(item)
    counts_in_redis = get_strategy(item.strategy).counts_in_redis
    return {
        "sku": item.sku,
        "strategy": item.strategy,
        "initial_stock": sale.initial_stock,
        "added_stock": sale.added_stock,
        "accepted_units": accepted,
        "accepted_orders": sum(
            count for status, (count, _) in by_status.items() if status in LIVE_STATUSES
        ),
        "oversold": max(0, accepted - supply),
        "remaining": max(0, supply - accepted),
        "db_stock": db_stock,
        "redis_stock": redis_stock,
        "shard_stock": db_stock if shards is not None else None,
        "stock_rows": shards,
        "consistent": db_stock == supply - accepted
        and (not counts_in_redis or redis_stock == db_stock),
        "fallback_orders": orders.filter(fallback=True).count(),
        # Keyed by plain strings ("pending"), as JSON and a reader see them.
        "orders_by_status": {
            status.value: by_status.get(status, (0, 0))[0] for status in OrderStatus
        },
        "units_by_status": {
            status.value: by_status.get(status, (0, 0))[1] for status in OrderStatus
        },
        # What the recoveries and the reconciler found wrong and put right, latest first.
        "repairs": [
            {"at": made_at.isoformat(), "cause": cause, "changes": changes}
            for made_at, cause, changes in SaleRepair.objects.filter(sale=sale).values_list(
                "made_at", "cause", "changes"
            )[:REPAIRS_SHOWN]
        ],
    }


#: The most repairs of a sale the audit lists.
REPAIRS_SHOWN = 10


#: The most items on sale whose figures `/metrics` reports one by one (a label value each).
METRICS_ITEMS = 50


def sales_figures() -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """For `/metrics`, in two queries: units oversold per item on sale (accepted beyond its
    sale's supply; at most METRICS_ITEMS items, the most recently started sales), and the
    orders of those sales by status, per item."""
    items = list(
        Item.objects.filter(current_sale__isnull=False)
        .order_by("-current_sale_id")
        .values_list("sku", "current_sale_id", "current_sale__initial_stock",
                     "current_sale__added_stock")[:METRICS_ITEMS]
    )  # fmt: skip
    sku_of = {sale_id: sku for sku, sale_id, _, _ in items}
    by_status: dict[str, dict[str, int]] = {
        sku: dict.fromkeys(OrderStatus, 0) for sku in sku_of.values()
    }
    accepted = dict.fromkeys(sku_of.values(), 0)
    rows = (
        Order.objects.filter(sale_id__in=sku_of)
        .values("sale_id", "status")
        .annotate(orders=Count("pk"), units=Sum("qty"))
    )
    for row in rows:
        sku = sku_of[row["sale_id"]]
        by_status[sku][row["status"]] = row["orders"]
        if row["status"] in LIVE_STATUSES:
            accepted[sku] += row["units"]
    oversold = {sku: max(0, accepted[sku] - (initial + added)) for sku, _, initial, added in items}
    return oversold, by_status


#: How long /healthz waits for the database's answer to `SELECT 1` before it says the database
#: is down: a database that stopped answering (a frozen host, a process stopped) does not cut
#: the connection, and nothing bounds a query on the client's side.
DATABASE_PROBE_SECONDS = 1.0


@dataclass(eq=False)
class _Probe:
    """One `SELECT 1`, and its answer once the database gave it."""

    answered: threading.Event = field(default_factory=threading.Event)
    state: str = ""


class _DatabaseProbe:
    """The database's state for /healthz within DATABASE_PROBE_SECONDS, whatever the database
    does: `SELECT 1` is asked by a thread of the process's own, on its own connection, one
    probe at a time; a request that comes while one is asked waits for that one's answer (a
    probe held by a database that stopped answering is not joined by more)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # A forked child has none of its parent's threads: it starts its own.
        self._lock = threading.Lock()
        self._asked: queue.SimpleQueue[_Probe | None] = queue.SimpleQueue()
        self._probe: _Probe | None = None
        self._thread: threading.Thread | None = None

    def state(self) -> str:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._ask, args=(self._asked,), name="database-probe", daemon=True
                )
                self._thread.start()
            probe = self._probe
            if probe is None or probe.answered.is_set():
                probe = self._probe = _Probe()
                self._asked.put(probe)
        if probe.answered.wait(DATABASE_PROBE_SECONDS):
            return probe.state
        return f"down: no answer in {DATABASE_PROBE_SECONDS:g} s"

    def close(self) -> None:
        """End the thread and its connection (before the database is dropped, say)."""
        with self._lock:
            thread, self._thread, self._probe = self._thread, None, None
            asked, self._asked = self._asked, queue.SimpleQueue()
        if thread is not None:
            asked.put(None)
            thread.join(DATABASE_PROBE_SECONDS)

    @staticmethod
    def _ask(asked: queue.SimpleQueue[_Probe | None]) -> None:
        try:
            while (probe := asked.get()) is not None:
                close_old_connections()  # as a request does: one too old, or broken, goes
                try:
                    with connection.cursor() as cursor:
                        cursor.execute("SELECT 1")
                    probe.state = "ok"
                except Exception as exc:  # any failure to answer is "down"
                    probe.state = f"down: {exc.__class__.__name__}"
                    connection.close()
                probe.answered.set()
        finally:
            connection.close()


database_probe = _DatabaseProbe()


def health() -> dict[str, Any]:
    database = database_probe.state()
    try:
        ping()
        redis_state = "ok"
    except REDIS_DOWN_ERRORS as exc:
        redis_state = f"down: {exc.__class__.__name__}"
    if redis_state == "ok" and breaker.is_open:
        # Let this process's breaker probe now (and rebuild, in its thread: this answer does
        # not wait for it) rather than after its next checkout.
        breaker.probe_soon()
    return {
        "database": database,
        "redis": redis_state,
        "fallback_active": breaker.is_open or redis_state != "ok",
        "ok": database == "ok",
    }
