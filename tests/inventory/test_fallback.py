"""Redis dies (SIGKILL, then back empty) or hangs (SIGSTOP, then SIGCONT) mid-sale: checkout goes
on through the database, never oversells, strands nothing, answers nothing worse than `503 busy`
with Retry-After (a lock left held by a release the hung Redis never ran outlasts a checkout's
deadline), and Redis agrees with the database once it is back."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.utils import timezone

from inventory.models import Item, Order
from inventory.selectors import audit_sale
from inventory.services import start_sale
from loadtest.flood import flood
from shop.processes.redis_server import RedisServer
from tests.conftest import start_shop

STOCK = 300
ATTEMPTS = 1200
BUYERS = 16

pytestmark = pytest.mark.django_db(transaction=True)


def _wait_for_stock_at_most(sku: str, units: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Item.objects.get(sku=sku).units_left <= units:
            return
        time.sleep(0.02)


@pytest.fixture
def private_redis(settings):
    with RedisServer() as server:
        settings.REDIS_URL = server.url
        yield server


#: Short Redis timeouts, so that the outage is noticed at once.
OUTAGE_SETTINGS = {
    "FLASHSALE_REDIS_TIMEOUT": 0.2,
    "FLASHSALE_BREAKER_PROBE_SECONDS": 0.3,
}


@pytest.fixture
def outage_shop(private_redis):
    server = start_shop(REDIS_URL=private_redis.url, **OUTAGE_SETTINGS)
    yield server
    server.stop()


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua"])
@pytest.mark.parametrize("outage", ["killed", "paused"])
def test_checkout_survives_redis_outage(outage_shop, private_redis, strategy, outage):
    _sale_through_an_outage(outage_shop.url, private_redis, strategy, outage)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["segmented", "lua"])
@pytest.mark.parametrize("outage", ["killed", "paused"])
def test_batched_checkouts_survive_redis_outage(private_redis, strategy, outage):
    # The same on gunicorn's threaded workers, which batch too (the shop's own server, granian,
    # batches already above: a slow test, with the other servers' fault matrices)
    server = start_shop(kind="gthread", threads=4, REDIS_URL=private_redis.url, **OUTAGE_SETTINGS)
    try:
        _sale_through_an_outage(server.url, private_redis, strategy, outage)
    finally:
        server.stop()


def _sale_through_an_outage(url: str, private_redis, strategy: str, outage: str) -> None:
    # Given a sale through a Redis strategy and a flood of buyers that outlasts the stock
    sku = f"{strategy}-{outage}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy=strategy)
    results = []
    buyers = threading.Thread(
        target=lambda: results.append(
            flood(url, sku, attempts=ATTEMPTS, concurrency=BUYERS, pause=0.01)
        )
    )
    buyers.start()

    # When Redis goes away once a fifth is sold, and comes back when a half is sold
    _wait_for_stock_at_most(sku, STOCK * 4 // 5, timeout=30)
    if outage == "killed":
        private_redis.kill()
    else:
        private_redis.pause()
    _wait_for_stock_at_most(sku, STOCK // 2, timeout=5)
    if outage == "killed":
        private_redis.restart()
    else:
        private_redis.resume()
    back_at = timezone.now()
    buyers.join(timeout=120)
    assert not buyers.is_alive()
    (result,) = results

    # Then no buyer saw a server error but `503 busy` with Retry-After, and exactly the stock
    # was sold
    context = f"{dict(result.statuses)} {dict(result.errors)}"
    assert result.transport_failures == 0, context
    assert set(result.statuses) <= {201, 409, 503}, context
    assert set(result.errors) <= {"sold_out", "busy"}, context
    assert result.busy_without_retry_after == 0 and result.not_json == 0, context
    assert result.accepted == STOCK, context
    audit = audit_sale(sku)
    assert audit["oversold"] == 0, audit
    assert audit["accepted_units"] == STOCK, audit
    assert audit["remaining"] == 0 and audit["db_stock"] == 0, audit
    # the database served while Redis was away, and Redis served again once it was back
    orders = Order.objects.filter(item__sku=sku)
    assert orders.filter(fallback=True).exists(), audit
    assert orders.filter(fallback=False, created_at__gt=back_at).exists() or (
        not orders.filter(created_at__gt=back_at).exists()
    ), audit
    # and Redis agrees with the database after recovery
    assert audit["consistent"], audit
    if strategy != "lock":
        assert audit["redis_stock"] == audit["db_stock"], audit
