"""`lua` and `segmented` through the sale writer: every web process hands its sales to one
process that writes them in shared commits (taking `lua`'s units in one script first; a
`segmented` shard's holder sends the rows it holds, fenced by their tokens). Each sale keeps its
own guards; every 201 has its committed order; nothing is oversold when Redis grants too much or
a lock's token is stale; a writer that dies mid-flood loses no 201 and sells nothing twice, and
the buyers go on the direct way."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone
from redis.backoff import NoBackoff
from redis.retry import Retry

from inventory import keys, orders, publishing, services, stock, writer
from inventory.exceptions import Busy
from inventory.models import Item, Order, StockShard
from inventory.orders import reconcile_sale
from inventory.redis_client import get_redis_client
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import plumbing, segmented
from inventory.writer import BREAKER_OPEN, OrderRelay, write_request, writer_stats
from loadtest.flood import flood
from shop.processes.servers import SaleWriter as SaleWriterProcess
from tests.conftest import TASK_QUEUE, server_env, start_shop, wait_until
from tests.conftest import writer_in_thread as serving
from tests.support import flood_sells_exactly_the_stock, task_messages_carrying

STOCK = 60
BUYERS = 24
ATTEMPTS = 200
ROUNDS = 3

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_a_flood_through_the_writer_sells_exactly_the_stock_in_shared_commits(
    writer_shop, writer_process, strategy
):
    before = writer_stats(writer_process.path)
    for _ in range(ROUNDS):
        # Given a sale on a server whose web processes send their sales to the writer
        sku = f"written-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=STOCK, strategy=strategy)
        item = Item.objects.get(sku=sku)

        # When a crowd larger than the stock buys, many at a time
        # Then exactly the stock is sold, each 201 is a committed order, nothing else is
        flood_sells_exactly_the_stock(
            writer_shop.url, sku, stock=STOCK, attempts=ATTEMPTS, buyers=BUYERS
        )
        # and the item row was never written: the stock rows were
        after = Item.objects.get(sku=sku)
        assert (after.stock, after.version) == (item.stock, item.version) == (STOCK, item.version)
        assert after.units_left == 0
    # and the writer wrote them all, several to a commit
    after = writer_stats(writer_process.path)
    written = after["sales"] - before["sales"]
    if strategy == "lua":
        assert written == ROUNDS * STOCK
    else:
        # A shard's holder whose batch was refused (a row short: another holder's, who waited
        # for its lock on a level read before) writes its own sale: a few, at the sell-out.
        assert ROUNDS * STOCK * 3 // 4 <= written <= ROUNDS * STOCK
    assert after["batches"] - before["batches"] < written


@pytest.mark.parametrize("strategy", ["lua", "lock"])
def test_the_writer_publishes_each_order_once_written_by_it_or_relayed_to_it(
    writer_shop, writer_process, strategy
):
    # Given a sale on a server with a writer, on a broker whose queue nobody consumes here:
    # `lua`'s sales the writer writes, `lock`'s the web processes do
    before = writer_stats(writer_process.path)
    client = get_redis_client()
    queued = client.llen(TASK_QUEUE)
    sku = f"handed-{strategy}-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=STOCK, strategy=strategy)

    # When a crowd buys it out
    placed = list(
        flood_sells_exactly_the_stock(
            writer_shop.url, sku, stock=STOCK, attempts=ATTEMPTS, buyers=BUYERS
        ).values_list("pk", flat=True)
    )

    # Then the writer handed every order to the workers: those it wrote, or those the web
    # processes relayed to it
    deadline = time.monotonic() + 10
    while True:
        after = writer_stats(writer_process.path)
        messages = task_messages_carrying(client, TASK_QUEUE, placed, since=queued)
        carried = [pk for message in messages for pk in message["args"][0]]
        if sorted(carried) == sorted(placed) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    written = STOCK if strategy == "lua" else 0
    assert after["sales"] - before["sales"] == written
    assert after["relayed"] - before["relayed"] == STOCK - written
    assert after["handed"] - before["handed"] == STOCK
    # and each is carried by one settle message, and by no other: the writer published them,
    # several to a message, and the web processes none
    assert sorted(pk for pk in carried if pk in set(placed)) == sorted(placed), messages
    assert {message["task"] for message in messages} == {"inventory.tasks.settle_orders_task"}
    assert len(messages) < len(placed)


def _placed_lock_orders(sku: str, count: int) -> list[int]:
    start_sale(sku=sku, stock=count, strategy="lock")
    return [place_order(sku=sku, qty=1, buyer=f"b{n}").order.pk for n in range(count)]


def test_a_publisher_relays_to_the_writer_and_the_writer_publishes_on_its_way_out(
    monkeypatch, settings
):
    # Given twenty committed orders in a publisher with no thread of its own, and a writer
    monkeypatch.setattr(services, "order_placed", lambda pk: None)
    settings.FLASHSALE_PUBLISH_INTERVAL_MS = 60_000  # the writer's own publisher waits
    placed = _placed_lock_orders("relay", 20)
    publisher = publishing.OrderPublisher(background=False, relay=OrderRelay())
    publisher.add_many(placed)
    client = get_redis_client()
    queued = client.llen(TASK_QUEUE)
    with serving() as sale_writer:
        settings.FLASHSALE_SALE_WRITER = sale_writer.path

        # When the publisher flushes
        assert publisher.flush() == 20

        # Then the writer took them, and holds them for its next publish
        assert publisher.relayed == 20 and sale_writer.stats()["relayed"] == 20
        assert task_messages_carrying(client, TASK_QUEUE, placed, since=queued) == []

    # and once stopped it has published them, as one message
    assert task_messages_carrying(client, TASK_QUEUE, placed, since=queued) == [
        {"task": "inventory.tasks.settle_orders_task", "args": [placed]}
    ]


def test_orders_relayed_to_a_writer_killed_before_it_published_are_swept_again(
    monkeypatch, settings
):
    # Given five committed orders relayed to a writer process that holds them for a minute
    monkeypatch.setattr(services, "order_placed", lambda pk: None)
    placed = _placed_lock_orders("relayed-killed", 5)
    sale_writer = SaleWriterProcess(server_env(FLASHSALE_PUBLISH_INTERVAL_MS=60_000)).start()
    client = get_redis_client()
    queued = client.llen(TASK_QUEUE)
    try:
        settings.FLASHSALE_SALE_WRITER = sale_writer.path
        publisher = publishing.OrderPublisher(background=False, relay=OrderRelay())
        publisher.add_many(placed)
        assert publisher.flush() == 5 and publisher.relayed == 5

        # When the writer is killed (SIGKILL) before it published them
        sale_writer.kill()
    finally:
        sale_writer.kill()
    assert task_messages_carrying(client, TASK_QUEUE, placed, since=queued) == []

    # Then they are still pending in the database, and the sweeper publishes each again
    assert Order.objects.filter(pk__in=placed, status="pending").count() == 5
    later = timezone.now() + timedelta(seconds=settings.FLASHSALE_REQUEUE_AFTER_SECONDS + 1)
    assert sorted(orders.sweep_orders(now=later).requeued) == sorted(placed)
    carried = task_messages_carrying(client, TASK_QUEUE, placed, since=queued)
    assert sorted(message["args"][0] for message in carried) == sorted(placed)
    assert {message["task"] for message in carried} == {"inventory.tasks.process_order_task"}


def test_a_publisher_whose_writer_is_gone_publishes_its_orders_itself(
    monkeypatch, settings, tmp_path
):
    # Given committed orders in a publisher whose configured writer is not listening
    monkeypatch.setattr(services, "order_placed", lambda pk: None)
    settings.FLASHSALE_SALE_WRITER = str(tmp_path / "nobody.sock")
    placed = _placed_lock_orders("unrelayed", 5)
    publisher = publishing.OrderPublisher(background=False, relay=OrderRelay())
    publisher.add_many(placed)
    client = get_redis_client()
    queued = client.llen(TASK_QUEUE)

    # When it flushes
    assert publisher.flush() == 5

    # Then it sent them to the broker itself
    assert publisher.relayed == 0
    assert task_messages_carrying(client, TASK_QUEUE, placed, since=queued) == [
        {"task": "inventory.tasks.settle_orders_task", "args": [placed]}
    ]


def _refusing_peer(path: str) -> threading.Thread:
    """A peer on `path` that answers every line as a writer that does not know relays does
    (one from before them, during a rolling restart)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        with listener, listener.accept()[0] as conn, conn.makefile("rwb") as stream:
            for _ in stream:
                stream.write(b'{"o": "invalid", "e": "KeyError(\'sale\')"}\n')
                stream.flush()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_publisher_whose_writer_refuses_relays_publishes_them_and_says_so_once(
    monkeypatch, settings, tmp_path, caplog
):
    # Given a publisher whose writer answers relays as one from before them
    monkeypatch.setattr(services, "order_placed", lambda pk: None)
    settings.FLASHSALE_SALE_WRITER = str(tmp_path / "old.sock")
    peer = _refusing_peer(settings.FLASHSALE_SALE_WRITER)
    publisher = publishing.OrderPublisher(background=False, relay=OrderRelay())
    client = get_redis_client()
    queued = client.llen(TASK_QUEUE)
    first = _placed_lock_orders("refused-1", 3)
    second = _placed_lock_orders("refused-2", 4)

    # When it flushes twice
    publisher.add_many(first)
    assert publisher.flush() == 3
    publisher.add_many(second)
    assert publisher.flush() == 4

    # Then it published both itself, and said why once
    assert publisher.relayed == 0
    for placed in (first, second):
        assert task_messages_carrying(client, TASK_QUEUE, placed, since=queued) == [
            {"task": "inventory.tasks.settle_orders_task", "args": [placed]}
        ]
    warned = [r.getMessage() for r in caplog.records if "refused a relay" in r.getMessage()]
    assert len(warned) == 1 and "KeyError" in warned[0], warned
    writer.client()._drop()  # (hangs up: the peer ends)
    peer.join(10)


