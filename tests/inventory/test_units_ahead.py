"""Units taken ahead (`inventory.strategies.ahead`): `lua` units a process took out of Redis
for its next checkouts, on real PostgreSQL and Redis. A second `Holding` stands for a second
process: it registers and holds units the way a process's batches do."""

from __future__ import annotations

import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, transaction

from inventory import keys
from inventory.exceptions import Busy, SoldOut
from inventory.models import Item, Order, SaleRepair, StockShard
from inventory.orders import reconcile_sale
from inventory.redis_client import get_redis_client
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import get_strategy, lua
from inventory.strategies.ahead import BATCHES_AHEAD, MOST_SHARE, Holding, holders, holding
from tests.conftest import wait_until


def _hold(other: Holding, item: Item, units: int) -> None:
    """`other` takes `units` ahead, registered by the take, as a batch of its process does."""
    held = other.held(item)
    assert other.take(item, [], units) == []
    assert other.held(item) == held + units, "the counters hold the units"


def _redis_units(item: Item) -> int | None:
    return get_strategy("lua").redis_stock(item=item)


def _sale_with_units_held(monkeypatch, sku: str) -> Item:
    """A sale of 1,000 units whose first checkout, alone, took units ahead as a batch of
    several does; this process holds them for the rest of the test."""
    monkeypatch.setattr(holding, "least_batch", 1)
    monkeypatch.setattr(holding, "idle", 10.0)
    start_sale(sku=sku, stock=1000, strategy="lua")
    item = Item.objects.get(sku=sku)
    place_order(sku=sku, qty=1, buyer="first")
    assert holding.held(item) == BATCHES_AHEAD
    return item


@pytest.mark.django_db(transaction=True)
def test_a_checkout_holds_units_ahead_and_gives_them_back_when_idle(monkeypatch):
    # Given a sale of 1,000 units, a lone checkout taking units ahead as a batch of several
    # does (and units held go back after a second idle: a loaded host may pause the test
    # longer than the 50 ms it takes)
    monkeypatch.setattr(holding, "least_batch", 1)
    monkeypatch.setattr(holding, "idle", 1.0)
    start_sale(sku="ahead-idle", stock=1000, strategy="lua")
    item = Item.objects.get(sku="ahead-idle")

    # When one checkout buys a unit
    place_order(sku="ahead-idle", qty=1, buyer="first")

    # Then its script took the next batches' units too: out of Redis, held by this process
    assert holding.held(item) == BATCHES_AHEAD
    assert _redis_units(item) == 999 - BATCHES_AHEAD
    # and the next checkout is served from them, with no unit taken from Redis
    place_order(sku="ahead-idle", qty=1, buyer="second")
    assert holding.held(item) == BATCHES_AHEAD - 1
    assert _redis_units(item) == 999 - BATCHES_AHEAD

    # And once nothing is served from them for a moment, they are back in Redis
    assert wait_until(lambda: holding.held(item) == 0, timeout=10, interval=0.01)
    assert wait_until(lambda: _redis_units(item) == 998, timeout=10, interval=0.01)
    audit = audit_sale("ahead-idle")
    assert (audit["accepted_units"], audit["db_stock"], audit["redis_stock"]) == (2, 998, 998)
    assert audit["consistent"], audit
    # with the registration ended: nobody holds units of the sale
    assert holders(item) == (0, 0)


