"""Items sold from stock rows (`segmented` shards, `lua` stripes): a flood writes the rows and
never the item row, the database refuses what a wrong Redis grants, and the item's stock is
derived from the rows."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from inventory import keys, stock
from inventory.exceptions import Busy, SoldOut
from inventory.models import Item, Order, OrderStatus
from inventory.orders import give_back_to_redis, reconcile_sale
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import segmented
from inventory.strategies.counters import counter
from loadtest.flood import flood
from tests.support import BUSY_RETRIES

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("strategy", ["segmented", "lua"])
def test_a_flood_writes_the_stock_rows_and_leaves_the_item_row_alone(shop_server, strategy):
    # Given a sale from stock rows
    sku = f"rows-{strategy}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=80, strategy=strategy)
    before = Item.objects.get(sku=sku)

    # When a crowd buys it out
    result = flood(shop_server.url, sku, attempts=240, concurrency=24, retry_busy=BUSY_RETRIES)

    # Then exactly the stock was sold, and the item row was never written: its stock and
    # version are those the sale started with, while its derived stock is 0
    assert result.accepted == 80 and result.server_errors == 0, dict(result.statuses)
    after = Item.objects.get(sku=sku)
    assert (after.stock, after.version) == (before.stock, before.version) == (80, before.version)
    assert after.units_left == 0
    audit = audit_sale(sku)
    assert audit["db_stock"] == 0 and audit["oversold"] == 0 and audit["consistent"], audit
    # and the reconciler folds the rows' total into the item row
    assert reconcile_sale(sku) == []
    assert Item.objects.get(sku=sku).stock == 0


def test_lua_counters_set_too_high_are_refused_by_the_database():
    # Given a lua sale of 20 units whose Redis counters claim 1000 units per stripe
    sku = f"too-high-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=20, strategy="lua")
    item = Item.objects.get(sku=sku)
    counter().set_many({name: 1000 for name in keys.stripe_counters(item)})

    # When 16 threads buy one unit each until they are told sold out
    def buyer(number: int) -> int:
        bought = 0
        try:
            for attempt in range(200):
                try:
                    place_order(sku=sku, qty=1, buyer=f"t{number}-{attempt}")
                    bought += 1
                except Busy:
                    continue
                except SoldOut:
                    return bought
            return bought
        finally:
            connection.close()

    with ThreadPoolExecutor(16) as pool:
        bought = sum(pool.map(buyer, range(16)))

    # Then the database sold exactly its 20 units and not one more
    assert bought == 20
    assert Order.objects.filter(item=item).count() == 20
    audit = audit_sale(sku)
    assert audit["oversold"] == 0 and audit["accepted_units"] == 20, audit
    assert audit["db_stock"] == 0, audit
    # and once settled the reconciler leaves Redis agreeing with the database
    reconcile_sale(sku)
    audit = audit_sale(sku)
    assert audit["redis_stock"] == 0 and audit["consistent"], audit


def test_a_shard_hint_copied_late_never_undoes_a_give_back_copied_before_it(monkeypatch):
    # Given a segmented sale whose buyers all start at shard 3, and a first order taken from it
    sku = f"late-hint-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=20, strategy="segmented")
    monkeypatch.setattr(segmented.random, "randrange", lambda _: 3)
    first = place_order(sku=sku, qty=1, buyer="first").order
    assert first.shard_units == {"3": 1}

    # and a second sale from shard 3 held up after its commit, before it copies its level (which
    # goes to Redis with the shard's release)
    paused, go = threading.Event(), threading.Event()
    release = segmented._release

    def held_up(checkouts, tokens, held):
        if threading.current_thread().name == "second":
            assert any(levels for _, _, levels in held), "the level is copied with the release"
            paused.set()
            assert go.wait(30)
        return release(checkouts, tokens, held)

    monkeypatch.setattr(segmented, "_release", held_up)

    def second() -> None:
        try:
            place_order(sku=sku, qty=1, buyer="second")
        finally:
            connection.close()

    buyer = threading.Thread(target=second, name="second")
    buyer.start()
    assert paused.wait(30)

    # When the first order fails meanwhile: its unit goes back to the row, then to its hint
    with transaction.atomic():
        Order.objects.filter(pk=first.pk).update(status=OrderStatus.FAILED)
        stock.return_units(first)
    assert give_back_to_redis([first]) == []
    # and only then does the second sale's copy (of the level before the give-back) land
    go.set()
    buyer.join(30)

    # Then shard 3's hint is its row's level, not the second sale's older copy
    item = Item.objects.get(sku=sku)
    assert stock.shard_stocks(item.current_sale_id)[3] == 1
    assert counter().get(keys.shard_hint(item, 3)) == 1
    audit = audit_sale(sku)
    assert audit["consistent"] and audit["redis_stock"] == audit["db_stock"] == 19, audit
