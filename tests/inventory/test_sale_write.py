"""The sale statement and the order publisher, on real PostgreSQL, Redis and Celery messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from django.db import connections
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext

import inventory.services
from inventory import publishing, row_locks, sale_values, stock
from inventory.exceptions import BUSY_RETRY_AFTER, Busy
from inventory.models import BuyerAllowance, Item, Order, OrderStatus, PaymentAttempt, StockShard
from inventory.redis_client import get_redis_client
from inventory.sale_statement import SaleRecorder, sell
from inventory.sale_values import Allocation
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import get_strategy
from inventory.tasks import dispatch_orders_task, settle_orders_task
from loadtest.flood import flood
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import TASK_QUEUE, server_env, start_shop
from tests.support import task_messages_carrying

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded_smoke]


def _rows(sku: str) -> tuple[int, dict[int, int], int, int]:
    item = Item.objects.get(sku=sku)
    shards = dict(
        StockShard.objects.filter(sale_id=item.current_sale_id).values_list("index", "stock")
    )
    return item.units_left, shards, Order.objects.filter(item=item).count(), item.version


def test_a_write_refused_part_way_changes_nothing():
    # Given a sharded item whose shard 1 is empty while shard 0 has units
    start_sale(sku="split", stock=20, strategy="segmented")
    item = Item.objects.get(sku="split")
    StockShard.objects.filter(sale_id=item.current_sale_id, index=1).update(stock=0)
    before = _rows("split")

    # When one statement asks for a unit from each (shard 0 passes its guard, shard 1 fails)
    with pytest.raises(sale_values.HalfDone):
        _sell(item, 2, "b", Allocation("optimistic", shard_units={0: 1, 1: 1}))

    # Then PostgreSQL undid shard 0's decrement too: nothing changed, no order
    assert _rows("split") == before


def test_a_stale_version_refuses_the_whole_sale():
    start_sale(sku="stale", stock=5, strategy="optimistic", limit=2)
    item = Item.objects.get(sku="stale")
    before = _rows("stale")

    refused = _sell(item, 1, "b", Allocation("optimistic", expected_version=999), limit=2)

    assert refused is None
    assert _rows("stale") == before
    assert not BuyerAllowance.objects.filter(item=item).exists()


def test_a_sale_writes_stock_allowance_and_order_at_once():
    start_sale(sku="once", stock=5, strategy="optimistic", limit=3)
    item = Item.objects.get(sku="once")

    sold = _sell(item, 2, "ann", Allocation("optimistic"), limit=3)

    assert sold is not None and sold.item_stock == 3
    order = Order.objects.get(pk=sold.order.pk)
    assert (order.buyer, order.qty, order.status) == ("ann", 2, "pending")
    assert BuyerAllowance.objects.get(sale=item.current_sale, buyer="ann").units == 2
    assert Item.objects.get(pk=item.pk).units_left == 3


def test_a_fenced_sale_is_refused_once_its_row_accepted_a_later_lock_holder():
    # Given an item sold under a lock, whose row accepted the sale of the holder with fence 100
    start_sale(sku="fenced", stock=5, strategy="lock")
    item = Item.objects.get(sku="fenced")
    assert _sell(item, 1, "later", Allocation("lock", fence=100)) is not None
    before = _rows("fenced")

    # When a holder with an older fence (its lock expired under it) writes: nothing changes
    with pytest.raises(sale_values.Fenced):
        _sell(item, 1, "paused", Allocation("lock", fence=99))
    assert _rows("fenced") == before and Item.objects.get(pk=item.pk).fence == 100

    # The same holder again, a later one, and a write under no lock (the fallback) all pass;
    # only fenced writes move the row's fence
    assert _sell(item, 1, "later", Allocation("lock", fence=100)) is not None
    assert _sell(item, 1, "next", Allocation("lock", fence=101)) is not None
    assert _sell(item, 1, "fallback", Allocation("optimistic", fallback=True)) is not None
    item.refresh_from_db()
    assert (item.units_left, item.fence) == (1, 101)
    # a fenced sale refused for want of stock is sold out, not fenced
    assert _sell(item, 2, "many", Allocation("lock", fence=102)) is None


def test_each_stock_row_checks_the_fence_of_its_own_lock():
    start_sale(sku="fenced-rows", stock=20, strategy="segmented")
    item = Item.objects.get(sku="fenced-rows")
    assert _sell(item, 1, "a", Allocation("segmented", shard_units={0: 1}, shard_fences={0: 50}))
    before = _rows("fenced-rows")

    stale = Allocation("segmented", shard_units={0: 1}, shard_fences={0: 49})
    assert _sell(item, 1, "paused", stale) is None
    assert _rows("fenced-rows") == before
    # shard 1's lock is another lock: its row has accepted no fence yet
    assert _sell(item, 1, "b", Allocation("segmented", shard_units={1: 1}, shard_fences={1: 7}))
    # a sale from two rows is refused whole when one of them refuses its fence
    both = Allocation("segmented", shard_units={0: 1, 1: 1}, shard_fences={0: 51, 1: 6})
    with pytest.raises(sale_values.HalfDone):
        _sell(item, 2, "c", both)
    fences = dict(StockShard.objects.filter(sale=item.current_sale).values_list("index", "fence"))
    assert (fences[0], fences[1], fences[2]) == (50, 7, 0)
    with pytest.raises(ValueError, match="a fence for each row"):
        _sell(item, 1, "d", Allocation("segmented", shard_units={2: 1}, shard_fences={0: 60}))


def test_a_prepared_sale_decides_when_it_runs_not_when_it_was_prepared():
    # Given a lock holder's sale of the last two units, prepared (statement built, cursor open)
    # before its lock, the way `lock` prepares it, with no fence yet
    start_sale(sku="prepared", stock=2, strategy="lock")
    item = Item.objects.get(sku="prepared")
    recorder = SaleRecorder(item=item, qty=2, buyer="waiter")
    with recorder.prepare(Allocation("lock")) as write:
        # When, while it waits for the lock, another holder with a later fence sells one unit
        assert _sell(item, 1, "first", Allocation("lock", fence=8)) is not None
        before = _rows("prepared")
        # Then run with its own lock's fence, older than the row's, it is refused as fenced,
        # and nothing changes
        with pytest.raises(sale_values.Fenced):
            write(fence=7)
        assert _rows("prepared") == before

    # And prepared and run under the later fence it is refused for want of stock (one unit
    # left, two asked), read when it runs: nothing changes either
    with recorder.prepare(Allocation("lock")) as write:
        assert write(fence=9) is None
    assert _rows("prepared") == before
    # And one unit, prepared before and run after the stock changed, sells with its fence
    one = SaleRecorder(item=item, qty=1, buyer="last")
    with one.prepare(Allocation("lock")) as write:
        sold = write(fence=10)
    assert sold is not None and sold.item_stock == 0
    order = Order.objects.get(pk=sold.order.pk)
    assert (order.buyer, order.qty, order.served_by) == ("last", 1, "lock")
    item.refresh_from_db()
    assert (item.units_left, item.fence) == (0, 10)


def test_a_prepared_sale_that_never_runs_writes_nothing_and_closes_its_cursor():
    start_sale(sku="unrun", stock=3, strategy="lock")
    item = Item.objects.get(sku="unrun")
    before = _rows("unrun")
    recorder = SaleRecorder(item=item, qty=1, buyer="gave-up")

    # (a lock wait that ran out: the checkout is answered busy before its write)
    with pytest.raises(Busy), recorder.prepare(Allocation("lock")) as write:
        raise Busy("the lock stayed held", retry_after=1)

    assert write.cursor.closed and _rows("unrun") == before
    # a sale from stock rows takes no item fence, prepared or not
    start_sale(sku="unrun-rows", stock=20, strategy="segmented")
    rows = Item.objects.get(sku="unrun-rows")
    shard_sale = SaleRecorder(item=rows, qty=1, buyer="x")
    with shard_sale.prepare(Allocation("segmented", shard_units={0: 1})) as write:
        with pytest.raises(ValueError, match="no item fence"):
            write(fence=3)
    assert StockShard.objects.get(sale=rows.current_sale, index=0).stock == 2


@pytest.mark.parametrize("strategy", ["segmented", "lua"])
def test_a_sale_from_stock_rows_writes_its_rows_and_never_the_item_row(strategy):
    # Given an item sold from stock rows, whose item row another session holds locked the way
    # an UPDATE does (FOR NO KEY UPDATE: an order's foreign-key check does not wait for it)
    start_sale(sku="rows", stock=20, strategy=strategy, limit=5)
    item = Item.objects.get(sku="rows")
    assert item.shard_count == 10
    holder = connections.create_connection("default")
    holder.ensure_connection()
    raw = holder.connection
    raw.execute("BEGIN")
    raw.execute("SELECT 1 FROM inventory_item WHERE id = %s FOR NO KEY UPDATE", [item.pk])
    try:
        # When units are sold from two rows, one row and through the strategy itself
        sold = _sell(item, 3, "ann", Allocation(strategy, shard_units={2: 1, 7: 2}), limit=5)
        place_order(sku="rows", qty=1, buyer="bob")
    finally:
        raw.rollback()
        holder.close()

    # Then the rows lost exactly those units, the item row is as it was, and the item's stock
    # is derived from the rows
    assert sold is not None and sold.item_stock is None and sold.shard_levels == {2: 1, 7: 0}
    after = Item.objects.get(pk=item.pk)
    assert (after.stock, after.version) == (item.stock, item.version)
    assert after.units_left == 16
    assert audit_sale("rows")["db_stock"] == 16
    assert BuyerAllowance.objects.get(sale=item.current_sale, buyer="ann").units == 3


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic", "unsafe"])
def test_the_order_a_checkout_returns_is_the_row_it_committed(strategy):
    # Given an item on sale, checked out with a key
    start_sale(sku="as-read", stock=5, strategy=strategy, limit=3)

    # When a checkout places an order (built from what the sale statement returned)
    built = place_order(sku="as-read", qty=2, buyer="reader", idempotency_key="k-1").order

    # Then it is the row in the database, field by field, and saved as one that exists
    stored = Order.objects.get(pk=built.pk)
    for model_field in Order._meta.concrete_fields:
        name_ = model_field.attname
        assert getattr(built, name_) == getattr(stored, name_), name_
    assert built._state.adding is False and built._state.db == stored._state.db
    # and its item is the item sold, with no query to read it
    with CaptureQueriesContext(connections["default"]) as queries:
        assert built.item.sku == "as-read"
    assert len(queries) == 0


def test_an_order_built_from_its_row_sends_init_signals_to_anyone_listening():
    # Given a receiver of post_init (the order is built without Model.__init__ while nobody
    # listens to its signals)
    start_sale(sku="heard", stock=5, strategy="lua")
    built: list[Order] = []

    def heard(sender, instance, **kwargs):
        if sender is Order:
            built.append(instance)

    post_init.connect(heard)
    try:
        # When a checkout places an order
        order = place_order(sku="heard", qty=1, buyer="ann").order
    finally:
        post_init.disconnect(heard)

    # Then the receiver saw it built, and it is the committed row
    assert built == [order] and built[0] is order
    assert order._state.adding is False
    assert Order.objects.get(pk=order.pk).public_id == order.public_id


def test_a_checkout_for_a_restarted_sale_takes_nothing_from_the_new_one():
    # Given a checkout that read the item before its sale was restarted
    start_sale(sku="again", stock=5, strategy="optimistic")
    stale = Item.objects.get(sku="again")
    start_sale(sku="again", stock=5, strategy="optimistic")

    # When its sale statement runs
    with pytest.raises(sale_values.SaleRestarted):
        _sell(stale, 1, "b", Allocation("optimistic"))

    # Then it is refused: no unit of the new sale goes to an order of the old one
    assert Item.objects.get(sku="again").units_left == 5
    assert not Order.objects.filter(item=stale).exists()


def _sell(item, qty, buyer, allocation, *, limit=None):
    """The sale statement, as a strategy's recorder runs it."""
    return sell(SaleRecorder(item=item, qty=qty, buyer=buyer, limit=limit), allocation)