@pytest.mark.django_db(transaction=True)
def test_a_lone_checkout_takes_only_its_own_units_and_a_batch_of_several_takes_ahead(
    monkeypatch,
):
    monkeypatch.setattr(holding, "idle", 10.0)
    # Given a sale of 1,000 units
    start_sale(sku="ahead-batch", stock=1000, strategy="lua")
    item = Item.objects.get(sku="ahead-batch")

    # When a checkout comes alone, as every checkout of a process that does not batch does
    place_order(sku="ahead-batch", qty=1, buyer="alone")

    # Then it took its own unit only
    assert holding.held(item) == 0
    assert _redis_units(item) == 999

    # When a checkout's statement waits on the sale's stock rows (locked here) while two more
    # checkouts come, which are then written together
    def buy(name: str) -> None:
        try:
            place_order(sku="ahead-batch", qty=1, buyer=name)
        finally:
            connection.close()

    with ThreadPoolExecutor(3) as pool:
        with transaction.atomic():
            list(StockShard.objects.select_for_update().filter(sale_id=item.current_sale_id))
            first = pool.submit(buy, "first")
            assert wait_until(lambda: lua._batcher._leading, timeout=30, interval=0.01)
            rest = [pool.submit(buy, name) for name in ("second", "third")]
            assert wait_until(lambda: len(lua._batcher._queue) == 2, timeout=30, interval=0.01)
        for future in [first, *rest]:
            future.result(timeout=30)

    # Then the lone first took its own unit, and the batch of two took units ahead beside
    # theirs: BATCHES_AHEAD times its units, at most a hundredth of the sale
    ahead = min(BATCHES_AHEAD * 2, int(1000 * MOST_SHARE))
    assert holding.held(item) == ahead
    assert _redis_units(item) == 1000 - 4 - ahead
    assert Order.objects.filter(item=item).count() == 4


@pytest.mark.django_db(transaction=True)
def test_a_short_take_is_busy_while_another_process_holds_the_last_units():
    # Given a sale of 20 units, 6 of them held ahead by another process, which is not giving
    # them back
    start_sale(sku="ahead-end", stock=20, strategy="lua")
    item = Item.objects.get(sku="ahead-end")
    other = Holding(idle=3600, most=3600)
    _hold(other, item, 6)

    # When this process's buyers buy what Redis still counts
    for number in range(14):
        place_order(sku="ahead-end", qty=1, buyer=f"buyer-{number}")

    # Then the next checkout, once it has waited a moment for them, is told busy, not sold
    # out: the other process holds units
    with pytest.raises(Busy):
        place_order(sku="ahead-end", qty=1, buyer="early")

    # And once it gives them back, they are sold, and only then is the sale sold out
    assert other.give_back(item) == 6
    for number in range(6):
        place_order(sku="ahead-end", qty=1, buyer=f"late-{number}")
    with pytest.raises(SoldOut):
        place_order(sku="ahead-end", qty=1, buyer="too-late")
    audit = audit_sale("ahead-end")
    assert (audit["accepted_units"], audit["oversold"], audit["remaining"]) == (20, 0, 0)
    assert audit["redis_stock"] == audit["db_stock"] == 0
    assert audit["consistent"], audit


@pytest.mark.django_db(transaction=True)
def test_a_short_take_waits_for_another_process_s_units_to_come_back_and_buys_one(monkeypatch):
    # Given a sale of 20 units: 14 sold, the last 6 held ahead by another process, which gives
    # them back once unused for 0.1 s (and a checkout here waits for them as long as it takes)
    monkeypatch.setattr(lua, "HELD_WAIT_SECONDS", 60.0)
    start_sale(sku="ahead-back", stock=20, strategy="lua")
    item = Item.objects.get(sku="ahead-back")
    for number in range(14):
        place_order(sku="ahead-back", qty=1, buyer=f"buyer-{number}")
    other = Holding(idle=0.1)
    _hold(other, item, 6)

    # When a checkout finds the counters short while they are held
    order = place_order(sku="ahead-back", qty=1, buyer="late").order

    # Then it bought one of them, once the other process gave them back
    assert order.qty == 1
    assert other.held(item) == 0
    assert holders(item) == (0, 0)
    audit = audit_sale("ahead-back")
    assert (audit["accepted_units"], audit["db_stock"], audit["redis_stock"]) == (15, 5, 5)
    assert audit["consistent"], audit


