"""The writers that decide by no lock keep at most one connection on a row.

`optimistic` (and the fallback, through it) take each row's writer gate before they write it,
never waiting for it: a write that finds the gate taken loses the race and backs off in its
own process. So however many buyers sell at once, no more than one of their connections waits
on a row, where PostgreSQL would otherwise queue them all behind every commit. Measured from
PostgreSQL's side: its view of the backends waiting for a row lock, sampled through a flood.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid

import psycopg
import pytest
from django.db import connection

from inventory.exceptions import Busy, SoldOut
from inventory.models import Item, Order
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies.optimistic import OptimisticStrategy
from tests.conftest import test_database_url

STOCK = 400
BUYERS = 24

pytestmark = pytest.mark.django_db(transaction=True)

# A backend waiting for a row lock waits for the transaction that holds it (or, behind the
# first waiter, for the tuple lock). A gate's waiter shows `advisory` instead.
ROW_WAITERS = """
    SELECT count(*) FROM pg_stat_activity
    WHERE datname = current_database() AND wait_event_type = 'Lock'
      AND wait_event IN ('transactionid', 'tuple')
"""


class RowWaiters:
    """Samples, from a connection of its own, how many backends wait for a row lock."""

    def __init__(self) -> None:
        self.most = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        with psycopg.connect(test_database_url().replace("postgres://", "postgresql://")) as db:
            db.autocommit = True
            while not self._stop.is_set():
                waiting = db.execute(ROW_WAITERS).fetchone()[0]
                self.most = max(self.most, waiting)
                self.samples += 1

    def __enter__(self) -> RowWaiters:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _sell_out(sku: str) -> tuple[int, int]:
    """BUYERS threads buy one unit at a time until sold out: (units sold, busy answers)."""
    sold, busy = [], []
    lock = threading.Lock()

    def buyer(n: int) -> None:
        mine = busier = 0
        try:
            while True:
                try:
                    place_order(sku=sku, qty=1, buyer=f"b{n}-{mine}-{busier}")
                    mine += 1
                except Busy:
                    busier += 1
                except SoldOut:
                    return
        finally:
            connection.close()
            with lock:
                sold.append(mine)
                busy.append(busier)

    threads = [threading.Thread(target=buyer, args=(n,)) for n in range(BUYERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return sum(sold), sum(busy)


def _assert_sold_exactly_the_stock(sku: str, sold: int) -> None:
    assert sold == STOCK
    assert Order.objects.filter(item__sku=sku).count() == STOCK
    audit = audit_sale(sku)
    assert audit["oversold"] == 0 and audit["remaining"] == 0 and audit["consistent"], audit


@pytest.mark.slow
def test_optimistic_buyers_never_queue_on_the_item_row():
    # Given an optimistic sale and a crowd of buyers many times the cores
    sku = f"gated-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy="optimistic")

    # When they buy it out, one unit each time
    with RowWaiters() as waiters:
        sold, _ = _sell_out(sku)

    # Then exactly the stock is sold, and never did more than one connection wait on the row
    _assert_sold_exactly_the_stock(sku, sold)
    assert waiters.samples > 100
    assert waiters.most <= 1, waiters.most


def test_without_the_gates_the_same_buyers_queue_on_the_row(monkeypatch):
    # Given the same sale, its writes made without gates (what the measure must catch)
    plan = OptimisticStrategy._plan

    def ungated(self, *args, **kwargs):
        return dataclasses.replace(plan(self, *args, **kwargs), gated=False)

    monkeypatch.setattr(OptimisticStrategy, "_plan", ungated)
    sku = f"ungated-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy="optimistic")

    # When the same crowd buys it out
    with RowWaiters() as waiters:
        sold, _ = _sell_out(sku)

    # Then it still sells exactly the stock (the version check), but connections pile up on
    # the row while they wait for each commit
    _assert_sold_exactly_the_stock(sku, sold)
    assert waiters.most >= 2, waiters.most


def test_the_fallback_keeps_one_connection_per_stock_row_with_redis_down(settings):
    # Given a lua sale (ten stock rows) whose Redis is gone: every checkout falls back
    sku = f"gated-fallback-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy="lua")
    settings.REDIS_URL = "redis://127.0.0.1:1/0"

    # When the crowd buys it out
    with RowWaiters() as waiters:
        sold, _ = _sell_out(sku)

    # Then the database alone sold exactly the stock, from its rows, with no connection
    # waiting on a row (each gated writer holds its own row's gate)
    assert sold == STOCK
    orders = Order.objects.filter(item__sku=sku)
    assert orders.count() == STOCK and not orders.exclude(fallback=True).exists()
    assert Item.objects.get(sku=sku).units_left == 0
    assert waiters.most <= 1, waiters.most
