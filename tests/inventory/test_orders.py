"""The order pipeline with a real Redis broker and real `celery worker` processes: every accepted
order is settled exactly once, through worker crashes, a broker outage and declined payments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from http.client import HTTPConnection

import pytest
from django.db import connection
from django.db.models import Count
from django.utils import timezone

from inventory import orders, publishing, services
from inventory.models import LIVE_STATUSES, Item, Order, OrderStatus, PaymentAttempt
from inventory.orders import sweep_orders
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.tasks import sweep_orders_task
from loadtest.flood import flood
from shop import queues
from shop.processes.redis_server import RedisServer
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env, start_shop, start_worker, wait_until
from tests.support import BUSY_RETRIES

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("no_queued_orders")]

FINAL = {OrderStatus.CONFIRMED, OrderStatus.FAILED, OrderStatus.EXPIRED}


def _statuses(sku: str) -> dict[str, int]:
    rows = Order.objects.filter(item__sku=sku).values("status").annotate(n=Count("pk"))
    return {row["status"]: row["n"] for row in rows}


def _all_settled(sku: str) -> bool:
    return not Order.objects.filter(item__sku=sku).exclude(status__in=FINAL).exists()


def _payments_per_order(sku: str) -> set[int]:
    counts = Order.objects.filter(item__sku=sku).annotate(n=Count("payment_attempts"))
    return set(counts.values_list("n", flat=True))


def test_a_worker_confirms_every_accepted_order(shop_server):
    # Given a worker and a sale of 200 units
    worker = start_worker(concurrency=4, FLASHSALE_PAYMENT_LATENCY_MS=5)
    try:
        sku = f"confirm-{uuid.uuid4().hex[:6]}"
        start_sale(sku=sku, stock=200, strategy="lua")

        # When a flood buys all of it
        result = flood(shop_server.url, sku, attempts=260, concurrency=16, retry_busy=BUSY_RETRIES)
        assert result.accepted == 200 and result.server_errors == 0

        # Then the worker confirms all 200, each paid once
        assert wait_until(lambda: _all_settled(sku), timeout=90), _statuses(sku)
    finally:
        worker.stop()
    assert _statuses(sku) == {OrderStatus.CONFIRMED: 200}
    assert PaymentAttempt.objects.filter(order__item__sku=sku).count() == 200
    assert _payments_per_order(sku) == {1}


def _sessions_of(application: str) -> set[tuple[int, object]]:
    """The database sessions open now that `application` opened (libpq's PGAPPNAME names
    them): each as its server process and when it started."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE application_name = %s",
            [application],
        )
        return set(cursor.fetchall())


def test_a_worker_keeps_its_database_connection_from_task_to_task(monkeypatch):
    # Given a worker on one thread whose connections may live a minute, warmed by one batch,
    # its database sessions named after it
    name = f"worker-{uuid.uuid4().hex[:8]}"
    worker = start_worker(
        concurrency=1, DJANGO_CONN_MAX_AGE=60, FLASHSALE_PAYMENT_LATENCY_MS=0, PGAPPNAME=name
    )
    try:
        monkeypatch.setattr(services, "order_placed", lambda pk: None)
        sku = f"reuse-{uuid.uuid4().hex[:6]}"
        start_sale(sku=sku, stock=30, strategy="lua")
        placed = [place_order(sku=sku, qty=1, buyer=f"b{n}").order.pk for n in range(21)]
        assert publishing.publish_orders(placed[:1])
        assert wait_until(lambda: Order.objects.get(pk=placed[0]).status != "pending", timeout=30)
        before = _sessions_of(name)

        # When it settles twenty batches, one after another
        for pk in placed[1:]:
            assert publishing.publish_orders([pk])
        assert wait_until(lambda: _all_settled(sku), timeout=60), _statuses(sku)
        after = _sessions_of(name)
    finally:
        worker.stop()

    # Then it did so on the session it settled the first batch on, still open: not with a
    # connection per task (Celery's default, unless told)
    assert _statuses(sku) == {OrderStatus.CONFIRMED: 21}
    assert before and before <= after, (before, after)


@pytest.mark.slow
def test_the_sweeper_is_not_stuck_behind_a_backlog_of_payments(monkeypatch):
    # Given forty orders queued one message each for a worker that pays slowly, and an order
    # overdue for the sweeper
    monkeypatch.setattr(services, "order_placed", lambda pk: None)
    sku = f"backlog-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=50, strategy="lua")
    placed = [place_order(sku=sku, qty=1, buyer=f"b{n}").order.pk for n in range(41)]
    overdue, backlog = placed[0], placed[1:]
    Order.objects.filter(pk=overdue).update(created_at=timezone.now() - timedelta(hours=1))
    for pk in backlog:
        assert publishing.publish_orders([pk])
    sweep_orders_task.apply_async()

    # When one worker, as started by default, reads its queues
    worker = start_worker(concurrency=2, FLASHSALE_PAYMENT_LATENCY_MS=400)
    try:
        # Then the sweep, on the maintenance queue, runs long before the payments are through
        assert wait_until(
            lambda: Order.objects.get(pk=overdue).status == OrderStatus.EXPIRED, timeout=30
        )
        still_open = Order.objects.filter(pk__in=backlog, status=OrderStatus.PENDING).count()
        assert still_open >= 20, still_open
        assert wait_until(lambda: _all_settled(sku), timeout=60), _statuses(sku)
    finally:
        worker.stop()
    assert _statuses(sku) == {OrderStatus.CONFIRMED: 40, OrderStatus.EXPIRED: 1}