@pytest.mark.django_db(transaction=True)
def test_units_this_process_holds_go_back_when_a_checkout_finds_the_counters_short(monkeypatch):
    monkeypatch.setattr(holding, "idle", 10.0)
    # Given a sale of 12 units, one sold and 8 of the rest held ahead by this process
    start_sale(sku="ahead-mine", stock=12, strategy="lua")
    item = Item.objects.get(sku="ahead-mine")
    place_order(sku="ahead-mine", qty=1, buyer="first")
    _hold(holding, item, 8)

    # When a checkout of 10 units cannot be served from the 8 held, and Redis counts 3
    order = place_order(sku="ahead-mine", qty=10, buyer="bulk").order

    # Then the held units went back to the counters, and it bought 10 of the 11 left
    assert order.qty == 10
    assert holding.held(item) == 0
    audit = audit_sale("ahead-mine")
    assert (audit["accepted_units"], audit["db_stock"], audit["redis_stock"]) == (11, 1, 1)
    assert audit["consistent"], audit


@pytest.mark.django_db(transaction=True)
def test_the_reconciler_waits_for_units_held_and_counters_set_from_the_database_void_them():
    # Given a sale of 50 units, 10 held ahead by another process
    start_sale(sku="ahead-repair", stock=50, strategy="lua")
    item = Item.objects.get(sku="ahead-repair")
    other = Holding(idle=3600, most=3600)
    _hold(other, item, 10)
    assert holders(item) == (1, 0)

    # When the periodic reconciler runs meanwhile
    changes = reconcile_sale("ahead-repair", cause=SaleRepair.Cause.RECONCILER)

    # Then it repairs nothing: Redis counts 40 while the units are held
    assert changes == []
    assert _redis_units(item) == 40

    # And a repair asked for otherwise (an operator's, a process starting) sets the counters
    # from the database, which counts the 10: the holder's give-back then adds nothing on top
    assert reconcile_sale("ahead-repair") == ["ahead-repair: Redis stock 40 -> 50"]
    assert holders(item) == (0, 0)
    assert _redis_units(item) == 50
    assert other.give_back(item) == 0
    assert _redis_units(item) == 50
    assert reconcile_sale("ahead-repair") == []
    assert audit_sale("ahead-repair")["consistent"]


@pytest.mark.django_db(transaction=True)
def test_a_holder_that_died_holds_the_sale_up_only_until_its_lease_ends():
    # Given another process that took 5 units ahead and died (it never gives them back), its
    # lease 2 s
    start_sale(sku="ahead-dead", stock=5, strategy="lua")
    item = Item.objects.get(sku="ahead-dead")
    _hold(Holding(idle=3600, most=3600, lease_ms=2000), item, 5)

    # When a checkout comes meanwhile, it is told busy
    with pytest.raises(Busy):
        place_order(sku="ahead-dead", qty=1, buyer="early")

    # And once the lease has run out, the periodic reconciler rebuilds the counters from the
    # database
    assert reconcile_sale("ahead-dead", cause=SaleRepair.Cause.RECONCILER) == []
    assert wait_until(lambda: holders(item) == (0, 1), timeout=10, interval=0.05)
    changes = reconcile_sale("ahead-dead", cause=SaleRepair.Cause.RECONCILER)
    assert changes == ["ahead-dead: Redis stock 0 -> 5"]
    # and the 5 units are sold
    for number in range(5):
        place_order(sku="ahead-dead", qty=1, buyer=f"buyer-{number}")
    audit = audit_sale("ahead-dead")
    assert (audit["accepted_units"], audit["oversold"], audit["remaining"]) == (5, 0, 0)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("round_", range(3))
