"""The `lock` strategy on a quorum lock (REDIS_LOCK_URLS: three independent redis-server
processes), through a real gunicorn flooded by buyer processes: its fences from the database,
one master killed mid-sale (sales go on), two killed (the database fallback serves), and
never a unit oversold."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from inventory import keys
from inventory.fences import next_fence
from inventory.models import Item, LockFence, Order
from inventory.selectors import audit_sale
from inventory.services import start_sale
from shop.processes.redis_server import RedisServer
from tests.conftest import server_env, start_shop, wait_until
from tests.support import crowd_in_rounds, sold_out

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def masters():
    servers = [RedisServer().start() for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def quorum_shop(masters, django_db_setup, django_db_blocker):
    server = start_shop(
        REDIS_LOCK_URLS=",".join(server.url for server in masters),
        FLASHSALE_REDIS_TIMEOUT=0.2,
        FLASHSALE_BREAKER_PROBE_SECONDS=0.3,
    )
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _masters_back(masters):
    yield
    for server in masters:
        server.start()


def _sold_exactly(sku: str, result, stock: int) -> dict:
    context = f"{dict(result.statuses)} {dict(result.errors)}"
    # A buyer who waited its second for the lock on a slow host is answered `busy` (a 503 with
    # Retry-After that sold nothing): the only server error allowed; the crowd buys on.
    assert result.transport_failures == result.not_json == 0, context
    assert result.server_errors == result.errors["busy"], context
    assert result.busy_without_retry_after == 0, context
    assert result.accepted == stock, context
    audit = audit_sale(sku)
    assert audit["oversold"] == 0 and audit["accepted_units"] == stock, audit
    assert audit["remaining"] == 0 and audit["db_stock"] == 0, audit
    stored = Order.objects.filter(item__sku=sku).values_list("public_id", flat=True)
    assert sorted(result.order_ids) == sorted(str(pid) for pid in stored), context
    return audit


def test_the_database_hands_out_growing_fences_per_lock_name():
    first = next_fence("q-name-a")
    second = next_fence("q-name-a")
    assert second > first and LockFence.objects.get(name="q-name-a").fence == second
    # on the scale of a single Redis's fences: the clock in microseconds
    assert next_fence("q-name-b") > 1_700_000_000 * 1_000_000


@pytest.mark.parametrize("killed", [0, 1, 2])
def test_a_lock_sale_on_a_quorum_of_masters(quorum_shop, masters, killed):
    # Given a lock sale whose item lock is held on a majority of three masters
    stock = 120
    sku = f"quorum-{killed}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=stock, strategy="lock")
    # and a crowd that buys in rounds until it is told the sale is sold out
    thread, result = crowd_in_rounds(
        quorum_shop.url, sku, until=sold_out, attempts=120, concurrency=8, pause=0.02, within=120
    )

    # When `killed` of the three masters are SIGKILLed once a sixth is sold
    assert wait_until(
        lambda: Item.objects.get(sku=sku).units_left <= stock * 5 // 6, timeout=30, interval=0.02
    )
    for server in masters[:killed]:
        server.kill()
    thread.join(150)
    assert not thread.is_alive()

    # Then no buyer saw a server error but `busy`, exactly the stock was sold, every 201 is an
    # order
    _sold_exactly(sku, result, stock)
    orders = Order.objects.filter(item__sku=sku)
    if killed < 2:
        # a majority still answers: the quorum lock served every sale, no fallback
        assert not orders.filter(fallback=True).exists()
    else:
        # no majority: the lock service is down, and the database fallback sold the rest
        assert orders.filter(fallback=True).exists()
    # and the sales under the lock were fenced by the database's tokens for its name
    name = keys.item_lock(Item.objects.get(sku=sku))
    last = LockFence.objects.get(name=name).fence
    assert 0 < Item.objects.get(sku=sku).fence <= last


def test_the_shop_refuses_a_quorum_of_fewer_than_three_masters():
    env = server_env(REDIS_LOCK_URLS="redis://127.0.0.1:1/0,redis://127.0.0.1:2/0")
    env["DJANGO_SETTINGS_MODULE"] = "shop.settings"
    checked = subprocess.run(
        [sys.executable, "manage.py", "check"], env=env, capture_output=True, text=True
    )
    assert checked.returncode != 0
    assert "REDIS_LOCK_URLS lists 2 masters: a quorum lock needs at least 3" in checked.stderr
