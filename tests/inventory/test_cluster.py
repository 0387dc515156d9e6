"""Every strategy on a real Redis Cluster: 3 masters and 3 replicas started from the redis-server
binary, a real gunicorn whose only Redis is the cluster (REDIS_CLUSTER_NODES), floods of
separate buyer processes, a master SIGKILLed mid-flood (its replica takes over, the database
fallback serves the gap), and `segmented`'s shards spread over the masters."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import requests
from django.utils import timezone

from inventory import keys
from inventory.models import Item, Order
from inventory.redis_client import get_redis_client
from inventory.selectors import audit_sale
from inventory.services import start_sale
from loadtest.flood import flood
from locking.cluster import slot
from shop.processes.redis_cluster import LocalCluster
from tests.conftest import server_env, start_shop, wait_until
from tests.support import (
    BUSY_RETRIES,
    crowd_in_rounds,
    flood_sells_exactly_the_stock,
    run_in_thread,
    sold_out,
)

STOCK = 50
BUYERS = 24
ATTEMPTS = 160

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(masters=3, replicas=1) as local:
        yield local


@pytest.fixture(autouse=True)
def _shop_on_the_cluster(cluster, settings):
    """This process (start_sale, the audit) uses the cluster as the servers do."""
    settings.REDIS_CLUSTER_NODES = cluster.nodes_setting.split(",")
    yield
    # A node killed by a test is back (as a replica) before the next one starts.
    for node in cluster.nodes:
        node.start()
    assert wait_until(cluster.healthy, timeout=30)


@pytest.fixture(scope="module")
def cluster_shop(cluster, django_db_setup, django_db_blocker):
    server = start_shop(
        REDIS_CLUSTER_NODES=cluster.nodes_setting,
        FLASHSALE_REDIS_TIMEOUT=0.3,
        FLASHSALE_BREAKER_PROBE_SECONDS=0.3,
    )
    yield server
    server.stop()


def _check_sold_exactly(sku: str, result, stock: int) -> dict:
    context = f"{dict(result.statuses)} {dict(result.errors)}"
    assert result.transport_failures == 0, context
    assert result.server_errors == 0, context
    assert result.accepted == stock, context
    audit = audit_sale(sku)
    assert audit["oversold"] == 0, audit
    assert audit["accepted_units"] == stock, audit
    assert audit["remaining"] == 0 and audit["db_stock"] == 0, audit
    stored = {
        str(pid) for pid in Order.objects.filter(item__sku=sku).values_list("public_id", flat=True)
    }
    assert sorted(result.order_ids) == sorted(stored), context
    return audit


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_every_strategy_sells_exactly_its_stock_on_a_cluster(cluster_shop, strategy):
    for round_number in range(2):
        # Given a sale on the cluster, and more buyers than units
        sku = f"cl-{strategy}-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=STOCK, strategy=strategy)

        # When they all try to buy one
        result = flood(
            cluster_shop.url, sku, attempts=ATTEMPTS, concurrency=BUYERS, retry_busy=BUSY_RETRIES
        )

        # Then exactly the stock is sold, the rest told sold out, the audit consistent
        assert result.errors == {"sold_out": ATTEMPTS - STOCK}, (round_number, result.errors)
        audit = _check_sold_exactly(sku, result, STOCK)
        assert audit["consistent"], audit
        # and Redis served every sale: the cluster did the work, not the database fallback
        assert not Order.objects.filter(item__sku=sku, fallback=True).exists()
        if strategy in ("segmented", "lua"):
            assert audit["redis_stock"] == 0, audit


def test_segmented_spreads_an_items_shards_over_the_masters(cluster, cluster_shop):
    # Given a segmented sale of 100 units (10 shards), partly sold
    sku = f"cl-spread-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=100, strategy="segmented")
    result = flood(cluster_shop.url, sku, attempts=40, concurrency=8, retry_busy=BUSY_RETRIES)
    assert result.accepted == 40, dict(result.statuses)

    # Then each shard's hint shares its master with its shard's lock, and the shards of the
    # one item live on at least two masters
    item = Item.objects.get(sku=sku)
    hints, locks = keys.shard_hints(item), keys.shard_locks(item)
    hint_ports = [cluster.port_of(key) for key in hints]
    assert hint_ports == [cluster.port_of(key) for key in locks]
    assert len(set(hint_ports)) >= 2, hint_ports
    # and each hint is really there, on the master the slot map names
    levels = []
    for key, port in zip(hints, hint_ports, strict=True):
        value = cluster.node_client(cluster.node_on(port)).get(key)
        assert value is not None, key
        levels.append(int(value))
    assert sum(levels) == 60
    # while the item row was not written per sale
    assert Item.objects.get(sku=sku).stock == 100


@pytest.mark.parametrize("strategy", ["segmented", "lua"])
def test_the_pages_health_check_and_reconciler_work_on_a_cluster(cluster, cluster_shop, strategy):
    # Given a sale on the cluster, partly sold
    sku = f"cl-pages-{strategy}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy=strategy)
    result = flood(cluster_shop.url, sku, attempts=10, concurrency=5, retry_busy=BUSY_RETRIES)
    assert result.accepted == 10, dict(result.statuses)

    # Then the health check sees the cluster, and the API and the item page show the stock
    # the database holds
    health = requests.get(f"{cluster_shop.url}/healthz", timeout=10).json()
    assert health["redis"] == "ok" and not health["fallback_active"], health
    item = requests.get(f"{cluster_shop.url}/api/items/{sku}", timeout=10).json()
    assert item["stock"] == STOCK - 10, item
    page = requests.get(f"{cluster_shop.url}/items/{sku}/", timeout=10)
    assert page.status_code == 200 and sku in page.text

    # When one of its counters on the cluster goes wrong (too high: Redis would grant units
    # the database does not hold)
    client = get_redis_client()
    sold = Item.objects.get(sku=sku)
    counter = (keys.shard_hint if strategy == "segmented" else keys.stripe_counter)(sold, 3)
    client.incrby(counter, 7)
    assert not audit_sale(sku)["consistent"]

    # Then `sale reconcile` finds it, on whichever master its slot lives, and repairs it
    repaired = subprocess.run(
        [sys.executable, "manage.py", "sale", "reconcile", sku],
        env=server_env(REDIS_CLUSTER_NODES=cluster.nodes_setting),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert repaired.returncode == 0, repaired.stderr
    assert repaired.stdout.strip(), repaired.stdout
    audit = audit_sale(sku)
    assert audit["consistent"] and audit["redis_stock"] == STOCK - 10, audit


def test_lua_batches_take_each_sales_units_in_its_own_slot(cluster):
    # Given a threaded shop on the cluster, and two lua sales at once whose counters live in
    # two slots (a batch of a web process holds sales of both)
    shop = start_shop(kind="gthread", threads=4, REDIS_CLUSTER_NODES=cluster.nodes_setting)
    try:
        skus = [f"cl-batched-{uuid.uuid4().hex[:8]}" for _ in range(2)]
        for sku in skus:
            start_sale(sku=sku, stock=STOCK, strategy="lua")
        items = [Item.objects.get(sku=sku) for sku in skus]
        assert len({slot(keys.turn(item)) for item in items}) == 2

        # When a crowd floods each
        floods = [
            run_in_thread(
                lambda sku=sku: flood_sells_exactly_the_stock(
                    shop.url, sku, stock=STOCK, attempts=ATTEMPTS, buyers=BUYERS // 2
                )
            )
            for sku in skus
        ]
        for thread, outcome in floods:
            thread.join(120)
            # Then each sells exactly its stock (asserted inside), through Redis alone
            assert "error" not in outcome, outcome.get("error")
        for sku in skus:
            assert not Order.objects.filter(item__sku=sku, fallback=True).exists()
        # and checkouts in flight together shared commits (a batch's orders share its time)
        orders = Order.objects.filter(item__sku__in=skus)
        commits = orders.values("created_at").distinct().count()
        assert orders.count() == 2 * STOCK and commits < 2 * STOCK
    finally:
        shop.stop()


def _wait_for_stock_at_most(sku: str, units: int, timeout: float) -> bool:
    return wait_until(
        lambda: Item.objects.get(sku=sku).units_left <= units, timeout=timeout, interval=0.02
    )


@pytest.mark.slow  # a fault matrix: with the other failovers, in the slow step
@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua"])
def test_a_master_killed_mid_sale_fails_over_and_nothing_is_oversold_or_lost(
    cluster, cluster_shop, strategy
):
    # Given a sale and a paced crowd that buys in rounds until it is told the sale is sold out
    stock = 600
    sku = f"cl-failover-{strategy}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=stock, strategy=strategy)
    item = Item.objects.get(sku=sku)
    hot_key = {
        "lock": keys.item_lock,
        "segmented": lambda sold: keys.shard_hint(sold, 0),
        "lua": keys.turn,
    }[strategy](item)
    buyers, result = crowd_in_rounds(
        cluster_shop.url,
        sku,
        until=sold_out,
        attempts=240,
        concurrency=8,
        pause=0.08,
        within=150,
        retry_busy=BUSY_RETRIES,
    )

    # When the master serving the sale's hot slot is SIGKILLed once a tenth is sold
    assert _wait_for_stock_at_most(sku, stock * 9 // 10, timeout=30)
    dead = cluster.kill_master_of(hot_key)
    # and its replica takes over (a real cluster failover) while units are left to sell
    cluster.wait_for_failover(dead)
    over_at = timezone.now()
    assert Item.objects.get(sku=sku).units_left > 0
    buyers.join(timeout=180)
    assert not buyers.is_alive()

    # Then no buyer saw a server error, exactly the stock was sold, every 201 is an order
    audit = _check_sold_exactly(sku, result, stock)
    orders = Order.objects.filter(item__sku=sku)
    # and the shop sold through the gap by the database fallback, then through Redis again
    if strategy != "segmented":  # its other shards' masters kept serving: maybe no gap
        assert orders.filter(fallback=True).exists(), audit
    assert orders.filter(created_at__gt=over_at, fallback=False).exists(), audit
    # and Redis agrees with the database once the shop has rebuilt it (the promoted replica's
    # counters are never trusted as they are)
    consistent = wait_until(lambda: audit_sale(sku)["consistent"], timeout=15)
    assert consistent, json.dumps(audit_sale(sku), default=str)


def test_the_shop_refuses_a_cluster_without_a_broker_of_its_own(cluster):
    env = server_env(REDIS_CLUSTER_NODES=cluster.nodes_setting)
    env.pop("CELERY_BROKER_URL")
    env["DJANGO_SETTINGS_MODULE"] = "shop.settings"
    checked = subprocess.run(
        [sys.executable, "manage.py", "check"], env=env, capture_output=True, text=True
    )
    assert checked.returncode != 0
    assert "CELERY_BROKER_URL" in checked.stderr
    assert "cannot use a Redis Cluster" in checked.stderr


def test_a_malformed_cluster_node_is_named(settings):
    from django.core.exceptions import ImproperlyConfigured

    settings.REDIS_CLUSTER_NODES = ["127.0.0.1:7000", "no-port-here"]
    with pytest.raises(ImproperlyConfigured, match="'no-port-here' is not host:port"):
        get_redis_client()