def test_two_holders_sell_exactly_the_stock_and_leave_nothing_stranded(round_):
    # Given a sale of 2,000 units; this process's buyers (8 threads, whose batches take 20
    # units ahead at most: a hundredth of the sale) and another process's, whose checkouts
    # take from what it holds and take 8 ahead as a batch does
    start_sale(sku="ahead-two", stock=2000, strategy="lua")
    item = Item.objects.get(sku="ahead-two")
    other = Holding()
    other_sold: list[int] = []
    start = threading.Barrier(9)

    def other_process() -> None:
        start.wait(30)
        while True:
            plan = other.serve(item, 1)
            if plan is None:
                try:
                    _hold(other, item, BATCHES_AHEAD)
                except AssertionError:  # Redis short: what it holds goes back, it stops
                    other.give_back(item)
                    return
                continue
            other_sold.append(sum(plan.values()))  # sold without the database: counted here

    sold: list[Order] = []

    def buyer(number: int) -> None:
        try:
            start.wait(30)
            attempt = 0
            while True:
                attempt += 1
                try:
                    sold.append(place_order(sku="ahead-two", qty=1, buyer=f"{number}-{attempt}"))
                except Busy:
                    time.sleep(0.001)
                    continue
                except SoldOut:
                    return
        finally:
            connection.close()

    # When both sell until sold out
    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(buyer, number) for number in range(8)]
        futures.append(pool.submit(other_process))
        for future in futures:
            future.result(timeout=120)

    # Then every unit went to exactly one of them: none oversold, none stranded
    assert len(sold) + sum(other_sold) == 2000
    assert Order.objects.filter(item__sku="ahead-two").count() == len(sold)
    assert holding.held(item) == other.held(item) == 0
    assert _redis_units(item) == 0


@pytest.mark.django_db(transaction=True)
def test_units_held_when_redis_lost_its_keys_neither_strand_nor_double_the_counters(monkeypatch):
    # Given a sale of 1,000 units, 8 of them held ahead by this process (its registration
    # renewed less than a second ago)
    item = _sale_with_units_held(monkeypatch, "ahead-lost")
    assert _redis_units(item) == 999 - BATCHES_AHEAD

    # When Redis loses every key of the sale (a restart, empty; the client reconnects to it
    # without an error), another process's checkout rebuilds the counters from the database,
    # which counts the 8 units held, and a checkout here with an idempotency key (never served
    # from units held) takes a unit and 8 more ahead
    client = get_redis_client()
    client.delete(*client.scan_iter(match=keys.every_sale_pattern(item)))
    lua.LuaStrategy._seed(item)
    assert _redis_units(item) == 999
    place_order(sku="ahead-lost", qty=1, buyer="after", idempotency_key="after-1")

    # Then this process holds the 8 taken since, under a registration Redis has: the 8 taken
    # before are counted by the counters rebuilt, not held on top
    assert holding.held(item) == BATCHES_AHEAD
    assert holders(item) == (1, 0)
    assert _redis_units(item) == 998 - BATCHES_AHEAD
    # and once they go back, Redis counts what the database does: none stranded, none twice
    assert holding.give_back(item) == BATCHES_AHEAD
    audit = audit_sale("ahead-lost")
    assert (audit["accepted_units"], audit["db_stock"], audit["redis_stock"]) == (2, 998, 998)
    assert audit["consistent"], audit


@pytest.mark.django_db(transaction=True)
def test_a_checkout_inside_a_transaction_neither_holds_nor_serves_units_ahead(monkeypatch):
    # Given a sale of 1,000 units, 8 of them held ahead by this process
    item = _sale_with_units_held(monkeypatch, "ahead-atomic")

    # When a checkout runs inside the caller's transaction
    with transaction.atomic():
        place_order(sku="ahead-atomic", qty=1, buyer="in-a-transaction")

    # Then it took its own unit from Redis, and nothing more
    assert holding.held(item) == BATCHES_AHEAD
    assert _redis_units(item) == 1000 - 2 - BATCHES_AHEAD


def _held_in_a_child(item: Item, results: multiprocessing.Queue) -> None:
    results.put((holding.held(item), holding.token))


@pytest.mark.django_db(transaction=True)
def test_a_forked_process_holds_nothing_of_its_parent_s(monkeypatch):
    # Given units this process holds ahead
    item = _sale_with_units_held(monkeypatch, "ahead-fork")

    # When a process is forked from it
    results: multiprocessing.Queue = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(
        target=_held_in_a_child, args=(item, results)
    )
    child.start()
    held, token = results.get(timeout=30)
    child.join(30)

    # Then the child holds none of them, under a holder's name of its own
    assert held == 0 and token != holding.token
    assert holding.held(item) == BATCHES_AHEAD
