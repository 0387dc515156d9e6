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


@pytest.mark.parametrize(
    ("watchdog", "guarded_write", "oversells"),
    [
        # no watchdog and the naive write-back: holders overlap and sell units that do not
        # exist, so the lock alone is not enough
        (False, False, True),
        # locks still expire mid-work, but the version-checked write refuses stale writes
        (False, True, False),
        # the naive write-back again, but the watchdog keeps each lock alive: no overlap
        (True, False, False),
    ],
    ids=["no-watchdog-naive-write", "no-watchdog-guarded-write", "watchdog-naive-write"],
)
def test_an_expiring_lock_and_what_prevents_oversell(settings, watchdog, guarded_write, oversells):
    # Given critical sections of 80 ms under a lock that lives 25 ms unless renewed
    settings.FLASHSALE_LOCK_TTL_MS = 25
    settings.FLASHSALE_HOLD_DELAY_MS = 80
    settings.FLASHSALE_LOCK_WATCHDOG = watchdog
    settings.FLASHSALE_LOCK_GUARDED_WRITE = guarded_write
    sku = f"expiry-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy="lock")

    # When threads buy until it is sold out
    accepted, _ = _sell_with_threads(sku)

    # Then the audit sees exactly what the threads were told
    audit = audit_sale(sku)
    assert accepted == audit["accepted_units"], audit
    if oversells:
        assert audit["oversold"] > 0, audit
    else:
        assert accepted == STOCK, audit
        assert audit["oversold"] == 0 and audit["remaining"] == 0, audit
        assert audit["consistent"], audit
