"""The database closes every connection (a restart, a failover, an idle timeout): the next
checkouts of every web worker (each thread of it, batches included) and the next orders of the
Celery worker open a new one instead of failing."""

from __future__ import annotations

import uuid

import pytest
import requests
from django.db import connection
from prometheus_client.parser import text_string_to_metric_families

from inventory.models import Order, OrderStatus
from inventory.services import start_sale
from loadtest.flood import flood
from shop.processes.ports import free_port
from tests.conftest import start_shop, start_worker, wait_until
from tests.support import BUSY_RETRIES

pytestmark = pytest.mark.django_db(transaction=True)

#: Every process keeps its database connections between requests and tasks, as in production.
PERSISTENT = {"DJANGO_CONN_MAX_AGE": 600}


@pytest.fixture(scope="module")
def persistent_shop(django_db_setup, django_db_blocker):
    """A shop whose workers keep their database connections between requests."""
    server = start_shop(**PERSISTENT)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def persistent_sale_path(django_db_setup, django_db_blocker):
    """The whole sale path, every process keeping its connections: a threaded server whose
    web processes batch their `lua` and `segmented` checkouts, and a Celery worker (one
    thread, so one connection) serving its metrics."""
    server = start_shop(kind="gthread", threads=4, **PERSISTENT)
    port = free_port()
    worker = start_worker(
        concurrency=1,
        FLASHSALE_PAYMENT_LATENCY_MS=5,
        FLASHSALE_WORKER_METRICS_PORT=port,
        **PERSISTENT,
    )
    yield server.url, f"http://127.0.0.1:{port}/metrics"
    worker.stop()
    server.stop()


def _terminate_every_other_connection() -> int:
    """What a failover does to the shop's idle connections: the server closes them (and this
    waits until each backend is gone, so each has said so on its socket)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000))"
            " FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        (terminated,) = cursor.fetchone()
    return terminated


def _confirmed(sku: str) -> int:
    return Order.objects.filter(item__sku=sku, status=OrderStatus.CONFIRMED).count()


def _task_retries(metrics_url: str) -> float:
    text = requests.get(metrics_url, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "flashsale_task_retries_total"
    )


@pytest.mark.parametrize("strategy", ["lock", "lua"])
def test_checkouts_after_the_server_dropped_every_connection_succeed(persistent_shop, strategy):
    # Given a sale every web worker has served, each holding its database connection open
    sku = f"dropped-{strategy}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=1000, strategy=strategy)
    warm = flood(persistent_shop.url, sku, attempts=120, concurrency=12, retry_busy=BUSY_RETRIES)
    assert warm.accepted == 120, dict(warm.statuses)

    # When the server terminates every other connection to the database
    assert _terminate_every_other_connection() >= 1

    # Then the next checkouts all succeed: no worker answers 500 for its dead connection
    after = flood(persistent_shop.url, sku, attempts=120, concurrency=12)
    assert after.server_errors == 0 and after.accepted == 120, dict(after.statuses)
    assert Order.objects.filter(item__sku=sku).count() == 240


@pytest.mark.usefixtures("no_queued_orders")
@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_the_first_checkout_and_order_after_every_connection_dropped_succeed(
    persistent_sale_path, strategy
):
    # Given a sale every process of the sale path has served (web workers and their threads,
    # the Celery worker that settled its orders), each holding its database connection open
    url, worker_metrics = persistent_sale_path
    sku = f"dropped-path-{strategy}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=1000, strategy=strategy)
    warm = flood(url, sku, attempts=60, concurrency=6, retry_busy=BUSY_RETRIES)
    assert warm.accepted == 60, dict(warm.statuses)
    assert wait_until(lambda: _confirmed(sku) == 60, timeout=60), _confirmed(sku)
    retries_before = _task_retries(worker_metrics)

    # When the server terminates every other connection to the database
    assert _terminate_every_other_connection() >= 3

    # Then the very next checkout is sold
    first = requests.post(
        f"{url}/api/checkout", json={"sku": sku, "qty": 1, "buyer": "first"}, timeout=30
    )
    assert first.status_code == 201, first.text
    # and so is every one after it, whichever web worker serves it
    after = flood(url, sku, attempts=60, concurrency=6)
    assert after.server_errors == 0 and after.accepted == 60, dict(after.statuses)
    # and the worker settles every new order at its first try: none is retried
    assert wait_until(lambda: _confirmed(sku) == 121, timeout=60), _confirmed(sku)
    assert _task_retries(worker_metrics) == retries_before
