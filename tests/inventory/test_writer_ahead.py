"""Units the sale writer takes ahead: right after it answers a batch, it takes from Redis as many
units of the sale as the batch sold, for the requests those buyers are about to send, which are
then served with no script on the path they wait on. Held units are out of Redis and in no
order: they go back when no request comes for them (FLASHSALE_SALE_WRITER_AHEAD_MS), when the
writer stops, and before any buyer is told `sold_out`; when Redis fails they are dropped, and
the counters' rebuild from the database puts them back. All against real Redis and PostgreSQL."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from inventory.exceptions import SoldOut
from inventory.models import Item
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import plumbing
from tests.conftest import wait_until
from tests.conftest import writer_in_thread as serving

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def held_long(settings) -> None:
    """Units taken ahead wait 1 s for a request (none goes back while a test looks), and a
    lone request is taken at once."""
    settings.FLASHSALE_SALE_WRITER_AHEAD_MS = 1000
    settings.FLASHSALE_SALE_WRITER_LINGER_US = 0


@contextmanager
def holding_one_ahead(settings, stock: int) -> Iterator[tuple[Any, Item]]:
    """A lua sale of `stock` selling through a writer in a thread, ann's one unit sold through
    it, and the one unit the writer took ahead after her sale held: (the writer, the item)."""
    start_sale(sku="widget", stock=stock, strategy="lua")
    with serving() as writer:
        settings.FLASHSALE_SALE_WRITER = writer.path
        place_order(sku="widget", qty=1, buyer="ann")
        assert wait_until(lambda: writer.held_ahead == 1, timeout=5)
        yield writer, Item.objects.get(sku="widget")


def test_the_next_request_is_served_from_units_taken_ahead(held_long, settings):
    # Given a lua sale of 10 selling through a writer, when a buyer's checkout is sold, the
    # writer holds as many units as it sold, out of Redis, in no order
    with holding_one_ahead(settings, stock=10) as (writer, item):
        assert plumbing.rows_total(item) == 8
        audit = audit_sale("widget")
        assert audit["db_stock"] == 9 and audit["redis_stock"] == 8, audit

        # and the next checkout is sold from them, with no take of its own
        place_order(sku="widget", qty=1, buyer="bob")
        assert writer.sold_ahead == 1 and writer.sales == 2
        assert wait_until(lambda: writer.held_ahead == 1, timeout=5)
        assert plumbing.rows_total(item) == 7
    # and a writer that stops gives what it holds back
    assert writer.returned_ahead == 1
    audit = audit_sale("widget")
    assert audit["accepted_units"] == 2 and audit["oversold"] == 0, audit
    assert audit["db_stock"] == audit["redis_stock"] == 8 and audit["consistent"], audit


def test_units_no_request_comes_for_go_back_to_redis(settings):
    # Given a writer whose units taken ahead wait 200 ms for a request
    settings.FLASHSALE_SALE_WRITER_AHEAD_MS = 200
    start_sale(sku="widget", stock=10, strategy="lua")
    with serving() as writer:
        settings.FLASHSALE_SALE_WRITER = writer.path
        place_order(sku="widget", qty=1, buyer="ann")
        assert wait_until(lambda: writer.taken_ahead == 1, timeout=5)

        # When no request comes, they go back: Redis agrees with the database again
        assert wait_until(lambda: writer.returned_ahead == 1, timeout=5)
        assert writer.held_ahead == 0
        audit = audit_sale("widget")
        assert audit["db_stock"] == audit["redis_stock"] == 9 and audit["consistent"], audit


def test_units_held_ahead_go_back_before_a_buyer_hears_sold_out(held_long, settings):
    # Given a sale of 3 whose writer holds 1 unit ahead and Redis 1
    with holding_one_ahead(settings, stock=3) as (writer, _):
        # When a buyer asks for 2 (more than either holds)
        order = place_order(sku="widget", qty=2, buyer="bob").order

        # Then the held unit went back and the take found both: sold, not sold out
        assert order.qty == 2 and writer.returned_ahead == 1
        # and the next buyer hears sold out, nothing being held
        with pytest.raises(SoldOut):
            place_order(sku="widget", qty=1, buyer="cat")
        assert writer.held_ahead == 0
        audit = audit_sale("widget")
        assert audit["accepted_units"] == 3 and audit["oversold"] == 0, audit
        assert audit["db_stock"] == audit["redis_stock"] == 0 and audit["consistent"], audit


def test_a_checkout_with_an_idempotency_key_takes_its_units_with_its_claim(held_long, settings):
    # Given a writer holding a unit ahead
    with holding_one_ahead(settings, stock=10) as (writer, item):
        # When a checkout with an idempotency key comes (its claim is set in the script that
        # takes its units)
        first = place_order(sku="widget", qty=1, buyer="bob", idempotency_key="k-1").order
        again = place_order(sku="widget", qty=1, buyer="bob", idempotency_key="k-1").order

        # Then it was not served from the held unit, and its retry finds its order
        assert writer.sold_ahead == 0 and writer.held_ahead == 1
        assert again.pk == first.pk
        assert plumbing.rows_total(item) == 7
    audit = audit_sale("widget")
    assert audit["accepted_units"] == 2 and audit["consistent"], audit


@pytest.mark.parametrize("round_", range(3))
def test_a_threaded_crowd_sells_exactly_the_stock_with_units_taken_ahead(
    held_long, settings, round_
):
    # Given a lua sale of 150 and a writer taking ahead
    stock, buyers = 150, 12
    start_sale(sku="widget", stock=stock, strategy="lua")
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def buy(number: int) -> None:
        from django.db import connection

        try:
            while True:
                try:
                    place_order(sku="widget", qty=1 + (number % 2), buyer=f"b{number}-{round_}")
                    outcome = "sold"
                except SoldOut:
                    outcome = "sold_out"
                with lock:
                    outcomes[outcome] += 1 + (number % 2) if outcome == "sold" else 1
                if outcome == "sold_out":
                    return
        finally:
            connection.close()

    with serving() as writer:
        settings.FLASHSALE_SALE_WRITER = writer.path
        # When twelve threads buy one or two units at a time until each hears sold out
        threads = [threading.Thread(target=buy, args=(n,)) for n in range(buyers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)

        # Then exactly the stock was sold, most of it from units taken ahead, and nothing is
        # held once every buyer heard sold out
        assert outcomes["sold"] == stock and outcomes["sold_out"] == buyers, outcomes
        assert writer.sold_ahead > 0 and writer.held_ahead == 0
    audit = audit_sale("widget")
    assert audit["accepted_units"] == stock and audit["oversold"] == 0, audit
    assert audit["remaining"] == 0 and audit["db_stock"] == audit["redis_stock"] == 0, audit
    assert audit["consistent"], audit