@pytest.mark.parametrize(
    "ids", [None, "1", [], [0], [-3], [True], [1.5], ["7"], list(range(1, 1002))]
)
def test_the_writer_refuses_a_bad_relay_and_publishes_nothing(writer_in_thread, ids):
    request = {"op": "orders"} if ids is None else {"op": "orders", "ids": ids}

    answer = _raw(writer_in_thread.path, json.dumps(request).encode() + b"\n")

    assert answer == {"o": "invalid", "e": "ids: from 1 to 1000 order keys"}
    stats = writer_in_thread.stats()
    assert stats["relayed"] == stats["handed"] == 0


def test_a_redis_counter_too_high_is_refused_by_the_database(writer_in_thread):
    # Given a lua sale whose Redis counters say 3x what its stock rows hold
    start_sale(sku="widget", stock=20, strategy="lua")
    item = Item.objects.get(sku="widget")
    counter = plumbing.counter()
    for index in range(item.shard_count):
        key = keys.row(item, index)
        counter.set(key, 3 * (counter.get(key) or 0))

    # When buyers take more than the stock through the writer
    sold = refused = 0
    for number in range(50):
        try:
            place_order(sku="widget", qty=1, buyer=f"b{number}")
            sold += 1
        except Exception as error:  # noqa: BLE001 - the answer is what is counted
            assert error.__class__.__name__ == "SoldOut", error
            refused += 1

    # Then the database sold its 20 units and not one more, and Redis was set right
    assert (sold, refused) == (20, 30)
    audit = audit_sale("widget")
    assert audit["oversold"] == 0 and audit["db_stock"] == 0, audit
    assert audit["redis_stock"] == 0 and audit["consistent"], audit
    assert writer_in_thread.sales == 20