def test_forty_orders_go_to_the_broker_as_one_message_settled_as_one_batch(monkeypatch, settings):
    # Given forty committed orders handed to a publisher with no thread of its own
    monkeypatch.setattr(inventory.services, "order_placed", lambda pk: None)
    start_sale(sku="batch", stock=40, strategy="lua")
    publisher = publishing.OrderPublisher(background=False)
    placed = [place_order(sku="batch", qty=1, buyer=f"b{n}").order.pk for n in range(40)]
    for pk in placed:
        publisher.add(pk)
    client = get_redis_client()

    # When it flushes
    sent = publisher.flush()

    # Then one message carries all forty order keys (other tests' orders may reach the shared
    # queue meanwhile: only messages carrying these count)
    assert sent == 40
    (message,) = task_messages_carrying(client, TASK_QUEUE, placed)
    assert message["task"] == "inventory.tasks.settle_orders_task"
    assert message["args"] == [placed]
    assert publisher.flush() == 0  # nothing twice

    # and the task, run as a worker would, confirms all forty and publishes nothing more
    settings.FLASHSALE_PAYMENT_LATENCY_MS = 1
    assert settle_orders_task.apply(args=(placed,)).get() == {
        "confirmed": 40,
        "failed": 0,
        "skipped": 0,
    }
    assert task_messages_carrying(client, TASK_QUEUE, placed) == [message]
    assert Order.objects.filter(pk__in=placed, status=OrderStatus.CONFIRMED).count() == 40
    assert PaymentAttempt.objects.filter(order__in=placed).count() == 40
    # a message of the task's former name is settled the same way (nothing left to do here)
    assert dispatch_orders_task.apply(args=(placed,)).get()["skipped"] == 40
    assert PaymentAttempt.objects.filter(order__in=placed).count() == 40