def test_a_killed_worker_loses_nothing_and_pays_nothing_twice(shop_server, monkeypatch):
    # Given 200 accepted orders waiting in the queue
    sku = f"crash-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=200, strategy="segmented")
    result = flood(shop_server.url, sku, attempts=200, concurrency=16, retry_busy=BUSY_RETRIES)
    assert result.accepted == 200

    # When a worker is SIGKILLed mid-batch, in the middle of payments (one at a time, so that
    # its batches take long enough to be caught half paid)
    first = start_worker(
        concurrency=4, FLASHSALE_PAYMENT_LATENCY_MS=40, FLASHSALE_PAYMENT_CONCURRENCY=1
    )
    try:
        assert wait_until(
            lambda: Order.objects.filter(item__sku=sku, status=OrderStatus.CONFIRMED).count() >= 40,
            timeout=60,
        )
    finally:
        first.kill()
    assert not _all_settled(sku)

    # and another takes over: it gets the dead worker's unacknowledged tasks back, and the
    # sweeper (beat's job) publishes again what a kill can lose between the broker's pop and
    # its unacknowledged record
    monkeypatch.setattr(orders, "REQUEUE_AFTER_SECONDS", 5)
    second = start_worker(
        concurrency=4,
        FLASHSALE_PAYMENT_LATENCY_MS=5,
        FLASHSALE_BROKER_VISIBILITY_TIMEOUT=3,
        FLASHSALE_BROKER_RESTORE_SECONDS=1,
    )

    def settled_with_sweeper() -> bool:
        if _all_settled(sku):
            return True
        sweep_orders()
        return False

    try:
        assert wait_until(settled_with_sweeper, timeout=90, interval=1), _statuses(sku)
    finally:
        second.stop()

    # Then every order is confirmed, and the payment ran exactly once for each
    assert _statuses(sku) == {OrderStatus.CONFIRMED: 200}
    assert _payments_per_order(sku) == {1}
    assert PaymentAttempt.objects.filter(order__item__sku=sku).count() == 200


RABBITMQ_URL = os.environ.get("FLASHSALE_TEST_RABBITMQ_URL", "")


@pytest.mark.skipif(not RABBITMQ_URL, reason="FLASHSALE_TEST_RABBITMQ_URL names no RabbitMQ")
@pytest.mark.slow
def test_on_rabbitmq_a_killed_workers_orders_come_back_without_the_sweeper():
    # RabbitMQ, compose's broker, hands a dead consumer's unacknowledged tasks to the next one
    # at once: no visibility timeout, no sweeper.
    broker = {"CELERY_BROKER_URL": RABBITMQ_URL}
    sku = f"rabbit-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=120, strategy="lua")
    server = start_shop(**broker)
    try:
        result = flood(server.url, sku, attempts=120, concurrency=12, retry_busy=BUSY_RETRIES)
    finally:
        server.stop()
    assert result.accepted == 120 and result.server_errors == 0

    try:
        first = start_worker(
            concurrency=4,
            FLASHSALE_PAYMENT_LATENCY_MS=40,
            FLASHSALE_PAYMENT_CONCURRENCY=1,
            **broker,
        )
        try:
            assert wait_until(
                lambda: (
                    Order.objects.filter(item__sku=sku, status=OrderStatus.CONFIRMED).count() >= 20
                ),
                timeout=60,
            )
        finally:
            first.kill()
        assert not _all_settled(sku)

        second = start_worker(concurrency=4, FLASHSALE_PAYMENT_LATENCY_MS=5, **broker)
        try:
            assert wait_until(lambda: _all_settled(sku), timeout=90, interval=0.5), _statuses(sku)
        finally:
            second.stop()
    finally:
        from kombu import Connection

        with Connection(RABBITMQ_URL, connect_timeout=5) as connection:
            for name in queues.names(server_env()["FLASHSALE_TASK_QUEUE"]):
                connection.default_channel.queue_delete(name)

    assert _statuses(sku) == {OrderStatus.CONFIRMED: 120}
    assert _payments_per_order(sku) == {1}


