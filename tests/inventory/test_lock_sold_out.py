"""`lock`'s sold-out answer: from a mark in Redis, never one that outlives units come back."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from inventory import orders, services
from inventory.models import Item, Order
from inventory.redis_client import get_redis_client
from inventory.services import forget_item, restock, start_sale
from inventory.stock import return_units
from inventory.strategies.lock import LockStrategy, _gone_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded_smoke]


def _checkout(client, buyer: str):
    return client.post(
        "/api/checkout",
        {"sku": "widget", "qty": 1, "buyer": buyer},
        content_type="application/json",
    )


def _queries(client, buyer: str, status: int) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = _checkout(client, buyer)
        assert response.status_code == status, response.content
    return len(captured)


def _sold_out(client, monkeypatch) -> None:
    """A `lock` sale of two units, sold, and marked gone by the first checkout refused."""
    monkeypatch.setattr(services, "ITEM_MEMORY_MS", 60_000)  # no item read expires meanwhile
    start_sale(sku="widget", stock=2, strategy="lock")
    assert _checkout(client, "ann").status_code == _checkout(client, "bob").status_code == 201
    # this process's last sale left it 0: the first refusal reads the row once, and marks it
    assert _queries(client, "cy", 409) == 1


def test_a_lock_sold_out_answer_costs_no_database_round_trip_once_marked(client, monkeypatch):
    _sold_out(client, monkeypatch)

    # Then later refusals are answered from the mark: no database round trip at all
    assert _queries(client, "dee", 409) == 0
    answer = _checkout(client, "eve").json()
    assert answer == {"error": "sold_out", "detail": "widget is sold out"}

    # and a process that has not sold (its own item read says 0 too) reads no stock row either:
    # only the item, as every checkout does once a second
    forget_item("widget")
    assert _queries(client, "fay", 409) == 1
    assert _queries(client, "gus", 409) == 0
    assert Order.objects.count() == 2


def _give_back_one() -> None:
    order = Order.objects.order_by("pk").first()
    assert orders.expire_order(order.pk)


def _restock_one() -> None:
    restock(sku="widget", units=1)


@pytest.mark.parametrize("units_back", [_give_back_one, _restock_one], ids=["give-back", "restock"])
def test_units_that_come_back_void_the_mark_and_sell_at_once(client, monkeypatch, units_back):
    _sold_out(client, monkeypatch)
    assert _queries(client, "dee", 409) == 0  # marked

    # When a unit comes back to the item row (committed, then told to Redis)
    units_back()

    # Then the next checkout buys it, and the one after is refused (and marks again)
    assert _checkout(client, "eve").status_code == 201
    assert _checkout(client, "fay").status_code == 409
    assert _queries(client, "gus", 409) == 0
    item = Item.objects.get(sku="widget")
    assert item.stock == 0


def test_a_mark_redis_missed_the_give_back_of_is_voided_by_the_reconciler(client, monkeypatch):
    _sold_out(client, monkeypatch)
    assert _queries(client, "dee", 409) == 0

    # Given a failed order whose units went back to the row while Redis was not told
    order = Order.objects.order_by("pk").first()
    Order.objects.filter(pk=order.pk).update(status="failed")
    return_units(Order.objects.get(pk=order.pk))

    # the mark still answers sold out: the unit is stranded, until
    assert _checkout(client, "eve").status_code == 409

    # the reconciler's pass, which voids it
    assert orders.reconcile_sale("widget") == []
    assert _checkout(client, "fay").status_code == 201
    assert Item.objects.get(sku="widget").stock == 0


def test_a_checkout_marks_nothing_when_units_came_back_since_it_looked():
    # Given a sold-out `lock` sale, and a checkout that has looked for a mark and found none
    start_sale(sku="widget", stock=0, strategy="lock")
    item = Item.objects.get(sku="widget")
    mark, additions = LockStrategy._gone(item)
    assert mark is None

    # When units come back before it marks what it read
    LockStrategy._units_back(item)
    LockStrategy._mark_gone(item, 0, additions)

    # Then no mark is made (its read may be older than the units)
    assert get_redis_client().get(_gone_keys(item)[0]) is None
    mark, since = LockStrategy._gone(item)
    assert mark is None and int(since) == int(additions) + 1

    # and one that looked after them marks, and is found
    LockStrategy._mark_gone(item, 0, since)
    assert LockStrategy._gone(item) == (0, since)


def test_a_mark_of_too_few_refuses_a_larger_checkout_and_lets_a_smaller_one_buy(
    client, monkeypatch
):
    monkeypatch.setattr(services, "ITEM_MEMORY_MS", 60_000)
    start_sale(sku="widget", stock=3, strategy="lock")
    bought = client.post(
        "/api/checkout",
        {"sku": "widget", "qty": 2, "buyer": "ann"},
        content_type="application/json",
    )
    assert bought.status_code == 201

    def two(buyer: str) -> tuple[int, dict, int]:
        with CaptureQueriesContext(connection) as captured:
            response = client.post(
                "/api/checkout",
                {"sku": "widget", "qty": 2, "buyer": buyer},
                content_type="application/json",
            )
        return response.status_code, response.json(), len(captured)

    # the first checkout of two reads the row (one left) and marks it; the next is answered
    # from the mark
    assert two("bob") == (
        409,
        {"error": "sold_out", "detail": "widget: only 1 left, 2 requested"},
        1,
    )
    assert two("cy") == (
        409,
        {"error": "sold_out", "detail": "widget: only 1 left, 2 requested"},
        0,
    )
    # while a checkout of one, which the mark allows, buys the last unit
    assert _checkout(client, "dee").status_code == 201
    assert Item.objects.get(sku="widget").stock == 0
