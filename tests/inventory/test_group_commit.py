"""`lua` with group commit: checkouts of every web process queued in Redis and written in shared
commits. Each sale keeps its own guards, every 201 has its committed order, nothing is oversold
or stranded, and a taker that is never written gets its units back."""

from __future__ import annotations

import json
import select
import uuid

import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from inventory import keys, stock
from inventory.exceptions import Busy
from inventory.models import BuyerAllowance, Item, Order, Sale, StockShard
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import plumbing
from locking.combining import GroupCommit, Queued
from tests.conftest import start_shop
from tests.support import flood_sells_exactly_the_stock

STOCK = 60
BUYERS = 24
ATTEMPTS = 200
ROUNDS = 3

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def grouped_shop(django_db_setup, django_db_blocker):
    server = start_shop(FLASHSALE_GROUP_COMMIT="true")
    yield server
    server.stop()


def test_a_flood_through_group_commit_sells_exactly_the_stock_in_shared_commits(grouped_shop):
    batched = 0
    for _ in range(ROUNDS):
        # Given a lua sale whose checkouts are written in batches
        sku = f"grouped-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=STOCK, strategy="lua")

        # When a crowd larger than the stock buys, many at a time
        # Then exactly the stock is sold, each 201 is a committed order, nothing else is
        stored = flood_sells_exactly_the_stock(
            grouped_shop.url, sku, stock=STOCK, attempts=ATTEMPTS, buyers=BUYERS
        )
        # and orders shared commits: a batch stamps its orders with one time
        batched += stored.count() - stored.values("created_at").distinct().count()
    assert batched > 0


def _request(item: Item, **changes) -> dict:
    request = {
        "item": item.pk,
        "sale": item.current_sale_id,
        "qty": 1,
        "buyer": "ann",
        "key": None,
        "limit": None,
        "served_by": "lua",
        "fallback": False,
        "rows": {"0": 1},
    }
    return {**request, **changes}


def test_each_sale_of_a_batch_keeps_its_own_guards():
    # Given a lua sale of 10 units (one per stripe) with a limit of 2 per buyer
    start_sale(sku="guards", stock=10, strategy="lua", limit=2)
    old = Item.objects.get(sku="guards")
    start_sale(sku="guards", stock=10, strategy="lua", limit=2)
    item = Item.objects.get(sku="guards")

    # When one batch holds a good sale and one of each kind of refusal
    answers = stock.sell_batch(
        [
            _request(item, key="k1", limit=2),
            _request(item, key="k1", limit=2, rows={"1": 1}),  # the same key again
            _request(item, rows={"2": 5}, qty=5),  # more than its stripe holds
            _request(item, buyer="bob", limit=2, rows={"3": 1}),
            _request(item, buyer="bob", limit=2, rows={"4": 1}),
            _request(item, buyer="bob", limit=2, rows={"5": 1}),  # past bob's limit
            _request(old, buyer="cy", rows={"6": 1}),  # a sale restarted since
        ]
    )

    # Then each is answered for itself, and only the good ones wrote anything
    assert [answer["o"] for answer in answers] == [
        "sold",
        "duplicate",
        "short",
        "sold",
        "sold",
        "limit",
        "restarted",
    ]
    sold = [answer["id"] for answer in answers if answer["o"] == "sold"]
    assert sorted(Order.objects.values_list("pk", flat=True)) == sorted(sold)
    assert Item.objects.get(pk=item.pk).units_left == 7
    levels = stock.shard_stocks(item.current_sale_id)
    assert [levels[index] for index in range(7)] == [0, 1, 1, 0, 0, 1, 1]
    assert BuyerAllowance.objects.get(sale=item.current_sale, buyer="bob").units == 2
    # and the answers are what the combiner pushes to each taker: JSON, one commit time
    assert json.loads(json.dumps(answers)) == answers
    assert len({answer["at"] for answer in answers}) == 1


