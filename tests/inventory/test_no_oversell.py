"""Invariants 1-3 under a real flood: separate buyer processes, a real web server, real PostgreSQL
and Redis. Every round checks exact counts, repeated to give a race room to show."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from inventory.models import Order, OrderStatus
from inventory.orders import expire_order, reconcile_sale
from inventory.selectors import audit_sale
from inventory.services import start_sale
from loadtest.flood import flood
from tests.conftest import start_shop
from tests.support import BUSY_RETRIES

STOCK = 50
BUYERS = 32
ATTEMPTS = 224
ROUNDS = 5

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_a_flood_sells_exactly_the_stock(shop_server, strategy):
    for round_number in range(ROUNDS):
        # Given a sale of 50 units and 224 buyers, 32 at a time
        sku = f"{strategy}-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=STOCK, strategy=strategy)

        # When they all try to buy one
        result = flood(
            shop_server.url, sku, attempts=ATTEMPTS, concurrency=BUYERS, retry_busy=BUSY_RETRIES
        )

        # Then exactly the stock is sold, every answer is a 201 or a 409, and nothing is left
        context = f"{strategy} round {round_number}: {dict(result.statuses)} {dict(result.errors)}"
        assert result.transport_failures == 0, context
        assert result.server_errors == 0, context
        assert set(result.statuses) <= {201, 409}, context
        assert result.accepted == STOCK, context
        assert result.errors == {"sold_out": ATTEMPTS - STOCK}, context
        audit = audit_sale(sku)
        assert audit["oversold"] == 0, audit
        assert audit["accepted_units"] == STOCK, audit
        assert audit["remaining"] == 0, audit
        assert audit["db_stock"] == 0, audit
        assert audit["consistent"], audit
        # every 201 has its committed order row, and there are no others
        stored = {
            str(pid)
            for pid in Order.objects.filter(item__sku=sku).values_list("public_id", flat=True)
        }
        assert sorted(result.order_ids) == sorted(stored), context


def _expire_pending(sku: str, expired: list[int], flood_over: threading.Event) -> None:
    """Expire pending orders of sku, each giving its unit back: six while the crowd buys, six
    more once it has gone (by then its refusals have marked the sale gone)."""
    deadline = time.monotonic() + 120
    try:
        for wanted, after in ((6, None), (12, flood_over)):
            if after is not None:
                after.wait(120)
            while len(expired) < wanted and time.monotonic() < deadline:
                pending = Order.objects.filter(item__sku=sku, status=OrderStatus.PENDING)
                order_pk = pending.order_by("?").values_list("pk", flat=True).first()
                if order_pk is not None and expire_order(order_pk):
                    expired.append(order_pk)
                time.sleep(0.01)
    finally:
        connection.close()


def test_lock_units_given_back_after_the_sell_out_are_sold_again(shop_server):
    for round_number in range(3):
        # Given a `lock` sale of 50 units flooded as above (once it is sold out, its refusals
        # mark it gone in Redis), while orders expire and give their units back, during the
        # flood and after it
        sku = f"lock-back-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=STOCK, strategy="lock")
        expired: list[int] = []
        flood_over = threading.Event()
        expirer = threading.Thread(target=_expire_pending, args=(sku, expired, flood_over))
        expirer.start()
        result = flood(
            shop_server.url, sku, attempts=ATTEMPTS, concurrency=BUYERS, retry_busy=BUSY_RETRIES
        )
        flood_over.set()
        expirer.join(timeout=150)
        assert not expirer.is_alive() and len(expired) == 12

        # When buyers come back one at a time
        again = flood(shop_server.url, sku, attempts=20, concurrency=1, retry_busy=BUSY_RETRIES)

        # Then every unit given back was sold again: no mark outlived units that came back
        context = f"round {round_number}: {dict(result.statuses)} then {dict(again.statuses)}"
        assert result.server_errors == again.server_errors == 0, context
        audit = audit_sale(sku)
        assert audit["oversold"] == 0 and audit["consistent"], audit
        assert audit["accepted_units"] == STOCK and audit["db_stock"] == 0, (context, audit)
        assert again.errors == {"sold_out": 20 - again.accepted}, context


def test_unsafe_oversells_under_the_same_flood(shop_server):
    # Given the no-lock baseline, with a short delay between its read and its write
    sku = f"unsafe-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=STOCK, strategy="unsafe")

    # When the same flood hits it
    result = flood(shop_server.url, sku, attempts=ATTEMPTS, concurrency=BUYERS)

    # Then it accepts more than it had: the harness can see oversell
    audit = audit_sale(sku)
    assert result.server_errors == 0, dict(result.statuses)
    assert result.accepted == audit["accepted_units"]
    assert audit["oversold"] > 0, audit
    assert audit["accepted_units"] > STOCK, audit
    assert not audit["consistent"], audit


@pytest.fixture(scope="module")
def patient_server(django_db_setup, django_db_blocker):
    """A shop whose buyers wait up to 20 s for a lock, within a deadline of 30 s: contention
    alone never makes them give up (`busy`) on a slow host; a deadlock still would, after 20 s."""
    server = start_shop(FLASHSALE_LOCK_WAIT_MS=20_000, FLASHSALE_CHECKOUT_DEADLINE_MS=30_000)
    yield server
    server.stop()


def test_segmented_mixed_quantities_and_the_reconciler_never_deadlock(patient_server):
    """Single-shard sales, sales spread over several shards (lock every shard, one statement
    over many rows) and the reconciler (shard rows, then the item row) all lock rows in the
    same order; under a flood of all three at once none deadlocks, none oversells."""
    url = patient_server.url
    for round_number in range(3):
        # Given 100 units over 10 shards (10 each), two crowds and the reconciler
        sku = f"mixed-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=100, strategy="segmented")
        stop = threading.Event()

        # When buyers of one unit and buyers of 13 (more than any shard holds) check out at
        # once while the reconciler runs in a loop
        with ThreadPoolExecutor(3) as pool:
            reconciler = pool.submit(_reconcile_until, sku, stop)
            singles = pool.submit(flood, url, sku, attempts=120, concurrency=12, buyer_prefix="one")
            bulk = pool.submit(
                flood, url, sku, attempts=40, concurrency=8, qty=13, buyer_prefix="bulk"
            )
            results = [singles.result(), bulk.result()]
            stop.set()
            reconciles = reconciler.result()

        # Then every answer is a 201 or a 409, never more than the stock is accepted
        context = f"round {round_number}: {[dict(r.statuses) for r in results]}"
        for result in results:
            assert result.transport_failures == 0 and result.server_errors == 0, context
            assert set(result.errors) <= {"sold_out"}, context
        assert reconciles > 0
        audit = audit_sale(sku)
        assert audit["oversold"] == 0, audit
        assert audit["accepted_units"] == results[0].accepted + 13 * results[1].accepted, audit
        assert audit["consistent"], audit
        # and single units then sell what the crowds left: nothing is stranded
        left = audit["remaining"]
        drain = flood(url, sku, attempts=left + 5, concurrency=4, buyer_prefix="last")
        assert drain.server_errors == 0
        final = audit_sale(sku)
        assert final["accepted_units"] == 100 and final["remaining"] == 0, final
        assert final["consistent"], final


def _reconcile_until(sku: str, stop: threading.Event) -> int:
    """Run the reconciler on sku over and over until stopped; return how many times it ran."""
    runs = 0
    try:
        while not stop.is_set():
            reconcile_sale(sku)
            runs += 1
    finally:
        connection.close()
    return runs