@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_a_killed_writer_loses_no_201_and_the_buyers_go_on_the_direct_way(strategy):
    stock = 400
    writer = SaleWriterProcess(server_env()).start()
    server = start_shop(**writer.env())
    try:
        # Given a flood through the writer that outlasts the stock
        sku = f"killed-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=stock, strategy=strategy)
        results = []
        buyers = threading.Thread(
            target=lambda: results.append(
                flood(server.url, sku, attempts=3 * stock, concurrency=BUYERS, pause=0.005)
            )
        )
        buyers.start()

        # When the writer is killed (SIGKILL) once a quarter is sold
        deadline = time.monotonic() + 60
        while Item.objects.get(sku=sku).units_left > stock * 3 // 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        killing = time.monotonic()
        writer.kill()
        killed, killed_at = time.monotonic(), timezone.now()
        buyers.join(120)
        assert not buyers.is_alive()
    finally:
        server.stop()
        writer.kill()
    (result,) = results

    # Then no buyer saw a server error, and every 201 is a committed order
    context = f"{dict(result.statuses)} {dict(result.errors)}"
    # (the checkouts hand their connections to the writer, `shop.handoff`: those it held when
    # it was killed were closed unanswered, and so were those a web process sent into its
    # socket while the dying process was torn down, before that socket was closed; none before
    # the kill, and none after its exit (two seconds allowed for the buyers to see the close):
    # then each web process found the writer gone)
    assert all(killing <= at <= killed + 2 for at in result.failed_at), (
        f"{[round(at - killing, 3) for at in result.failed_at]} s after the kill; {context}"
    )
    assert set(result.statuses) <= {201, 409, 503}, context
    stored = Order.objects.filter(item__sku=sku)
    assert set(result.order_ids) <= {str(pid) for pid in stored.values_list("public_id", flat=True)}
    # and an order without a 201 is one the writer committed and could not answer (its buyer
    # was told busy, or its connection closed: a retry with an idempotency key finds it)
    unanswered = result.statuses[503] + result.transport_failures
    assert 0 <= stored.count() - result.accepted <= unanswered, context
    # the buyers went on selling the direct way once the writer was gone
    assert stored.filter(created_at__gt=killed_at).exists(), context
    audit = audit_sale(sku)
    assert audit["oversold"] == 0, audit
    assert audit["accepted_units"] + audit["db_stock"] == stock, audit
    # units the writer took and never wrote: Redis is short of them until reconciled
    reconcile_sale(sku)
    audit = audit_sale(sku)
    assert audit["consistent"] and audit["redis_stock"] == audit["db_stock"], audit


