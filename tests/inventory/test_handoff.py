"""A `lua` checkout, or a `segmented` shard's holder, handed to the sale writer with its client's
connection (`shop.handoff`): the web process sends the sale (and the holder's locks) and the
connection and takes its next request; the writer answers the client once the order row is
committed (releasing the locks), or as a direct checkout would when its batch did not sell it.
Real gunicorn, a real writer process, real sockets."""

from __future__ import annotations

import array
import contextlib
import http.client
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import psycopg
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from inventory import keys, writer
from inventory.models import Item, Order, StockShard
from inventory.redis_client import get_redis_client
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.stock import SaleRecorder, StockRow, shard_rows
from inventory.strategies import plumbing, segmented
from inventory.writer import writer_stats
from loadtest.flood import flood
from shop.processes.ports import free_port
from tests.conftest import TEST_API_TOKEN, start_shop, test_database_url, wait_until
from tests.conftest import writer_in_thread as serving
from tests.support import NGINX, flood_sells_exactly_the_stock, nginx_serving, nginx_site

STOCK = 60
BUYERS = 24
ATTEMPTS = 200
ROUNDS = 3

pytestmark = pytest.mark.django_db(transaction=True)


def _post(url: str, body: dict) -> tuple[int, dict[str, str], dict]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request(
            "POST", "/api/checkout", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        payload = json.loads(response.read())
        return response.status, dict(response.getheaders()), payload
    finally:
        connection.close()


def _no_lock_held(sku: str) -> bool:
    """Whether every shard lock of sku's sale is free (a hand-off leaves none behind)."""
    return get_redis_client().exists(*keys.shard_locks(Item.objects.get(sku=sku))) == 0


def _stats_delta(writer_process, before: dict) -> dict:
    after = writer_stats(writer_process.path)
    counted = ("answered", "answered_directly", "sales", "locked", "taken_ahead")
    return {key: after[key] - before[key] for key in counted}


@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_a_handed_off_flood_sells_exactly_the_stock_and_the_writer_answers_the_buyers(
    writer_shop, writer_process, strategy
):
    before = writer_stats(writer_process.path)
    for _ in range(ROUNDS):
        # Given a sale on a server whose checkouts hand their connections to the writer
        sku = f"handoff-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=STOCK, strategy=strategy)

        # When a crowd larger than the stock buys, many at a time, without idempotency keys
        # Then exactly the stock is sold, each 201 a committed order, every other answer sold out
        flood_sells_exactly_the_stock(
            writer_shop.url, sku, stock=STOCK, attempts=ATTEMPTS, buyers=BUYERS
        )
        # and no shard lock was left held
        assert _no_lock_held(sku)

    # and the writer answered every one of those buyers itself, none the direct way; for
    # `segmented`, each sale written under a shard lock the writer took for it; nothing was
    # taken ahead (a handed-off checkout's next one comes from a web process, not its buyer)
    assert _stats_delta(writer_process, before) == {
        "answered": ROUNDS * ATTEMPTS,
        "answered_directly": 0,
        "sales": ROUNDS * STOCK,
        "locked": ROUNDS * STOCK if strategy == "segmented" else 0,
        "taken_ahead": 0,
    }


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    answer = requests.get(
        f"{url}/metrics", headers={"Authorization": f"Bearer {TEST_API_TOKEN}"}, timeout=10
    )
    assert answer.status_code == 200, answer.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def test_metrics_count_what_the_writer_answered_handed_off_checkouts(writer_shop):
    # Given a lua sale of 5 units with a limit of 4 a buyer, on a server that hands its
    # checkouts to the writer, and the metrics as they stand
    sku = f"metered-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=5, strategy="lua", limit=4)
    before = _scrape(writer_shop.url)

    # When one buyer checks out 5 times (4 sold, then her limit) and two others once each (1
    # sold, then sold out), none with an idempotency key
    statuses = [_post(writer_shop.url, {"sku": sku, "qty": 1, "buyer": "ann"})[0] for _ in "12345"]
    statuses += [_post(writer_shop.url, {"sku": sku, "qty": 1, "buyer": who})[0] for who in "bc"]
    after = _scrape(writer_shop.url)

    # Then the web processes count all 7 as handed off, and the writer's figures, read at the
    # same scrape, say what it answered them: 5 accepted (its batches), one limit reached
    # (answered the direct way), one sold out; each timed from its arrival in the web process
    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert statuses == [201, 201, 201, 201, 409, 201, 409], statuses
    assert after[("flashsale_sale_writer_up", ())] == 1
    assert delta("flashsale_checkouts_total", strategy="lua", outcome="handed_off") == 7
    answered = "flashsale_sale_writer_checkouts_total"
    assert delta(answered, strategy="lua", outcome="accepted") == 5
    assert delta(answered, strategy="lua", outcome="limit_reached") == 1
    assert delta(answered, strategy="lua", outcome="sold_out") == 1
    timed = "flashsale_sale_writer_checkout_duration_seconds"
    assert delta(f"{timed}_count", strategy="lua") == 7
    assert delta(f"{timed}_bucket", strategy="lua", le="+Inf") == 7
    assert 0 < delta(f"{timed}_sum", strategy="lua") < 7 * 5.0
    assert delta("flashsale_sale_writer_sales_total") == 5


def test_the_writer_s_checkout_times_are_counted_in_cumulative_buckets(monkeypatch):
    # Given the writer's count of handed-off checkouts, and a clock it reads at each answer
    answered = writer.Answered()
    clock = [0.0]
    monkeypatch.setattr(writer.time, "monotonic", lambda: clock[0])

    # When three lua checkouts are answered 0.5 ms, 3 ms and 10 s after they began, and a
    # segmented one 1 ms after (a bound is in its own bucket)
    for seconds, strategy, outcome in (
        (0.0005, "lua", "accepted"),
        (0.003, "lua", "accepted"),
        (10.0, "lua", "busy"),
        (0.001, "segmented", "sold_out"),
    ):
        clock[0] = seconds
        answered.count(strategy, outcome, 0.0)
    stats = answered.stats()

    # Then each outcome is counted, and each strategy's times are in Prometheus's form
    assert stats["outcomes"] == [
        ["lua", "accepted", 2],
        ["lua", "busy", 1],
        ["segmented", "sold_out", 1],
    ]
    lua = dict((str(bound), count) for bound, count in stats["seconds"]["lua"]["buckets"])
    assert (lua["0.001"], lua["0.0025"], lua["0.005"], lua["2.5"], lua["5.0"]) == (1, 1, 2, 2, 2)
    assert lua["+Inf"] == 3 and stats["seconds"]["lua"]["sum"] == pytest.approx(10.0035)
    segmented = stats["seconds"]["segmented"]["buckets"]
    assert segmented[0] == [0.001, 1] and segmented[-1] == ["+Inf", 1]


def test_a_hand_off_that_says_it_began_elsewhere_in_time_is_timed_from_its_arrival():
    # A checkout's start is taken from its web process only where it is plausible: a number of
    # this host's clock, before the writer read it and less than a minute before
    arrived = 1000.0
    assert writer._began(999.5, arrived) == 999.5
    for said in (None, "999.5", 1000.5, arrived - writer.MOST_BEGUN - 1, float("nan"), True):
        assert writer._began(said, arrived) == arrived


def test_metrics_say_when_the_writer_does_not_answer(tmp_path):
    # Given a server configured with a sale writer that is not running
    server = start_shop(FLASHSALE_SALE_WRITER=str(tmp_path / "nobody.sock"))
    try:
        # Then a scrape still answers, the writer shown down and none of its figures
        samples = _scrape(server.url)
    finally:
        server.stop()
    assert samples[("flashsale_sale_writer_up", ())] == 0
    assert not [name for name, _ in samples if name.startswith("flashsale_sale_writer_c")]


@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_each_201_of_the_writer_names_an_order_already_committed(writer_shop, strategy):
    # Given a sale
    sku = f"committed-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=STOCK, strategy=strategy)
    dsn = test_database_url()
    missing: list[str] = []
    answers: list[int] = []

    def buy(worker: int) -> None:
        # Each buyer looks its order up on a connection of its own the moment its 201 arrives
        with psycopg.connect(dsn, autocommit=True) as database:
            for attempt in range(ATTEMPTS // BUYERS + 1):
                status, _, payload = _post(
                    writer_shop.url, {"sku": sku, "qty": 1, "buyer": f"c-{worker}-{attempt}"}
                )
                answers.append(status)
                if status != 201:
                    continue
                found = database.execute(
                    "SELECT 1 FROM inventory_order WHERE public_id = %s", [payload["order"]]
                ).fetchone()
                if found is None:
                    missing.append(payload["order"])

    threads = [threading.Thread(target=buy, args=(worker,)) for worker in range(BUYERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)

    # Then every order a 201 named was in the database already
    assert answers.count(201) == STOCK and set(answers) == {201, 409}, answers
    assert missing == []


def test_the_writer_s_answers_are_the_api_s(writer_shop):
    # Given a lua sale of two units
    sku = f"same-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=2, strategy="lua")

    # When one buyer checks out without a key (handed off) and one with a key (waits)
    handed = _post(writer_shop.url, {"sku": sku, "qty": 1, "buyer": "a"})
    waited = _post(writer_shop.url, {"sku": sku, "qty": 1, "buyer": "b", "idempotency_key": "k-b"})
    sold_out_handed = _post(writer_shop.url, {"sku": sku, "qty": 1, "buyer": "c"})
    sold_out_waited = _post(
        writer_shop.url, {"sku": sku, "qty": 1, "buyer": "d", "idempotency_key": "k"}
    )

    # Then both answers have the same status, headers and body, but for the values that name
    # the order
    def shape(answer: tuple[int, dict[str, str], dict]) -> tuple:
        status, headers, payload = answer
        names = sorted(name.lower() for name in headers if name.lower() != "date")
        return status, names, headers.get("Content-Type"), sorted(payload)

    assert shape(handed) == shape(waited)
    assert handed[0] == 201 and handed[1]["Location"] == f"/api/orders/{handed[2]['order']}"
    assert {key: handed[2][key] for key in ("sku", "qty", "buyer", "status", "strategy")} == {
        "sku": sku,
        "qty": 1,
        "buyer": "a",
        "status": "pending",
        "strategy": "lua",
    }
    assert Order.objects.filter(public_id=handed[2]["order"], buyer="a", qty=1).exists()
    assert shape(sold_out_handed) == shape(sold_out_waited)
    assert sold_out_handed[0] == 409 and sold_out_handed[2] == sold_out_waited[2]


@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_a_refusal_of_the_batch_is_answered_as_a_direct_checkout_would_be(
    writer_shop, writer_process, strategy
):
    # Given a sale with a per-buyer limit of one
    sku = f"limit-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=10, strategy=strategy, limit=1)
    before = writer_stats(writer_process.path)

    # When a buyer checks out twice, without a key
    first = _post(writer_shop.url, {"sku": sku, "qty": 1, "buyer": "once"})
    second = _post(writer_shop.url, {"sku": sku, "qty": 1, "buyer": "once"})

    # Then the second is refused by the database's limit, answered by one of the writer's
    # threads with the API's error (a holder's lock released first), and Redis agrees with the
    # database
    assert first[0] == 201
    assert second[0] == 409 and second[2]["error"] == "limit_reached", second
    assert _stats_delta(writer_process, before)["answered_directly"] == 1
    assert _no_lock_held(sku)
    audit = audit_sale(sku)
    assert audit["accepted_units"] == 1 and audit["db_stock"] == 9, audit
    assert audit["redis_stock"] == 9 and audit["consistent"], audit


def test_redis_granting_too_much_to_handed_off_checkouts_oversells_nothing(
    writer_shop, writer_process
):
    # Given a lua sale whose Redis counters say 3x what its stock rows hold
    sku = f"toohigh-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=20, strategy="lua")
    item = Item.objects.get(sku=sku)
    counter = plumbing.counter()
    for index in range(item.shard_count):
        key = keys.row(item, index)
        counter.set(key, 3 * (counter.get(key) or 0))
    before = writer_stats(writer_process.path)

    # When a crowd handed to the writer buys more than the stock
    result = flood(writer_shop.url, sku, attempts=80, concurrency=8)

    # Then the database sold its 20 units and not one more; the batches it refused were sold
    # again the direct way, and Redis was set right
    context = f"{dict(result.statuses)} {dict(result.errors)}"
    assert result.transport_failures == 0 and result.server_errors == 0, context
    assert result.accepted == 20 and result.errors == {"sold_out": 60}, context
    assert _stats_delta(writer_process, before)["answered_directly"] > 0
    audit = audit_sale(sku)
    assert audit["oversold"] == 0 and audit["db_stock"] == 0, audit
    assert audit["redis_stock"] == 0 and audit["consistent"], audit


@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_with_no_writer_listening_a_checkout_is_served_the_direct_way(tmp_path, strategy):
    # Given a server configured with a writer that is not there
    server = start_shop(FLASHSALE_SALE_WRITER=str(tmp_path / "nobody.sock"))
    try:
        sku = f"nowriter-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=STOCK, strategy=strategy)

        # When a crowd buys it out
        # Then each checkout is served again in its web process, the direct way (a holder's
        # locks released, not left to expire): exactly the stock sold, no answer lost
        flood_sells_exactly_the_stock(server.url, sku, stock=STOCK, attempts=ATTEMPTS, buyers=8)
        assert _no_lock_held(sku)
    finally:
        server.stop()


@pytest.mark.skipif(NGINX is None, reason="no nginx on this machine (make nginx)")
def test_behind_the_proxy_the_writer_answers_nginx_s_connections(
    writer_shop, writer_process, tmp_path
):
    # Given the shop behind deploy/nginx.conf, which reads each answer whole and closes
    port = free_port()
    with nginx_serving(nginx_site(writer_shop.port, port), tmp_path, port) as url:
        sku = f"proxied-{uuid.uuid4().hex[:8]}"
        start_sale(sku=sku, stock=STOCK, strategy="lua")
        before = writer_stats(writer_process.path)

        # When a crowd buys through the proxy
        # Then exactly the stock is sold, every answer whole, and the writer answered them
        flood_sells_exactly_the_stock(url, sku, stock=STOCK, attempts=ATTEMPTS, buyers=BUYERS)
    assert _stats_delta(writer_process, before)["answered"] == ATTEMPTS


def test_holders_refused_by_their_batch_leave_no_lock_behind_them(writer_shop, writer_process):
    # Given a segmented sale whose shard hints say 3x what its rows hold, at a version no copy
    # from the database replaces: every holder picks a shard, and once its units are gone its
    # batch finds the row short, and so does its direct sale after it
    sku = f"short-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=20, strategy="segmented")
    item = Item.objects.get(sku=sku)
    rows = shard_rows(item.current_sale_id)
    stuck = {
        i: StockRow(stock=3 * row.stock, version=row.version + 10**9) for i, row in rows.items()
    }
    plumbing.write_hints(item, stuck, force=True)
    before = writer_stats(writer_process.path)

    # When a crowd handed to the writer buys more than the stock, many at a time
    result = flood(writer_shop.url, sku, attempts=200, concurrency=BUYERS)

    # Then the refused holders' locks were released before anyone waited on them for long:
    # no buyer was answered busy, exactly the stock was sold, and no lock is left held
    context = f"{dict(result.statuses)} {dict(result.errors)}"
    assert result.transport_failures == 0 and result.server_errors == 0, context
    assert result.accepted == 20 and result.errors == {"sold_out": 180}, context
    assert _stats_delta(writer_process, before)["answered_directly"] > 0
    assert _no_lock_held(sku)
    audit = audit_sale(sku)
    assert audit["oversold"] == 0 and audit["db_stock"] == 0, audit


@contextlib.contextmanager
def _every_shard_held(item: Item) -> Iterator[list]:
    """Lock every shard of item's sale as holders elsewhere would; yields the locks, and
    releases those still in the list afterwards."""
    held = [segmented.shard_lock(item, index) for index in range(item.shard_count)]
    for lock in held:
        assert lock.acquire(blocking=False)
    try:
        yield held
    finally:
        for lock in held:
            lock.release()


def test_a_handed_off_checkout_waits_in_the_writer_for_a_shard_held_elsewhere(
    writer_shop, writer_process
):
    # Given a segmented sale whose every shard lock is held by holders outside the writer
    sku = f"held-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=20, strategy="segmented")
    item = Item.objects.get(sku=sku)
    before = writer_stats(writer_process.path)
    answers: list[tuple[int, dict[str, str], dict]] = []
    buyer = threading.Thread(
        target=lambda: answers.append(_post(writer_shop.url, {"sku": sku, "qty": 1, "buyer": "b"}))
    )
    with _every_shard_held(item) as held:
        # When a buyer checks out, handed to the writer
        buyer.start()

        # Then it waits in the writer, unanswered, while every shard stays locked
        waits = lambda: writer_stats(writer_process.path)["lock_waits"]  # noqa: E731
        assert wait_until(lambda: waits() > before["lock_waits"], timeout=10, interval=0.01)
        time.sleep(0.3)
        assert answers == []

        # and once shard 3 is free, it is sold from that shard under a lock the writer took,
        # its wait reported as the view reports one (Server-Timing)
        held.pop(3).release()
        buyer.join(10)
    status, headers, payload = answers[0]
    assert status == 201, payload
    waited = float(headers["Server-Timing"].removeprefix("lock;dur="))
    assert waited >= 300, headers
    assert Order.objects.get(public_id=payload["order"]).shard_units == {"3": 1}
    assert _stats_delta(writer_process, before)["locked"] == 1
    assert _no_lock_held(sku)
    audit = audit_sale(sku)
    assert audit["accepted_units"] == 1 and audit["consistent"], audit


def test_a_handed_off_checkout_no_single_shard_holds_is_sold_from_several(
    writer_shop, writer_process
):
    # Given a segmented sale of 20 units over 10 shards: 2 a shard
    sku = f"spread-{uuid.uuid4().hex[:8]}"
    start_sale(sku=sku, stock=20, strategy="segmented")
    before = writer_stats(writer_process.path)

    # When a buyer asks for 5, then for 16 (more than the 15 left)
    status, _, payload = _post(writer_shop.url, {"sku": sku, "qty": 5, "buyer": "big"})
    refused = _post(writer_shop.url, {"sku": sku, "qty": 16, "buyer": "bigger"})

    # Then the first is sold the direct way by the writer's thread, from three shards, lowest
    # first; the second is answered sold out, with what is left
    assert status == 201, payload
    assert Order.objects.get(public_id=payload["order"]).shard_units == {"0": 2, "1": 2, "2": 1}
    assert refused[0] == 409 and refused[2]["detail"] == f"{sku}: only 15 left, 16 requested"
    delta = _stats_delta(writer_process, before)
    assert (delta["answered"], delta["answered_directly"], delta["locked"]) == (2, 1, 0)
    assert _no_lock_held(sku)
    audit = audit_sale(sku)
    assert audit["db_stock"] == audit["redis_stock"] == 15 and audit["consistent"], audit


REPLY = {"version": "HTTP/1.1", "server": "test", "headers": []}


@contextlib.contextmanager
def _handed_by_hand(path: str, request: dict) -> Iterator[socket.socket]:
    """Hand `request` to the writer on `path` as the shop's worker does, with one end of a
    socket pair as the client's connection; yields the other end, the client's."""
    client, handed = socket.socketpair()
    client.settimeout(10)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            fds = array.array("i", [handed.fileno()])
            line = json.dumps({**request, "reply": REPLY}).encode() + b"\n"
            conn.sendmsg([line], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            handed.close()
            yield client
    finally:
        client.close()


def _lock_request(item: Item, buyer: str, start: int = 0) -> dict:
    record = SaleRecorder(item=item, qty=1, buyer=buyer, idempotency_key=None, limit=None)
    return writer.lock_request(
        sku=item.sku,
        shards=item.shard_count,
        start=start,
        qty=1,
        sale=record.request(served_by="segmented"),
        name=keys.shard_locks(item)[start],
    )


def _lua_request(
    item: Item, buyer: str, *, limit: int | None = None, cursor: str | None = None
) -> dict:
    """A lua checkout's request for one unit, as a web process hands it off."""
    record = SaleRecorder(item=item, qty=1, buyer=buyer, idempotency_key=None, limit=limit)
    return writer.sale_request(
        sku=item.sku,
        cursor=cursor or keys.turn(item),
        rows=item.shard_count,
        qty=1,
        claim=None,
        sale=record.request(served_by="lua"),
    )


@pytest.mark.parametrize(
    ("strategy", "request_of"), [("lua", _lua_request), ("segmented", _lock_request)]
)
def test_handed_off_checkouts_wait_for_company_then_go_in_one_batch(settings, strategy, request_of):
    # Given a writer that takes handed-off checkouts (`lua`'s, and `segmented`'s, whose shards
    # it locks at the take) three at a time when nothing is in flight, and would wait 30 s for
    # company for fewer
    settings.FLASHSALE_SALE_WRITER_LINGER_US = 30_000_000
    settings.FLASHSALE_SALE_WRITER_COMPANY = 3
    start_sale(sku="widget", stock=10, strategy=strategy)
    item = Item.objects.get(sku="widget")
    with serving() as sale_writer, contextlib.ExitStack() as stack:
        # When two buyers' checkouts are handed to it
        clients = [
            stack.enter_context(_handed_by_hand(sale_writer.path, request_of(item, buyer)))
            for buyer in ("ann", "bob")
        ]
        # Then neither is taken yet: they wait for company, no shard locked for them
        assert wait_until(lambda: len(sale_writer._pending) == 2, timeout=5, interval=0.01)
        time.sleep(0.5)
        assert sale_writer.batches == 0 and sale_writer.locked == 0
        assert plumbing.rows_total(item) == 10

        # and once a third one is there, the three are taken and written in one batch
        third = _handed_by_hand(sale_writer.path, request_of(item, "cat"))
        clients.append(stack.enter_context(third))
        answers = [client.recv(65536) for client in clients]
        assert sale_writer.sales == 3 and sale_writer.batches == 1
    assert all(answer.startswith(b"HTTP/1.1 201 Created\r\n") for answer in answers), answers
    audit = audit_sale("widget")
    assert audit["db_stock"] == 7 and audit["accepted_units"] == 3 and audit["consistent"], audit


def test_a_refused_checkout_s_shard_lock_is_released_while_the_writer_s_threads_are_busy(
    writer_in_thread,
):
    # Given a segmented sale whose rows have accepted a later token than any lock's (a batch
    # refuses every sale written under a lock), and every thread of the writer busy
    start_sale(sku="widget", stock=20, strategy="segmented")
    item = Item.objects.get(sku="widget")
    StockShard.objects.filter(sale_id=item.current_sale_id).update(fence=2**62)
    gate = threading.Event()
    for _ in range(writer.DIRECT_THREADS):
        writer_in_thread._directly.submit(gate.wait, 30)

    # When a checkout is handed to the writer, which locks a shard for it
    with _handed_by_hand(writer_in_thread.path, _lock_request(item, "ann")) as client:
        assert wait_until(lambda: writer_in_thread.locked == 1, timeout=5, interval=0.01)

        # Then the lock is released at once by the writer's own thread, well within the
        # lock's lifetime, though no other thread is free to sell the checkout
        assert wait_until(lambda: _no_lock_held("widget"), timeout=1, interval=0.01)

        # and once a thread is free, the client is answered as a direct checkout would be (the
        # rows refuse every token: busy), nothing sold
        gate.set()
        answer = client.recv(65536)
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
    assert b'"error": "busy"' in answer
    assert Order.objects.count() == 0


def test_a_checkout_whose_shards_stay_locked_is_answered_busy(writer_in_thread):
    # Given a segmented sale whose every shard stays locked by holders elsewhere, and a writer
    # whose checkouts wait a fifth of a second for a shard
    start_sale(sku="widget", stock=20, strategy="segmented")
    item = Item.objects.get(sku="widget")
    writer_in_thread.lock_wait = 0.2
    with _every_shard_held(item):
        # When a checkout is handed to it
        with _handed_by_hand(writer_in_thread.path, _lock_request(item, "ann")) as client:
            answer = client.recv(65536)

    # Then it is answered busy once its wait is over, as a holder whose wait ran out is, and
    # nothing is sold
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
    assert b"Retry-After: " in answer and b"every shard holding 1 stayed locked" in answer
    assert writer_in_thread.lock_waits == 1 and writer_in_thread.locked == 0
    assert Order.objects.count() == 0


def test_a_checkout_waiting_for_a_shard_when_the_writer_stops_is_answered_busy(writer_in_thread):
    # Given a segmented sale whose every shard is locked elsewhere, and a checkout handed to the
    # writer that waits there for one
    start_sale(sku="widget", stock=20, strategy="segmented")
    item = Item.objects.get(sku="widget")
    with (
        _every_shard_held(item),
        _handed_by_hand(writer_in_thread.path, _lock_request(item, "ann")) as client,
    ):
        assert wait_until(lambda: writer_in_thread.lock_waits == 1, timeout=5, interval=0.01)

        # When the writer is stopped
        writer_in_thread.stop()
        answer = client.recv(65536)

    # Then the checkout is answered busy (a retry finds a writer, or sells the direct way),
    # nothing sold
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
    assert b"Retry-After: " in answer and b"stayed locked" in answer
    assert writer_in_thread.locked == 0 and Order.objects.count() == 0


@pytest.mark.parametrize(
    "change",
    [
        {"lock": {"shards": 0, "start": 0}},
        {"lock": {"shards": 10, "start": 10}},
        {"lock": {"shards": "10", "start": 0}},
        {"lock": []},
        {"qty": 2},
        {"lock": {"shards": 10, "start": 0, "name": "elsewhere:lock:{item:widget:shard:0}"}},
        {"lock": {"shards": 10, "start": 0}},
    ],
)
def test_a_lock_request_not_well_formed_locks_nothing(change):
    # Given a lock request changed to name no shard it could lock, or units it does not write
    start_sale(sku="widget", stock=20, strategy="segmented")
    request = {**_lock_request(Item.objects.get(sku="widget"), "ann"), **change}

    # Then the writer refuses to lock anything for it
    with pytest.raises((KeyError, TypeError, ValueError)):
        writer._lock_of(request, 5000)


@pytest.mark.parametrize("strategy", ["segmented", "lua"])
def test_a_handed_off_request_naming_other_keys_is_refused_with_the_reason(
    writer_in_thread, strategy
):
    # Given a sale, and a web process whose keys are named under another key prefix than the
    # writer's (FLASHSALE_REDIS_PREFIX set differently): a segmented checkout's start shard
    # lock, a lua checkout's cursor
    start_sale(sku="widget", stock=20, strategy=strategy)
    item = Item.objects.get(sku="widget")
    if strategy == "segmented":
        request = _lock_request(item, "ann")
        request["lock"]["name"] = "elsewhere:lock:{item:widget:shard:0}"
    else:
        request = _lua_request(item, "ann", cursor="elsewhere:turn")

    # When it hands a checkout to the writer
    with _handed_by_hand(writer_in_thread.path, request) as client:
        answer = client.recv(65536)

    # Then the client is told why, and nothing was locked, taken or sold (the writer's own
    # direct way would use its own keys, not the web process's)
    assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n"), answer
    assert b"FLASHSALE_REDIS_PREFIX" in answer
    assert writer_in_thread.locked == 0 and writer_in_thread.lock_waits == 0
    assert get_redis_client().exists(*keys.shard_locks(item)) == 0
    assert Order.objects.count() == 0
    audit = audit_sale("widget")
    assert audit["db_stock"] == audit["redis_stock"] == 20, audit


def test_a_writer_with_no_direct_way_answers_busy_and_gives_the_units_back(writer_in_thread):
    # Given a writer started without a way to sell the direct way, and a lua sale whose buyer
    # "ann" has reached her limit of one
    writer_in_thread.answer = None
    start_sale(sku="widget", stock=10, strategy="lua", limit=1)
    item = Item.objects.get(sku="widget")
    place_order(sku="widget", qty=1, buyer="ann")
    request = _lua_request(item, "ann", limit=1)

    # When she checks out again, handed off, and her batch refuses it
    with _handed_by_hand(writer_in_thread.path, request) as client:
        answer = client.recv(65536)

    # Then she is answered busy, and the unit the take got is back in Redis
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
    assert b"Retry-After: " in answer and b'"error": "busy"' in answer
    audit = audit_sale("widget")
    assert audit["accepted_units"] == 1 and audit["db_stock"] == audit["redis_stock"] == 9, audit