def test_a_batch_nobody_refuses_is_written_by_one_set_based_statement():
    # Given a lua sale of 40 units (4 per stripe), at most 3 per buyer
    start_sale(sku="whole", stock=40, strategy="lua", limit=3)
    item = Item.objects.get(sku="whole")
    public_ids = [str(uuid.uuid4()) for _ in range(4)]

    # When a batch holds four good sales: two from one stripe, one of 2 units, one from two
    # stripes, two of them by the same buyer
    with CaptureQueriesContext(connection) as captured:
        answers = stock.sell_batch(
            [
                _request(item, public_id=public_ids[0], limit=3, key="w1"),
                _request(item, public_id=public_ids[1], buyer="bob", limit=3),
                _request(item, public_id=public_ids[2], qty=2, rows={"1": 2}, limit=3),
                _request(item, public_id=public_ids[3], qty=2, rows={"2": 1, "3": 1}, buyer="cy"),
            ]
        )

    # Then one statement wrote them all, the per-request function never ran
    assert len(captured) == 1, [query["sql"][:80] for query in captured]
    assert "jsonb_to_recordset(" in captured[0]["sql"]
    assert "inventory_sell_batch" not in captured[0]["sql"]
    # and each request is answered with its own order, in order
    assert [answer["o"] for answer in answers] == ["sold"] * 4
    orders = {str(order.public_id): order for order in Order.objects.filter(item=item)}
    assert [orders[public_id].pk for public_id in public_ids] == [a["id"] for a in answers]
    assert orders[public_ids[3]].shard_units == {"2": 1, "3": 1}
    assert orders[public_ids[0]].idempotency_key == "w1"
    # and the rows, the allowances and the stock agree with what was sold
    levels = stock.shard_stocks(item.current_sale_id)
    assert [levels[index] for index in range(4)] == [2, 2, 3, 3]
    assert Item.objects.get(pk=item.pk).units_left == 34
    allowances = dict(
        BuyerAllowance.objects.filter(sale=item.current_sale).values_list("buyer", "units")
    )
    assert allowances == {"ann": 3, "bob": 1}


@pytest.mark.parametrize("planner", ["default", "enable_nestloop = off"])
def test_the_batch_statement_reads_only_its_own_sales_stock_rows(planner):
    # Given a lua sale beside 400 earlier sales' stock rows (4,000 rows, every one kept as
    # history)
    start_sale(sku="plan", stock=40, strategy="lua")
    item = Item.objects.get(sku="plan")
    earlier = Sale.objects.bulk_create(
        Sale(item=item, initial_stock=10, strategy="lua", opens_at=timezone.now())
        for _ in range(400)
    )
    StockShard.objects.bulk_create(
        StockShard(item=item, sale=sale, index=index, stock=1, supplied=1)
        for sale in earlier
        for index in range(10)
    )

    # When a batch is written, and the plan PostgreSQL keeps for the statement (the generic
    # plan of a prepared statement, made without the values) is explained, by the default
    # planner and by one that would rather hash than loop over an index
    # (the table's statistics taken first, as autovacuum keeps them: without any, the planner
    # guesses the table's rows from its pages, which earlier tests' rolled-back rows fill)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {StockShard._meta.db_table}")
    settings = ["plan_cache_mode = force_generic_plan"]
    if planner != "default":
        settings.append(planner)
    with connection.cursor() as cursor:
        for setting in settings:
            cursor.execute(f"SET {setting}")
    try:
        answers = stock.sell_batch(
            [_request(item, rows={"0": 1}), _request(item, buyer="bob", rows={"5": 1})]
        )
        assert [answer["o"] for answer in answers] == ["sold", "sold"]
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT name, parameter_types::text[] FROM pg_prepared_statements"
                " WHERE statement LIKE %s",
                ["%jsonb_to_recordset%"],
            )
            ((name, types),) = cursor.fetchall()
            nulls = ", ".join(f"NULL::{parameter_type}" for parameter_type in types)
            cursor.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {name}({nulls})")
            plan = cursor.fetchone()[0]
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET ALL")

    # Then every read of the stock-row table goes through an index to the rows it names:
    # none reads the other sales' rows
    scans = _scans(plan[0]["Plan"], "inventory_stockshard")
    assert scans, plan
    for kind, condition in scans:
        assert kind in ("Index Scan", "Bitmap Heap Scan") and condition, scans


def _scans(node: dict, table: str) -> list[tuple[str, str | None]]:
    """Each scan of `table` anywhere in a plan: its kind and the condition its index applies."""
    found = []
    if node.get("Relation Name") == table and node["Node Type"] != "ModifyTable":
        found.append((node["Node Type"], node.get("Index Cond") or node.get("Recheck Cond")))
    for child in node.get("Plans", []):
        found += _scans(child, table)
    return found


def test_a_refused_request_sends_the_batch_a_request_at_a_time_and_nothing_twice():
    # Given a lua sale of 10 units, one per stripe
    start_sale(sku="mixed", stock=10, strategy="lua")
    item = Item.objects.get(sku="mixed")

    # When a batch of three holds one sale its stripe cannot serve
    with CaptureQueriesContext(connection) as captured:
        answers = stock.sell_batch(
            [
                _request(item, rows={"0": 1}),
                _request(item, rows={"1": 2}, qty=2),
                _request(item, buyer="bob", rows={"2": 1}),
            ]
        )

    # Then the set-based statement wrote nothing and the per-request function answered each
    assert [query["sql"].lstrip()[:4] for query in captured] == ["WITH", "WITH"]
    assert "inventory_sell_batch" in captured[1]["sql"]
    # (the batch's stock rows locked first, in lock order, as the set-based statement does)
    assert "FOR NO KEY UPDATE" in captured[1]["sql"]
    assert [answer["o"] for answer in answers] == ["sold", "short", "sold"]
    assert Order.objects.filter(item=item).count() == 2
    levels = stock.shard_stocks(item.current_sale_id)
    assert [levels[index] for index in range(3)] == [0, 1, 0]


