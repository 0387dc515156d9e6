"""The lock strategies with the wake hub on (`locks.WAKE_HUB`): the checkouts of one threaded
process wait through its one wake-up channel, and still sell exactly the stock; on a Redis
Cluster the hub is refused."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from inventory import keys
from inventory.exceptions import Busy, SoldOut
from inventory.models import Item
from inventory.redis_client import get_redis_client
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import locks
from inventory.strategies.segmented import shard_lock
from locking.wakes import hub_for

pytestmark = pytest.mark.django_db(transaction=True)

STOCK, ATTEMPTS, THREADS = 40, 120, 16


@pytest.mark.parametrize("strategy", ["lock", "segmented"])
def test_threads_of_one_process_sell_exactly_the_stock_through_the_wake_hub(
    settings, monkeypatch, strategy
):
    # Given a process whose lock waiters share its wake hub, and every lock its checkouts take
    # held for now
    monkeypatch.setattr(locks, "WAKE_HUB", True)
    settings.FLASHSALE_HOLD_DELAY_MS = 2
    settings.FLASHSALE_LOCK_WAIT_MS = 5000
    sku = f"hub-{strategy}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy=strategy)
    item = Item.objects.get(sku=sku)
    if strategy == "lock":
        held = [locks.new_lock(keys.item_lock(item), strategy="lock", quorum=True, peers=True)]
    else:
        held = [shard_lock(item, index) for index in range(item.shard_count)]
    for lock in held:
        assert lock.acquire(blocking=False)
    redis = get_redis_client()
    hub = hub_for(redis, keys.key("lock-wakes"))
    delivered_before = hub.delivered

    # When 16 of its threads try 120 checkouts of one unit, and the held locks are released
    # once a checkout queues for one
    def attempt(number: int) -> str:
        try:
            place_order(sku=sku, qty=1, buyer=f"b{number}")
            return "sold"
        except SoldOut:
            return "sold_out"
        except Busy:
            return "busy"
        finally:
            connection.close()

    with ThreadPoolExecutor(THREADS) as pool:
        running = pool.map(attempt, range(ATTEMPTS))
        give_up = time.monotonic() + 30
        while not any(redis.llen(f"{lock.name}:queue") for lock in held):
            assert time.monotonic() < give_up, "no checkout queued for a held lock"
            time.sleep(0.005)
        for lock in held:
            lock.release()
        outcomes = list(running)

    # Then exactly the stock was sold, the rest refused as sold out, and the hand-overs came
    # through the hub
    assert outcomes.count("sold") == STOCK, outcomes
    assert outcomes.count("sold_out") == ATTEMPTS - STOCK, outcomes
    audit = audit_sale(sku)
    assert audit["oversold"] == 0 and audit["remaining"] == 0 and audit["consistent"], audit
    assert hub.delivered > delivered_before


def test_the_wake_hub_is_refused_on_a_redis_cluster(settings, monkeypatch):
    # Given the wake hub on, and the shop on a Redis Cluster (its locks in many slots, the
    # hub's one list in one)
    monkeypatch.setattr(locks, "WAKE_HUB", True)
    settings.REDIS_CLUSTER_NODES = ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]

    # When a strategy builds a lock, then it is refused, and says why
    with pytest.raises(ImproperlyConfigured, match="cannot be used with REDIS_CLUSTER_NODES"):
        locks.new_lock("hub-on-a-cluster", strategy="lock")