def test_buyers_find_a_restarted_writer_again(writer_in_thread, settings):
    start_sale(sku="widget", stock=10, strategy="lua")
    place_order(sku="widget", qty=1, buyer="ann")
    assert writer_in_thread.sales == 1

    # When the writer stops, checkouts are served the direct way
    writer_in_thread.stop()
    for _ in range(100):
        if not os.path.exists(writer_in_thread.path):
            break
        time.sleep(0.05)
    place_order(sku="widget", qty=1, buyer="bob")
    assert writer_in_thread.sales == 1

    # and once a writer listens there again, through it
    with serving(writer_in_thread.path) as again:
        place_order(sku="widget", qty=1, buyer="cat")
        assert again.sales == 1
    assert Order.objects.filter(item__sku="widget").count() == 3
    audit = audit_sale("widget")
    assert audit["db_stock"] == audit["redis_stock"] == 7 and audit["consistent"], audit


def _raw(path: str, line: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(line)
        return json.loads(sock.makefile("rb").readline())


def _good_request(item: Item) -> dict:
    """What a buyer sends for one unit of item's sale."""
    return {
        "sku": item.sku,
        "cursor": keys.turn(item),
        "rows": item.shard_count,
        "qty": 1,
        "claim": None,
        "sale": {"item": item.pk, "sale": item.current_sale_id, "qty": 1, "buyer": "ann"},
    }


def test_messages_and_the_batch_parameter_are_compact_json_with_keys_as_strings():
    """What the writer's two ends and the batch statement exchange reads as the standard
    library would read it: no spaces, keys that are numbers written as strings (the levels of
    a batch's rows are keyed by index), one message a line."""
    message = {"o": "sold", "rows": {3: 1}, "levels": {"3": [7, 2]}, "key": None, "ok": True}
    assert stock.compact_json(message) == (
        '{"o":"sold","rows":{"3":1},"levels":{"3":[7,2]},"key":null,"ok":true}'
    )
    line = writer._line(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {**message, "rows": {"3": 1}}


@pytest.mark.parametrize(
    ("line", "change", "why"),
    [
        (b"not json\n", None, "not JSON"),
        (b"[1, 2]\n", None, "not an object"),
        (b'{"qty": 1}\n', None, "KeyError"),
        (None, {"rows": 0}, "at least one counter"),
        (None, {"rows": "10"}, "named by its sku"),
        (None, {"sku": None}, "named by its sku"),
        (None, {"qty": 0}, "qty must be"),
        (None, {"qty": True}, "qty must be"),
        (None, {"sale": 3}, "no sale"),
        (None, {"cursor": "elsewhere:turn"}, "FLASHSALE_REDIS_PREFIX"),
    ],
)
def test_the_writer_refuses_bad_requests_and_takes_nothing(writer_in_thread, line, change, why):
    start_sale(sku="widget", stock=10, strategy="lua")
    item = Item.objects.get(sku="widget")
    levels = plumbing.counter().get_many(keys.rows(item))
    if line is None:
        line = json.dumps({**_good_request(item), **change}).encode() + b"\n"

    answer = _raw(writer_in_thread.path, line)

    assert answer["o"] == "invalid" and why in answer["e"], answer
    assert plumbing.counter().get_many(keys.rows(item)) == levels
    assert writer_in_thread.sales == 0 and Order.objects.count() == 0


def test_sale_writer_command_says_what_is_wrong(writer_in_thread, settings):
    import signal

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    settings.FLASHSALE_SALE_WRITER = ""
    with pytest.raises(CommandError, match="name the socket"):
        call_command("sale", "writer")
    with pytest.raises(CommandError, match="another sale writer is listening"):
        call_command("sale", "writer", "--socket", writer_in_thread.path)
    with pytest.raises(CommandError, match="sale writer:"):
        call_command("sale", "writer", "--socket", "/nonexistent-dir/writer.sock")
    # and the signal handlers it set while it ran are the caller's again
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers


@contextmanager
def _lua_sale_on_a_redis_of_its_own(
    settings, probe_seconds: float, ahead_ms: int = 0
) -> Iterator[tuple[Any, Any]]:
    """A `lua` sale of 10 units selling through a writer in a thread, on a Redis server of the
    test's own (short timeouts), one unit sold through the writer: (the server, the writer).
    The test sells three more; then the audit: 4 sold, none oversold, Redis agreeing. The
    writer takes nothing ahead unless told (`ahead_ms`): each checkout's take goes to Redis."""
    from inventory.breaker import breaker
    from shop.processes.redis_server import RedisServer

    settings.FLASHSALE_SALE_WRITER_AHEAD_MS = ahead_ms
    settings.FLASHSALE_REDIS_TIMEOUT = 0.2
    settings.FLASHSALE_REDIS_CONNECT_TIMEOUT = 0.2
    settings.FLASHSALE_BREAKER_PROBE_SECONDS = probe_seconds
    with RedisServer() as redis_server:
        settings.REDIS_URL = redis_server.url
        try:
            with serving() as writer:
                settings.FLASHSALE_SALE_WRITER = writer.path
                start_sale(sku="widget", stock=10, strategy="lua")
                place_order(sku="widget", qty=1, buyer="ann")
                assert writer.sales == 1
                yield redis_server, writer
        finally:
            breaker.reset()
        audit = audit_sale("widget")
        assert audit["oversold"] == 0 and audit["accepted_units"] == 4, audit
        assert audit["db_stock"] == audit["redis_stock"] == 6 and audit["consistent"], audit


def _sold_through_the_writer_once_the_probe_is_back(writer: Any, after: float) -> None:
    """Redis answers again: `after` seconds on (the breaker's wait over), the first checkout
    starts the breaker's probe in a thread and is served by the fallback; the probe rebuilds
    Redis from the database and closes the breaker, and the writer takes and writes again."""
    from inventory.breaker import breaker

    time.sleep(after)
    cat = place_order(sku="widget", qty=1, buyer="cat").order
    assert cat.fallback and writer.sales == 1
    assert wait_until(lambda: not breaker.is_open, timeout=5)
    dan = place_order(sku="widget", qty=1, buyer="dan").order
    assert not dan.fallback and writer.sales == 2


def test_redis_down_under_the_writer_sends_checkouts_to_the_fallback(settings):
    # Given a lua sale selling through the writer
    with _lua_sale_on_a_redis_of_its_own(settings, probe_seconds=0.2) as (redis_server, writer):
        # When Redis dies, the writer's take fails: nothing is written, and the checkout is
        # served by the database fallback
        redis_server.kill()
        bob = place_order(sku="widget", qty=1, buyer="bob").order
        assert bob.fallback and writer.sales == 1

        # and once Redis is back (empty), rebuilt from the database, through the writer again
        redis_server.restart()
        _sold_through_the_writer_once_the_probe_is_back(writer, after=0.3)


def test_units_held_ahead_when_redis_dies_are_dropped_and_the_rebuild_brings_them_back(settings):
    from inventory.breaker import breaker

    # Given a writer holding a unit of the sale ahead (its one sale so far) when Redis dies
    with _lua_sale_on_a_redis_of_its_own(settings, probe_seconds=0.2, ahead_ms=1000) as (
        redis_server,
        writer,
    ):
        assert wait_until(lambda: writer.held_ahead == 1, timeout=5)
        redis_server.kill()

        # When a checkout that must take from Redis comes (an idempotency key: its claim is set
        # with its take), the take fails: the held unit is dropped, not given back to a dead
        # Redis, and the checkout is served by the fallback
        bob = place_order(sku="widget", qty=1, buyer="bob", idempotency_key="k-bob").order
        assert bob.fallback and writer.sales == 1
        assert writer.held_ahead == 0 and writer.dropped_ahead == 1 and breaker.is_open

        # and once Redis is back (empty), its counters are rebuilt from the database, which
        # holds the dropped unit still, and the writer sells again
        redis_server.restart()
        time.sleep(0.3)
        cat = place_order(sku="widget", qty=1, buyer="cat").order
        assert cat.fallback
        assert wait_until(lambda: not breaker.is_open, timeout=5)
        dan = place_order(sku="widget", qty=1, buyer="dan").order
        assert not dan.fallback and writer.sales == 2
    # (the fixture's audit: 4 sold, the database and Redis agreeing on the 6 left)


def test_the_writer_runs_at_the_niceness_it_is_given():
    # Given a writer process told to run at niceness 7 (raising it needs no privilege)
    writer = SaleWriterProcess({**server_env(), "FLASHSALE_SALE_WRITER_NICE": "7"}).start()
    try:
        # Then, once it answers, its main thread runs at that niceness
        assert os.getpriority(os.PRIO_PROCESS, writer.process.pid) == 7
    finally:
        writer.stop()


def test_a_writer_run_in_process_gives_its_niceness_back(settings, tmp_path):
    import signal

    # Given the command run in this process (its main thread), told to run at niceness 3
    settings.FLASHSALE_SALE_WRITER_NICE = 3
    before = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert before != 3
    path = str(tmp_path / "writer.sock")
    seen = []

    def look_once_it_answers_then_stop() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                writer_stats(path, timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        seen.append(os.getpriority(os.PRIO_PROCESS, os.getpid()))
        os.kill(os.getpid(), signal.SIGTERM)

    looker = threading.Thread(target=look_once_it_answers_then_stop)
    looker.start()
    call_command("sale", "writer", "--socket", path)
    looker.join()
    # Then it ran at that niceness, and the thread is back where it was once it stopped
    assert seen == [3]
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == before


def _holder_request(item: Item, buyer: str, rows: dict[int, int], fences: dict[int, int]) -> dict:
    """A `segmented` holder's sale of rows (index: units) under locks holding `fences`, as
    `sell_batch` takes it from the writer."""
    sale = {
        "public_id": str(uuid.uuid4()),
        "item": item.pk,
        "sale": item.current_sale_id,
        "qty": sum(rows.values()),
        "buyer": buyer,
        "key": None,
        "limit": None,
        "served_by": "segmented",
        "fallback": False,
    }
    # What the writer makes of `write_request(sale, rows, fences)`.
    return {**write_request(sale, rows, fences)["write"], "levels": True}


def test_a_batch_takes_a_holder_s_token_and_refuses_an_older_one(settings):
    # Given a segmented sale whose shard 0 has accepted token 5 and shard 1 token 9
    start_sale(sku="widget", stock=20, strategy="segmented")
    item = Item.objects.get(sku="widget")
    StockShard.objects.filter(sale_id=item.current_sale_id, index=0).update(fence=5)
    StockShard.objects.filter(sale_id=item.current_sale_id, index=1).update(fence=9)
    rows = stock.shard_rows(item.current_sale_id)

    # When a batch holds a newer token for shard 0 and an unfenced lua-style sale of shard 2
    # shares it
    holder = _holder_request(item, "ann", {0: 1}, {0: 7})
    other = {**_holder_request(item, "bob", {2: 1}, {}), "levels": False, "fences": {}}
    answers = stock.sell_batch([holder, other])

    # Then both are sold, the holder is told its row's level and version after the batch, and
    # the row keeps the newer token
    assert [answer["o"] for answer in answers] == ["sold", "sold"]
    assert answers[0]["levels"] == {"0": [rows[0].stock - 1, rows[0].version + 1]}
    assert "levels" not in answers[1]
    shards = {s.index: s for s in StockShard.objects.filter(sale_id=item.current_sale_id)}
    assert (shards[0].fence, shards[2].fence) == (7, 0)

    # When a later batch holds an older token for shard 1 than the row has accepted
    stale = _holder_request(item, "cat", {1: 1}, {1: 8})
    other = {**_holder_request(item, "dan", {3: 1}, {}), "levels": False, "fences": {}}
    answers = stock.sell_batch([stale, other])

    # Then the holder is told to write its sale itself (nothing of it was written), and the
    # other sale is written on its own
    assert [answer["o"] for answer in answers] == ["again", "sold"]
    shards = {s.index: s for s in StockShard.objects.filter(sale_id=item.current_sale_id)}
    assert (shards[1].stock, shards[1].fence) == (rows[1].stock, 9)
    assert shards[3].stock == rows[3].stock - 1
    assert sorted(Order.objects.values_list("buyer", flat=True)) == ["ann", "bob", "dan"]


def test_a_segmented_holder_whose_token_the_rows_refuse_sells_nothing(writer_in_thread):
    # Given a segmented sale whose rows have all accepted a token later than any lock's
    start_sale(sku="widget", stock=20, strategy="segmented")
    item = Item.objects.get(sku="widget")
    StockShard.objects.filter(sale_id=item.current_sale_id).update(fence=2**62)

    # When a buyer checks out through the writer
    with pytest.raises(Busy):
        place_order(sku="widget", qty=1, buyer="ann")

    # Then neither the writer nor the buyer's own write sold anything
    assert writer_in_thread.sales == 0 and Order.objects.count() == 0
    audit = audit_sale("widget")
    assert audit["db_stock"] == 20 and audit["oversold"] == 0, audit


def test_a_segmented_checkout_through_the_writer_copies_its_row_s_level(writer_in_thread):
    start_sale(sku="widget", stock=50, strategy="segmented")  # 5 units a shard
    item = Item.objects.get(sku="widget")

    order = place_order(sku="widget", qty=3, buyer="ann").order

    # The writer wrote it, the workers were handed it, and the hint is the row's level
    assert writer_in_thread.sales == 1 and order.handed_to_workers
    assert Order.objects.get(pk=order.pk).qty == 3
    (index,) = (int(index) for index in order.shard_units)
    row = stock.shard_rows(item.current_sale_id, [index])[index]
    assert plumbing.counter().get(keys.row(item, index)) == row.stock
    audit = audit_sale("widget")
    assert audit["db_stock"] == audit["redis_stock"] == 47 and audit["consistent"], audit


def test_the_writer_releases_a_holder_s_lock_with_its_commit(writer_in_thread):
    start_sale(sku="widget", stock=50, strategy="segmented")  # 5 units a shard
    item = Item.objects.get(sku="widget")

    order = place_order(sku="widget", qty=2, buyer="ann").order

    # The writer committed the sale and released the shard's lock right after, its hint
    # copied with it: the holder let go without a call of its own to Redis
    (index,) = (int(index) for index in order.shard_units)
    assert writer_in_thread.sales == 1 and writer_in_thread.released == 1
    client = get_redis_client()
    assert not any(client.exists(name) for name in keys.shard_locks(item))
    row = stock.shard_rows(item.current_sale_id, [index])[index]
    assert plumbing.counter().get(keys.row(item, index)) == row.stock == 3
    assert writer_stats(writer_in_thread.path)["released"] == 1


def test_the_writer_hands_a_released_shard_lock_to_its_first_waiter(writer_in_thread):
    # Given shard 0's lock held by a holder, and a buyer queued for it in another thread
    start_sale(sku="widget", stock=20, strategy="segmented")
    item = Item.objects.get(sku="widget")
    holder = segmented.shard_lock(item, 0)
    assert holder.acquire(blocking=False)
    waiter = segmented.shard_lock(item, 0)
    client = get_redis_client()
    got: list[tuple[bool, bytes, bytes]] = []

    def wait_for_it() -> None:
        acquired = waiter.acquire(blocking_timeout=10)
        # (the token is the thread's own)
        got.append((acquired, waiter.local.token, client.get(waiter.name)))
        if acquired:
            waiter.release()

    queued = threading.Thread(target=wait_for_it)
    queued.start()
    deadline = time.monotonic() + 5
    while not client.llen(holder.queue_name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.llen(holder.queue_name) == 1

    # When the holder's sale goes to the writer, which is to release the lock after it
    sale = {**_holder_request(item, "ann", {0: 1}, {}), "fences": {}}
    del sale["levels"], sale["rows"], sale["fences"]
    request = write_request(
        sale, {0: 1}, {0: holder.fence}, plumbing.writer_releases(item, {0: holder})
    )
    answer = _raw(writer_in_thread.path, json.dumps(request).encode() + b"\n")

    # Then the sale is committed and the lock released: handed to the waiter, which holds
    # it now, and the hint is the row's level
    assert answer["o"] == "sold" and answer["released"] == ["0"], answer
    queued.join(10)
    ((acquired, token, stored),) = got
    assert acquired and stored == token
    assert plumbing.counter().get(keys.row(item, 0)) == 1  # 2 a shard, one sold


def test_a_redis_that_hangs_under_the_writer_costs_its_loop_one_timeout(settings):
    from inventory.breaker import breaker

    # Given a lua sale selling through the writer
    with _lua_sale_on_a_redis_of_its_own(settings, probe_seconds=0.3) as (redis_server, writer):
        request = json.dumps(_good_request(Item.objects.get(sku="widget"))).encode() + b"\n"

        # When Redis hangs (SIGSTOP: connections are accepted, nothing is answered)
        redis_server.pause()
        answers = [_raw(writer.path, request) for _ in range(5)]

        # Then the first take waits out Redis's timeout and opens the breaker; the next four
        # are answered Redis's error at once, with no script sent
        assert [answer["o"] for answer in answers] == ["redis_down"] * 5, answers
        assert answers[0]["e"] != BREAKER_OPEN, answers
        assert [answer["e"] for answer in answers[1:]] == [BREAKER_OPEN] * 4
        assert writer.skipped_redis == 4 and breaker.is_open
        # and the checkouts meanwhile go to the database fallback
        bob = place_order(sku="widget", qty=1, buyer="bob").order
        assert bob.fallback and writer.sales == 1

        # and once Redis answers again, through the writer again
        redis_server.resume()
        _sold_through_the_writer_once_the_probe_is_back(writer, after=0.4)


def test_the_writer_answers_at_once_and_probes_in_a_thread_while_redis_is_known_down(
    writer_in_thread, settings
):
    from inventory.breaker import breaker

    # Given a lua sale, and this process's breaker in front of Redis open (a failure seen by
    # anyone in the process), its wait not over
    start_sale(sku="widget", stock=10, strategy="lua")
    take = _good_request(Item.objects.get(sku="widget"))
    take["sale"].update(served_by="lua", fallback=False, key=None, limit=None)
    request = json.dumps(take).encode() + b"\n"
    settings.FLASHSALE_BREAKER_PROBE_SECONDS = 60
    breaker.record_failure(ConnectionError("seen elsewhere"))
    try:
        # When a take arrives, the writer calls no script: Redis's error, at once
        assert _raw(writer_in_thread.path, request) == {"o": "redis_down", "e": BREAKER_OPEN}
        assert writer_in_thread.skipped_redis == 1 and breaker.is_open

        # and once the wait is over, the next take queues the probe in a thread, which finds
        # Redis answering and closes the breaker; the takes after it sell
        settings.FLASHSALE_BREAKER_PROBE_SECONDS = 0
        breaker.record_failure(ConnectionError("seen again"))
        assert _raw(writer_in_thread.path, request)["o"] == "redis_down"
        deadline = time.monotonic() + 5
        while breaker.is_open and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not breaker.is_open
        assert _raw(writer_in_thread.path, request)["o"] == "sold"
        assert writer_in_thread.sales == 1 and writer_in_thread.skipped_redis == 2
    finally:
        breaker.reset()


def test_a_holder_releases_its_lock_itself_when_the_writer_cannot(writer_in_thread):
    # Given a writer whose Redis stops answering (a holder's sale needs no take: only the
    # release after its commit goes to Redis)
    start_sale(sku="widget", stock=50, strategy="segmented")
    item = Item.objects.get(sku="widget")
    writer_in_thread._counter.redis = redis.Redis(
        port=_unused_port(),
        socket_connect_timeout=0.2,
        socket_timeout=0.2,
        retry=Retry(NoBackoff(), 0),  # as the shop's client (`get_redis_client`)
    )

    order = place_order(sku="widget", qty=1, buyer="ann").order

    # Then the sale is committed, and its holder released the lock and copied the hint itself
    (index,) = (int(index) for index in order.shard_units)
    assert writer_in_thread.sales == 1 and writer_in_thread.released == 0
    client = get_redis_client()
    assert not any(client.exists(name) for name in keys.shard_locks(item))
    assert plumbing.counter().get(keys.row(item, index)) == 4
    audit = audit_sale("widget")
    assert audit["db_stock"] == audit["redis_stock"] == 49 and audit["consistent"], audit


def test_a_handed_off_holders_locks_the_writer_could_not_release_go_on_recovery(writer_in_thread):
    from inventory.breaker import breaker
    from locking import Lock

    # Given a segmented sale, one of whose shard locks a handed-off holder holds
    start_sale(sku="widget", stock=50, strategy="segmented")
    item = Item.objects.get(sku="widget")
    client = get_redis_client()
    name = keys.shard_locks(item)[0]
    holder = Lock(client, name, timeout=60)
    assert holder.acquire(blocking=False)
    token = holder.local.token

    # When its sale is answered while the writer's breaker in front of Redis is open
    breaker.record_failure(ConnectionError("seen elsewhere"))
    writer_in_thread._release_holder({"0": [name, token.decode(), keys.row(item, 0)]})

    # Then nothing is sent to Redis: the lock is still the holder's
    assert client.get(name) == token
    # and once the breaker's probe finds Redis answering, its recovery releases it
    assert breaker.probe_now()
    assert not client.exists(name)


def test_after_redis_fails_on_a_holder_s_first_lock_the_rest_go_to_the_recovery_untried(
    writer_in_thread,
):
    from inventory.breaker import breaker
    from locking import Lock

    # Given a handed-off holder of two shard locks
    start_sale(sku="widget", stock=50, strategy="segmented")
    item = Item.objects.get(sku="widget")
    client = get_redis_client()
    names = keys.shard_locks(item)[:2]
    release = {}
    for index, name in enumerate(names):
        holder = Lock(client, name, timeout=60)
        assert holder.acquire(blocking=False)
        release[str(index)] = [name, holder.local.token.decode(), keys.row(item, index)]
    calls: list[Any] = []

    class Counting(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            calls.append(args[0])
            return super().execute_command(*args, **options)

    # When the writer's Redis fails on the first release (nothing listens there)
    real = writer_in_thread._counter.redis
    writer_in_thread._counter.redis = Counting(
        port=_unused_port(),
        socket_connect_timeout=0.2,
        socket_timeout=0.2,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        writer_in_thread._release_holder(release)
    finally:
        writer_in_thread._counter.redis = real

    # Then the second lock is not tried (it would wait out the same timeout): both are still
    # the holder's, and the breaker is open
    assert len(calls) == 1 and breaker.is_open
    assert [client.get(name) for name in names] == [held[1].encode() for held in release.values()]
    # and once the breaker's probe finds Redis answering, its recovery releases both
    assert breaker.probe_now()
    assert not any(client.exists(name) for name in names)


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"release": {"1": ["lock", "token", "hint"]}}, "release of row '1'"),
        ({"release": {"0": ["lock", 7, "hint"]}}, "release of row '0'"),
        ({"release": {"0": ["lock", "token"]}}, "release of row '0'"),
        ({"release": ["lock"]}, "release names"),
        ({"write": 3}, "no sale to write"),
        ({"rows": {}}, "names its rows"),
        ({"rows": {"x": 1}}, "row 'x'"),
        ({"rows": {"0": 0}}, "row '0'"),
        ({"rows": {"0": True}}, "row '0'"),
        ({"fences": {"1": 4}}, "fence 4 for row '1'"),
        ({"fences": {"0": "4"}}, "fence '4'"),
        ({"sale": "1"}, "no sale to write"),
    ],
)
def test_the_writer_refuses_bad_writes_and_writes_nothing(writer_in_thread, change, why):
    start_sale(sku="widget", stock=10, strategy="segmented")
    item = Item.objects.get(sku="widget")
    request = write_request(
        {"item": item.pk, "sale": item.current_sale_id, "qty": 1, "buyer": "ann"}, {0: 1}, {0: 3}
    )
    if "write" in change:
        request = change
    elif "release" in change:
        request.update(change)
    else:
        request["write"].update(change)

    answer = _raw(writer_in_thread.path, json.dumps(request).encode() + b"\n")

    assert answer["o"] == "invalid" and why in answer["e"], answer
    assert writer_in_thread.sales == 0 and Order.objects.count() == 0
    assert audit_sale("widget")["db_stock"] == 10