@pytest.mark.slow
def test_checkout_goes_on_while_the_broker_is_down_and_the_sweeper_catches_up():
    with RedisServer() as broker:
        env = {"CELERY_BROKER_URL": broker.url, "FLASHSALE_BROKER_PROBE_SECONDS": 0.5}
        server = start_shop(**env)
        try:
            # Given a sale whose broker goes down before the flood
            sku = f"broker-{uuid.uuid4().hex[:6]}"
            start_sale(sku=sku, stock=60, strategy="lua")
            broker.kill()

            # When buyers keep checking out
            result = flood(server.url, sku, attempts=90, concurrency=8)

            # Then every checkout is answered, with exactly the stock accepted
            assert result.server_errors == 0 and result.transport_failures == 0
            assert result.accepted == 60
            assert _statuses(sku) == {OrderStatus.PENDING: 60}
        finally:
            server.stop()

        # and once the broker is back, the sweeper drives every order to a final state
        broker.restart()
        worker = start_worker(concurrency=4, FLASHSALE_PAYMENT_LATENCY_MS=5, **env)
        try:
            sweep = subprocess.run(
                [sys.executable, "manage.py", "orders", "sweep"],
                cwd=ROOT,
                env={**server_env(**env), "FLASHSALE_REQUEUE_AFTER_SECONDS": "0"},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert sweep.returncode == 0, sweep.stderr
            assert "enqueued 60 again" in sweep.stdout
            assert wait_until(lambda: _all_settled(sku), timeout=60), _statuses(sku)
        finally:
            worker.stop()
    assert _statuses(sku) == {OrderStatus.CONFIRMED: 60}
    assert _payments_per_order(sku) == {1}


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_declined_payments_give_their_units_back_exactly_once(shop_server, strategy):
    # Given a worker that declines 30% of payments, working while the flood runs
    worker = start_worker(
        concurrency=4, FLASHSALE_PAYMENT_LATENCY_MS=5, FLASHSALE_PAYMENT_FAILURE_RATE=0.3
    )
    try:
        sku = f"declined-{strategy}-{uuid.uuid4().hex[:6]}"
        start_sale(sku=sku, stock=60, strategy=strategy)

        # When buyers flood it, and then every order settles
        result = flood(shop_server.url, sku, attempts=240, concurrency=16, pause=0.01)
        # (near the sell-out a slow host may answer a buyer `busy`, who waited a second for a
        # lock: a 503 with Retry-After that sold nothing, the only server error allowed)
        assert result.transport_failures == result.not_json == 0, dict(result.statuses)
        assert result.server_errors == result.errors["busy"], dict(result.statuses)
        assert result.busy_without_retry_after == 0
        assert wait_until(lambda: _all_settled(sku), timeout=90), _statuses(sku)
    finally:
        worker.stop()

    # Then some were declined, and the books balance in the database and in Redis
    statuses = _statuses(sku)
    assert statuses.get(OrderStatus.FAILED, 0) > 0, statuses
    live_units = sum(
        Order.objects.filter(item__sku=sku, status__in=LIVE_STATUSES).values_list("qty", flat=True)
    )
    item = Item.objects.get(sku=sku)
    assert live_units + item.units_left == 60
    audit = audit_sale(sku)
    assert audit["oversold"] == 0 and audit["consistent"], audit
    if strategy in ("segmented", "lua"):
        assert audit["redis_stock"] == item.units_left, audit
    assert _payments_per_order(sku) == {1}


def _post_checkouts(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    host, port = url.removeprefix("http://").split(":")

    def post(body: dict) -> tuple[int, dict]:
        connection = HTTPConnection(host, int(port), timeout=30)
        try:
            connection.request(
                "POST", "/api/checkout", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_twenty_concurrent_retries_of_one_key_make_one_order(shop_server, strategy):
    sku = f"idem-{strategy}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=50, strategy=strategy)
    body = {"sku": sku, "qty": 2, "buyer": "ann", "idempotency_key": uuid.uuid4().hex}

    answers = _post_checkouts(shop_server.url, [body] * 20)

    assert {status for status, _ in answers} == {201}
    assert len({json.dumps(payload, sort_keys=True) for _, payload in answers}) == 1
    assert Order.objects.filter(item__sku=sku).count() == 1
    assert Item.objects.get(sku=sku).units_left == 48


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_one_buyer_twenty_concurrent_requests_limit_one(shop_server, strategy):
    sku = f"limit-{strategy}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=50, strategy=strategy, limit=1)

    answers = _post_checkouts(shop_server.url, [{"sku": sku, "qty": 1, "buyer": "ann"}] * 20)

    statuses = sorted(status for status, _ in answers)
    assert statuses == [201] + [409] * 19
    assert {payload["error"] for status, payload in answers if status == 409} == {"limit_reached"}
    assert Order.objects.filter(item__sku=sku).count() == 1
    assert Item.objects.get(sku=sku).units_left == 49
    audit = audit_sale(sku)
    assert audit["consistent"], audit