def test_a_refused_batch_in_flight_is_written_again_on_its_own_connection():
    # Given a lua sale of 10 units, one per stripe, and a second connection, as the sale
    # writer's
    start_sale(sku="mixed", stock=10, strategy="lua")
    item = Item.objects.get(sku="mixed")
    other = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        # When a batch sent on it holds one sale its stripe cannot serve
        with (
            CaptureQueriesContext(connection) as on_default,
            CaptureQueriesContext(other) as on_other,
        ):
            batch = stock.BatchInFlight(
                [
                    _request(item, rows={"0": 1}),
                    _request(item, rows={"1": 2}, qty=2),
                    _request(item, buyer="bob", rows={"2": 1}),
                ],
                other,
            )
            while not batch.poll():
                select.select([batch.socket], [], [], 1)
            answers = batch.answers()

        # Then it is written again a request at a time on that connection, not the default one
        # (which may carry a statement of its own in flight)
        assert len(on_default) == 0
        assert [query["sql"].lstrip()[:4] for query in on_other] == ["WITH"]
        assert "inventory_sell_batch" in on_other[0]["sql"]
        assert [answer["o"] for answer in answers] == ["sold", "short", "sold"]
    finally:
        other.close()
    assert Order.objects.filter(item=item).count() == 2
    levels = stock.shard_stocks(item.current_sale_id)
    assert [levels[index] for index in range(3)] == [0, 1, 0]


def test_a_taker_no_combiner_answers_withdraws_and_gets_its_units_back(settings):
    # Given a lua sale through group commit whose combiner lock a dead process holds
    settings.FLASHSALE_GROUP_COMMIT = True
    settings.FLASHSALE_GROUP_COMMIT_WAIT_MS = 300
    start_sale(sku="stalled", stock=10, strategy="lua")
    item = Item.objects.get(sku="stalled")
    group = plumbing.group_commit(item)
    group.redis.set(group.lock, "a-dead-combiner", px=60_000)

    # When a buyer checks out: its sale is queued and nobody writes it
    with pytest.raises(Busy) as refused:
        place_order(sku="stalled", qty=1, buyer="ann")

    # Then it was told busy, took its sale out of the queue (it will never be written) and
    # gave its unit back: nothing sold, Redis and the database agree
    assert "no batch took the sale in time" in str(refused.value)
    assert group.redis.llen(group.queue) == 0
    assert not Order.objects.exists()
    audit = audit_sale("stalled")
    assert audit["db_stock"] == audit["redis_stock"] == 10 and audit["consistent"], audit


def test_a_combiner_hands_the_lock_to_the_oldest_waiting_taker():
    start_sale(sku="handoff", stock=10, strategy="lua")
    item = Item.objects.get(sku="handoff")
    group: GroupCommit = plumbing.group_commit(item)
    take = {"cursor": keys.turn(item), "counters": keys.rows(item), "qty": 1}

    # Given a combiner and a taker who queued behind it
    first = group.take_and_enqueue(request={"buyer": "a"}, **take)
    second = group.take_and_enqueue(request={"buyer": "b"}, **take)
    assert first.combiner and not second.combiner
    written: list[list[dict]] = []

    def write(requests: list[dict]) -> list[dict]:
        written.append(requests)
        return [{"o": "test", "buyer": request["buyer"]} for request in requests]

    # When the combiner writes: both sales in one batch
    assert group.settle(first, write, wait=1) == {"o": "test", "buyer": "a"}
    assert [[request["buyer"] for request in batch] for batch in written] == [["a", "b"]]
    assert group.settle(second, write, wait=1) == {"o": "test", "buyer": "b"}

    # Then a taker that queues while a combiner writes gets the lock handed over: it writes
    # its own sale (and anyone's behind it) without waiting for a newcomer
    late: dict[str, Queued] = {}

    def write_while_another_queues(requests: list[dict]) -> list[dict]:
        late["taker"] = group.take_and_enqueue(request={"buyer": "late"}, **take)
        return write(requests)

    third = group.take_and_enqueue(request={"buyer": "c"}, **take)
    assert third.combiner  # nobody held the lock
    assert group.settle(third, write_while_another_queues, wait=1) == {"o": "test", "buyer": "c"}
    taker = late["taker"]
    assert not taker.combiner
    assert group.redis.get(group.lock) == f"handoff:{taker.request_id}".encode()
    assert group.settle(taker, write, wait=1) == {"o": "test", "buyer": "late"}
    assert group.redis.get(group.lock) is None and group.redis.llen(group.queue) == 0
