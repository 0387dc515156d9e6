"""Group commit: the `lua` and `segmented` checkouts in flight in one process share one round
trip to Redis and one statement (`inventory.batching`), on real PostgreSQL and Redis, with real
threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection
from django.db.models import Count

from inventory.exceptions import Busy, LimitReached, SoldOut
from inventory.models import Order
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from tests.support import units_held_ahead_returned

BUYERS = 16


def _flood(sku: str, buyers: int, *, qty: int = 1, buyer_name=None) -> list[Order]:
    """`buyers` threads buy until sold out; the orders they were answered with."""
    sold: list[Order] = []
    start = threading.Barrier(buyers)

    def buyer(number: int) -> None:
        try:
            start.wait(30)
            attempt = 0
            while True:
                attempt += 1
                name = buyer_name(number, attempt) if buyer_name else f"{number}-{attempt}"
                try:
                    sold.append(place_order(sku=sku, qty=qty, buyer=name).order)
                except Busy:
                    continue
                except (SoldOut, LimitReached):
                    return
        finally:
            connection.close()

    with ThreadPoolExecutor(buyers) as pool:
        for future in [pool.submit(buyer, number) for number in range(buyers)]:
            future.result(timeout=120)
    return sold


def _largest_commit(sku: str) -> int:
    """The most orders of sku's sale one commit wrote (a batch's orders share its timestamp)."""
    per_commit = (
        Order.objects.filter(item__sku=sku)
        .values("created_at")
        .annotate(orders=Count("id"))
        .order_by("-orders")
    )
    return per_commit[0]["orders"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("round_", range(3))
@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_threads_of_one_process_sell_exactly_the_stock_in_shared_commits(strategy, round_):
    # Given a sale of 300 units and 16 buyer threads in this process
    start_sale(sku="batched", stock=300, strategy=strategy)

    # When they buy one unit at a time until it is sold out
    sold = _flood("batched", BUYERS)

    # Then exactly the stock is sold, every answer is a stored order, nothing oversold or left
    assert len(sold) == 300
    stored = set(Order.objects.filter(item__sku="batched").values_list("public_id", flat=True))
    assert {order.public_id for order in sold} == stored
    audit = audit_sale("batched")
    assert (audit["accepted_units"], audit["oversold"], audit["remaining"]) == (300, 0, 0)
    assert audit["redis_stock"] == audit["db_stock"] == 0
    assert audit["consistent"], audit
    # and checkouts in flight together shared a commit
    assert _largest_commit("batched") > 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_each_sale_of_a_batch_keeps_its_own_per_buyer_limit(strategy):
    # Given a limit of 2 per buyer, and 16 threads buying as 4 buyers, 2 units at a time
    start_sale(sku="limited", stock=1000, strategy=strategy, limit=2)

    sold = _flood("limited", BUYERS, qty=2, buyer_name=lambda number, _: f"buyer-{number % 4}")

    # Then each buyer got one order of 2, and the rest were refused without a unit lost
    assert sorted(order.buyer for order in sold) == [f"buyer-{n}" for n in range(4)]
    units_held_ahead_returned("limited")
    audit = audit_sale("limited")
    assert audit["accepted_units"] == 8 and audit["remaining"] == 992
    assert audit["redis_stock"] == audit["db_stock"] == 992
    assert audit["consistent"], audit
