"""A lock that expires mid-work (no watchdog) lets two holders overlap. The version-checked write
is what keeps that from overselling; the watchdog is what keeps it from happening at all.

Real threads buy through the checkout service against real PostgreSQL and Redis, with each
critical section made longer than the lock's time to live.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from inventory.exceptions import Busy, SoldOut
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale

STOCK = 12
THREADS = 6

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded_smoke]


def _buy_until_sold_out(sku: str, worker: int) -> tuple[int, int]:
    accepted = busy = 0
    try:
        for attempt in range(200):
            try:
                place_order(sku=sku, qty=1, buyer=f"w{worker}-{attempt}")
                accepted += 1
            except Busy:
                busy += 1
            except SoldOut:
                break
    finally:
        connection.close()
    return accepted, busy


def _sell_with_threads(sku: str) -> tuple[int, int]:
    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(_buy_until_sold_out, [sku] * THREADS, range(THREADS)))
    return sum(a for a, _ in results), sum(b for _, b in results)


@pytest.fixture
def slow_critical_section(settings):
    """Each critical section lasts 80 ms; the lock lives 25 ms unless renewed."""
    settings.FLASHSALE_LOCK_TTL_MS = 25
    settings.FLASHSALE_HOLD_DELAY_MS = 80
    return settings


def test_without_guard_an_expired_lock_oversells(slow_critical_section):
    # Given no watchdog and the naive write-back of the stock read under the lock
    slow_critical_section.FLASHSALE_LOCK_WATCHDOG = False
    slow_critical_section.FLASHSALE_LOCK_GUARDED_WRITE = False
    sku = f"expiry-naive-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy="lock")

    # When threads buy while every lock expires mid-work
    accepted, _ = _sell_with_threads(sku)

    # Then holders overlapped and sold units that did not exist: the lock alone is not enough
    audit = audit_sale(sku)
    assert accepted == audit["accepted_units"]
    assert audit["oversold"] > 0, audit


def test_with_guard_an_expired_lock_cannot_oversell(slow_critical_section):
    # Given no watchdog, so locks still expire mid-work, but the version-checked write
    slow_critical_section.FLASHSALE_LOCK_WATCHDOG = False
    sku = f"expiry-guarded-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy="lock")

    # When threads buy the same way
    accepted, _ = _sell_with_threads(sku)

    # Then exactly the stock is sold and the books balance
    audit = audit_sale(sku)
    assert accepted == STOCK, audit
    assert audit["oversold"] == 0 and audit["remaining"] == 0, audit
    assert audit["consistent"], audit


def test_watchdog_keeps_the_lock_alive_past_its_ttl(slow_critical_section):
    # Given the naive write-back again, but with the watchdog renewing the lock
    slow_critical_section.FLASHSALE_LOCK_WATCHDOG = True
    slow_critical_section.FLASHSALE_LOCK_GUARDED_WRITE = False
    sku = f"expiry-watchdog-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy="lock")

    # When threads buy with critical sections three times the lock's TTL
    accepted, _ = _sell_with_threads(sku)

    # Then holders never overlapped: even the unguarded write sold exactly the stock
    audit = audit_sale(sku)
    assert accepted == STOCK, audit
    assert audit["oversold"] == 0 and audit["consistent"], audit
