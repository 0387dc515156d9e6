"""`lua` through the sale writer: every web process hands its sales to one process that takes
their units in one script and writes them in shared commits. Each sale keeps its own guards;
every 201 has its committed order; nothing is oversold when Redis grants too much; a writer
that dies mid-flood loses no 201 and sells nothing twice, and the buyers go on the direct way."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from inventory import keys
from inventory.models import Item, Order
from inventory.orders import reconcile_sale
from inventory.redis_client import get_redis_client
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import plumbing
from inventory.writer import writer_stats
from loadtest.flood import flood
from shop.processes.servers import SaleWriter as SaleWriterProcess
from tests.conftest import TASK_QUEUE, server_env, start_shop
from tests.conftest import writer_in_thread as serving
from tests.support import flood_sells_exactly_the_stock, task_messages_carrying

STOCK = 60
BUYERS = 24
ATTEMPTS = 200
ROUNDS = 3

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def writer_process(django_db_setup, django_db_blocker):
    writer = SaleWriterProcess(server_env()).start()
    yield writer
    writer.stop()


@pytest.fixture(scope="module")
def writer_shop(writer_process):
    server = start_shop(**writer_process.env())
    yield server
    server.stop()


def test_a_flood_through_the_writer_sells_exactly_the_stock_in_shared_commits(
    writer_shop, writer_process
):
    before = writer_stats(writer_process.path)
    for _ in range(ROUNDS):
        # Given a lua sale on a server whose web processes send their sales to the writer
        sku = f"written-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=STOCK, strategy="lua")

        # When a crowd larger than the stock buys, many at a time
        # Then exactly the stock is sold, each 201 is a committed order, nothing else is
        flood_sells_exactly_the_stock(
            writer_shop.url, sku, stock=STOCK, attempts=ATTEMPTS, buyers=BUYERS
        )
    # and the writer wrote them all, several to a commit
    after = writer_stats(writer_process.path)
    written = after["sales"] - before["sales"]
    assert written == ROUNDS * STOCK
    assert after["batches"] - before["batches"] < written


def test_the_writer_hands_each_order_it_commits_to_the_workers_once(writer_shop, writer_process):
    # Given a lua sale sold through the writer, on a broker whose queue nobody consumes here
    before = writer_stats(writer_process.path)["handed"]
    client = get_redis_client()
    queued = client.llen(TASK_QUEUE)
    sku = f"handed-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=STOCK, strategy="lua")

    # When a crowd buys it out
    placed = list(
        flood_sells_exactly_the_stock(
            writer_shop.url, sku, stock=STOCK, attempts=ATTEMPTS, buyers=BUYERS
        ).values_list("pk", flat=True)
    )

    # Then the writer handed every order it sold to the workers
    assert writer_stats(writer_process.path)["handed"] - before == STOCK
    # and each is carried by one settle message, and by no other: the writer published them,
    # several to a message, and the web processes, told so, none
    deadline = time.monotonic() + 10
    while True:
        messages = task_messages_carrying(client, TASK_QUEUE, placed, since=queued)
        carried = [pk for message in messages for pk in message["args"][0]]
        if sorted(carried) == sorted(placed) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(pk for pk in carried if pk in set(placed)) == sorted(placed), messages
    assert {message["task"] for message in messages} == {"inventory.tasks.settle_orders_task"}
    assert len(messages) < len(placed)


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


def test_a_killed_writer_loses_no_201_and_the_buyers_go_on_the_direct_way():
    stock = 400
    writer = SaleWriterProcess(server_env()).start()
    server = start_shop(**writer.env())
    try:
        # Given a flood through the writer that outlasts the stock
        sku = f"killed-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=stock, strategy="lua")
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
        writer.kill()
        killed_at = timezone.now()
        buyers.join(120)
        assert not buyers.is_alive()
    finally:
        server.stop()
        writer.kill()
    (result,) = results

    # Then no buyer saw a server error, and every 201 is a committed order
    context = f"{dict(result.statuses)} {dict(result.errors)}"
    assert result.transport_failures == 0, context
    assert set(result.statuses) <= {201, 409, 503}, context
    stored = Order.objects.filter(item__sku=sku)
    assert set(result.order_ids) <= {str(pid) for pid in stored.values_list("public_id", flat=True)}
    # and an order without a 201 is one the writer committed and could not answer (its buyer
    # was told busy: a retry with the idempotency key finds it)
    assert 0 <= stored.count() - result.accepted <= result.statuses[503], context
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


@pytest.mark.parametrize(
    ("line", "change", "why"),
    [
        (b"not json\n", None, "Expecting value"),
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


def test_redis_down_under_the_writer_sends_checkouts_to_the_fallback(settings):
    from inventory.breaker import breaker
    from shop.processes.redis_server import RedisServer

    settings.FLASHSALE_REDIS_TIMEOUT = 0.2
    settings.FLASHSALE_REDIS_CONNECT_TIMEOUT = 0.2
    settings.FLASHSALE_BREAKER_PROBE_SECONDS = 0.2
    with RedisServer() as redis_server:
        settings.REDIS_URL = redis_server.url
        try:
            with serving() as writer:
                settings.FLASHSALE_SALE_WRITER = writer.path
                # Given a lua sale selling through the writer
                start_sale(sku="widget", stock=10, strategy="lua")
                place_order(sku="widget", qty=1, buyer="ann")
                assert writer.sales == 1

                # When Redis dies, the writer's take fails: nothing is written, and the
                # checkout is served by the database fallback
                redis_server.kill()
                bob = place_order(sku="widget", qty=1, buyer="bob").order
                assert bob.fallback and writer.sales == 1

                # and once Redis is back (empty), rebuilt from the database, through the
                # writer again
                redis_server.restart()
                time.sleep(0.3)
                cat = place_order(sku="widget", qty=1, buyer="cat").order
                assert not cat.fallback and writer.sales == 2
        finally:
            breaker.reset()
        audit = audit_sale("widget")
        assert audit["oversold"] == 0 and audit["accepted_units"] == 3, audit
        assert audit["db_stock"] == audit["redis_stock"] == 7 and audit["consistent"], audit


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