def _in_a_process(script: str, **env: object) -> str:
    """Run a Python script in a fresh process of the shop's (django.setup() is the script's);
    what it printed. Fails the test if it failed."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, **server_env(**env), "DJANGO_SETTINGS_MODULE": "shop.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _messages_carrying(order_pk: int) -> list[dict]:
    # (other messages may arrive meanwhile: this pytest process's own publisher still runs)
    return task_messages_carrying(get_redis_client(), TASK_QUEUE, [order_pk])


def test_a_process_that_exits_cleanly_sends_the_orders_it_still_holds():
    # Given a process whose publisher would wait a minute before sending anything
    start_sale(sku="exit", stock=5, strategy="lua")
    script = (
        "import django; django.setup()\n"
        "from inventory.services import place_order\n"
        "print(place_order(sku='exit', qty=1, buyer='late').order.pk)\n"
    )

    # When it places an order and exits at once
    order_pk = int(_in_a_process(script, FLASHSALE_PUBLISH_INTERVAL_MS=60_000).split()[-1])

    # Then the order went to the broker on the way out, not a minute later by the sweeper
    assert _messages_carrying(order_pk) == [
        {"task": "inventory.tasks.settle_orders_task", "args": [[order_pk]]}
    ]


def test_a_process_that_exits_while_its_thread_sends_waits_for_that_send():
    # Given a process whose publisher thread has taken an order and is sending it (held up a
    # moment, as a first send is while it connects), when the process exits
    start_sale(sku="exit-mid-send", stock=5, strategy="lua")
    script = (
        "import threading, time; import django; django.setup()\n"
        "from inventory import publishing\n"
        "from inventory.services import place_order\n"
        "sending = threading.Event()\n"
        "real = publishing.publish_orders\n"
        "def slow(pks):\n"  # (held up past the exit below: the exit must wait for it)
        "    sending.set(); time.sleep(1.0); return real(pks)\n"
        "publishing.publish_orders = slow\n"
        "print(place_order(sku='exit-mid-send', qty=1, buyer='late').order.pk)\n"
        "assert sending.wait(30)\n"
    )
    order_pk = int(_in_a_process(script, FLASHSALE_PUBLISH_INTERVAL_MS=50).split()[-1])

    # Then the exit waited for the thread's send: the order reached the broker once
    assert _messages_carrying(order_pk) == [
        {"task": "inventory.tasks.settle_orders_task", "args": [[order_pk]]}
    ]


def test_a_stopped_server_sends_the_orders_its_workers_still_hold():
    # Given the shop's server, whose publishers would wait a minute before sending anything
    # (granian's workers are multiprocessing children: the interpreter's atexit never runs)
    start_sale(sku="server-exit", stock=12, strategy="lua")
    server = start_shop(FLASHSALE_PUBLISH_INTERVAL_MS=60_000)
    try:
        result = flood(server.url, "server-exit", attempts=12, concurrency=4)
    finally:
        # When it is stopped as `make serve` and the tests stop it (SIGTERM to its group)
        server.stop()
    assert result.accepted == 12

    # Then each order it sold went to the broker on the way out, once
    placed = list(Order.objects.filter(item__sku="server-exit").values_list("pk", flat=True))
    messages = task_messages_carrying(get_redis_client(), TASK_QUEUE, placed)
    carried = sorted(pk for message in messages for pk in message["args"][0])
    assert carried == sorted(placed), messages


_PREPARED = (
    "SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements"
    " WHERE NOT from_sql ORDER BY statement"
)

_CHECKOUT_IN_A_PROCESS = (
    "import django, json; django.setup()\n"
    "from django.db import connection\n"
    "from inventory.services import place_order\n"
    "for n in range(3):\n"
    "    place_order(sku='{sku}', qty=1, buyer=f'p{{n}}')\n"
    "with connection.cursor() as cursor:\n"
    "    cursor.execute({query!r})\n"
    "    print(json.dumps(cursor.fetchall()))\n"
)


def _checkouts_in_a_process(sku: str, **env: object) -> list[tuple[str, int]]:
    """Three checkouts of sku in a fresh process; the statements its connection prepared."""
    printed = _in_a_process(_CHECKOUT_IN_A_PROCESS.format(sku=sku, query=_PREPARED), **env)
    return [tuple(row) for row in json.loads(printed.splitlines()[-1])]


@pytest.mark.parametrize("strategy", ["optimistic", "segmented", "lua"])
def test_a_checkout_prepares_its_two_statements_once_per_connection(strategy):
    start_sale(sku=f"prep-{strategy}", stock=10, strategy=strategy)

    prepared = _checkouts_in_a_process(f"prep-{strategy}")

    # The item read and the sale statement, each prepared once; the sale statement ran for all
    # three sales, the item read for the first (the others used its result)
    assert [(statement.split()[0], runs) for statement, runs in prepared] == [
        ("SELECT", 1),
        ("WITH", 3),
    ]
    assert "FROM inventory_item i LEFT JOIN inventory_sale" in prepared[0][0]
    assert "INSERT INTO inventory_order" in prepared[1][0]
    assert Order.objects.filter(item__sku=f"prep-{strategy}").count() == 3


def test_the_debug_log_shows_the_prepared_statements_with_their_parameters():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    start_sale(sku="logged", stock=10, strategy="lua")
    with CaptureQueriesContext(connection) as captured:
        place_order(sku="logged", qty=2, buyer="ann-logged", idempotency_key="key-logged")

    # What `connection.queries` (and the debug toolbar, and the SQL log) show: the text that
    # ran, values in place, not None
    read, sale = (query["sql"] for query in captured)
    assert read.startswith("SELECT") and "WHERE i.sku = 'logged'" in read
    # (lua writes its sales in batches: the batch's statement carries them as JSON)
    assert sale.startswith(("WITH", "SELECT n, order_id, outcome FROM inventory_sell_batch("))
    assert "ann-logged" in sale and "key-logged" in sale
    assert Order.objects.get(idempotency_key="key-logged").qty == 2


def test_prepared_statements_can_be_turned_off_for_a_pooler():
    start_sale(sku="unprepared", stock=10, strategy="lua")

    prepared = _checkouts_in_a_process("unprepared", DJANGO_DB_PREPARED_STATEMENTS="false")

    # Nothing prepared, and the same code still sold the three units
    assert prepared == []
    assert Order.objects.filter(item__sku="unprepared").count() == 3
    assert Item.objects.get(sku="unprepared").units_left == 7


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_a_checkout_gives_up_on_a_row_another_transaction_holds_and_changes_nothing(
    strategy, monkeypatch
):
    # Given a sale whose stock rows (or item row) another session has locked in an open
    # transaction
    monkeypatch.setattr(row_locks, "ROW_LOCK_TIMEOUT_MS", 300)
    sku = f"held-{strategy}"
    start_sale(sku=sku, stock=5, strategy=strategy, limit=2)
    item = Item.objects.get(sku=sku)
    before, redis_before = _rows(sku), get_strategy(strategy).redis_stock(item=item)
    holder = connections.create_connection("default")
    holder.ensure_connection()
    raw = holder.connection  # used from the timer thread too: plain psycopg, not Django's
    raw.execute("BEGIN")
    if item.shard_count:  # the stock rows are what its sales write
        raw.execute(
            "SELECT 1 FROM inventory_stockshard WHERE sale_id = %s FOR UPDATE",
            [item.current_sale_id],
        )
    else:
        raw.execute("SELECT 1 FROM inventory_item WHERE id = %s FOR UPDATE", [item.pk])
    # (without the bound the checkout would wait for ever: end the hold after 30 s regardless)
    let_go = threading.Event()

    def end_the_hold() -> None:
        let_go.set()
        raw.rollback()

    watchdog = threading.Timer(30, end_the_hold)
    watchdog.start()
    try:
        # When a buyer checks out
        with pytest.raises(Busy) as refused:
            place_order(sku=sku, qty=1, buyer="b")
        held_throughout = not let_go.is_set()
    finally:
        watchdog.cancel()
        raw.rollback()
        holder.close()

    # Then it answered busy once the bound ran out, while the other session still held the row
    assert held_throughout
    assert "stayed locked by another transaction for 300 ms" in str(refused.value)
    assert refused.value.retry_after == BUSY_RETRY_AFTER
    # and nothing was written: no stock taken (shards and Redis included), no order, no allowance
    assert _rows(sku) == before
    assert get_strategy(strategy).redis_stock(item=item) == redis_before
    assert not BuyerAllowance.objects.filter(item=item).exists()
    # and once the row is free the same checkout goes through
    assert place_order(sku=sku, qty=1, buyer="b").order.qty == 1
    assert Item.objects.get(sku=sku).units_left == before[0] - 1


def test_units_given_back_together_are_written_in_every_writers_lock_order(monkeypatch):
    # Given two orders of a segmented sale, the first (by id) from shard 7, the second from
    # shard 2, declined in one settle batch (as a worker declines a batch's payments)
    from inventory.strategies import segmented

    start_sale(sku="back-in-order", stock=20, strategy="segmented", limit=5)
    sale = Item.objects.get(sku="back-in-order").current_sale_id
    for index, buyer in ((7, "ann"), (2, "bob")):
        monkeypatch.setattr(segmented.random, "randrange", lambda _, index=index: index)
        place_order(sku="back-in-order", qty=1, buyer=buyer)
    declined = list(Order.objects.filter(item__sku="back-in-order").order_by("pk"))
    assert [order.shard_units for order in declined] == [{"7": 1}, {"2": 1}]

    # When their units go back together
    with CaptureQueriesContext(connections["default"]) as captured:
        stock.return_units_of(declined)

    # Then the stock rows are written in index order, before the allowances, as a batch of
    # sales locks them: each waits for the other, never both for each other
    shards = [
        int(query["sql"].split('"index" = ')[1].split()[0])
        for query in captured
        if query["sql"].startswith('UPDATE "inventory_stockshard"')
    ]
    assert shards == [2, 7]
    kinds = [query["sql"].split()[1] for query in captured]
    assert (
        kinds
        == ['"inventory_stockshard"', '"inventory_stockshard"'] + ['"inventory_buyerallowance"'] * 2
    )
    # and every row holds its units again
    assert set(StockShard.objects.filter(sale_id=sale).values_list("stock", flat=True)) == {2}
