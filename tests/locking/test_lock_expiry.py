"""A lock that expires mid-work (no watchdog) lets two holders overlap. The guarded write is what
keeps that from overselling; the watchdog is what keeps it from happening at all.

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


@pytest.mark.parametrize("watchdog", [False, True], ids=["no-watchdog", "watchdog"])
def test_an_expiring_lock_never_oversells(settings, watchdog):
    # Given critical sections of 80 ms under a lock that lives 25 ms unless renewed (without
    # the watchdog, holders overlap; the pitfall lab's trust-the-lock shows what a write that
    # trusts the lock then does)
    settings.FLASHSALE_LOCK_TTL_MS = 25
    settings.FLASHSALE_HOLD_DELAY_MS = 80
    settings.FLASHSALE_LOCK_WATCHDOG = watchdog
    sku = f"expiry-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy="lock")

    # When threads buy until it is sold out
    accepted, _ = _sell_with_threads(sku)

    # Then the audit sees exactly what the threads were told: the stock, and not one unit more
    audit = audit_sale(sku)
    assert accepted == audit["accepted_units"] == STOCK, audit
    assert audit["oversold"] == 0 and audit["remaining"] == 0, audit
    assert audit["consistent"], audit
