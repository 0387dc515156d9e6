"""A checkout's deadline (FLASHSALE_CHECKOUT_DEADLINE_MS): past it the buyer is answered
`503 busy` and nothing of that checkout is sold afterwards, its units back where they were."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import psycopg
import pytest
from django.db import connection
from django.test import Client

from inventory import deadline, row_locks
from inventory.batch_statement import sell_batch
from inventory.models import Item, Order
from inventory.sale_statement import SaleRecorder
from inventory.sale_values import RanPastDeadline
from inventory.selectors import audit_sale
from inventory.services import start_sale
from inventory.strategies import optimistic
from locking import Lock
from tests.conftest import test_database_url

pytestmark = pytest.mark.django_db(transaction=True)


def _hold_rows(sku: str) -> psycopg.Connection:
    """Another transaction holding the item's row and every stock row of its sale locked."""
    holder = psycopg.connect(test_database_url().replace("postgres://", "postgresql://"))
    holder.execute("SELECT 1 FROM inventory_item WHERE sku = %s FOR UPDATE", [sku])
    holder.execute(
        "SELECT 1 FROM inventory_stockshard s JOIN inventory_item i"
        " ON s.sale_id = i.current_sale_id WHERE i.sku = %s FOR UPDATE OF s",
        [sku],
    )
    return holder


def _checkout(client: Client, **body):
    return client.post("/api/checkout", body, content_type="application/json")


def _checkout_while(hold: Callable[[], None], release: Callable[[], None], **body):
    """A checkout sent while `hold` holds what it needs, released only once the checkout is
    answered (or after 30 s: then the test fails). The checkout's own waits are set to outlast
    that: while it is held, only its deadline can answer it; without the deadline it would wait
    for the release."""

    def checkout():
        try:
            return _checkout(Client(), **body)
        finally:
            connection.close()

    hold()
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(checkout)
            answered_while_held = bool(wait([answer], timeout=30).done)
            release()
            assert answered_while_held, "the checkout waited for the release, past its deadline"
            return answer.result(timeout=30)
    finally:
        release()


def _assert_busy_and_nothing_sold(response, sku: str) -> None:
    """`late`'s checkout of 2 units of `sku` (1 of 10 sold before it) was answered 503 busy
    with Retry-After, nothing of it was sold, and its units are back: the next buyer gets them
    all."""
    assert response.status_code == 503, response.content
    assert response.json()["error"] == "busy" and response["Retry-After"]
    assert not Order.objects.filter(buyer="late").exists()
    audit = audit_sale(sku)
    assert (audit["accepted_units"], audit["db_stock"]) == (1, 9)
    if audit["redis_stock"] is not None:
        assert audit["redis_stock"] == 9
    assert audit["consistent"], audit
    assert _checkout(Client(), sku=sku, qty=9, buyer="next").status_code == 201


@pytest.mark.parametrize("strategy", ["lua", "segmented", "lock", "optimistic"])
def test_a_sale_statement_held_past_the_deadline_sells_nothing(settings, monkeypatch, strategy):
    # Given a checkout deadline of 300 ms, and the sale's rows locked by another transaction
    # for longer (lock waits of their own outlast it: a minute)
    settings.FLASHSALE_CHECKOUT_DEADLINE_MS = 300
    monkeypatch.setattr(row_locks, "ROW_LOCK_TIMEOUT_MS", 60_000)
    start_sale(sku="held", stock=10, strategy=strategy)
    client = Client()
    assert _checkout(client, sku="held", qty=1, buyer="first").status_code == 201
    holders: list[psycopg.Connection] = []

    def release() -> None:
        while holders:
            holder = holders.pop()
            holder.rollback()
            holder.close()

    # When a buyer checks out
    response = _checkout_while(
        lambda: holders.append(_hold_rows("held")), release, sku="held", qty=2, buyer="late"
    )

    # Then it is answered 503 busy with Retry-After, nothing of it sold, its units back
    _assert_busy_and_nothing_sold(response, "held")


class _StoppedOnSale:
    """An execute wrapper (`connection.execute_wrapper`) that stops the connection's
    PostgreSQL backend (SIGSTOP) as a sale statement (the first that holds `marker`) is sent,
    and lets it go on (SIGCONT) once the checkout's deadline has passed: as if the database
    froze with the statement in hand."""

    def __init__(self, marker: str = f"INSERT INTO {Order._meta.db_table}") -> None:
        self.marker = marker
        self.stopped: list[int] = []
        self.sent_before_the_deadline: list[bool] = []

    def __call__(self, execute, sql, params, many, context):
        if self.marker in sql and not self.stopped:
            backend = context["connection"].connection.info.backend_pid
            self.sent_before_the_deadline.append(time.monotonic() < deadline.current())
            os.kill(backend, signal.SIGSTOP)
            self.stopped.append(backend)
            past = deadline.current() - time.monotonic() + 0.2
            threading.Timer(past, self.resume).start()
        return execute(sql, params, many, context)

    def resume(self) -> None:
        for backend in self.stopped:
            with contextlib.suppress(ProcessLookupError):  # its connection closed since
                os.kill(backend, signal.SIGCONT)


@pytest.mark.parametrize("strategy", ["lua", "segmented", "lock", "optimistic"])
def test_a_sale_statement_the_database_held_past_the_deadline_sells_nothing(settings, strategy):
    # Given a checkout deadline of 300 ms, and a database that stops as the checkout's sale
    # statement reaches it and wakes past the deadline (no row lock waited on: the statement's
    # lock_timeout bounds nothing)
    settings.FLASHSALE_CHECKOUT_DEADLINE_MS = 300
    start_sale(sku="frozen", stock=10, strategy=strategy)
    assert _checkout(Client(), sku="frozen", qty=1, buyer="first").status_code == 201
    stopped = _StoppedOnSale()

    def checkout():
        try:
            with connection.execute_wrapper(stopped):
                return _checkout(Client(), sku="frozen", qty=2, buyer="late")
        finally:
            connection.close()

    # When a buyer checks out
    try:
        with ThreadPoolExecutor(1) as pool:
            response = pool.submit(checkout).result(timeout=60)
    finally:
        stopped.resume()

    # Then its statement was sent in time, and it is answered 503 busy for its deadline,
    # nothing of it sold, its units back
    assert stopped.sent_before_the_deadline == [True]
    assert "deadline" in response.json()["detail"], response.content
    _assert_busy_and_nothing_sold(response, "frozen")


def test_a_batch_written_one_by_one_the_database_held_past_the_deadline_sells_nothing():
    # Given a sale of 10 with 1 unit sold under the key "taken", and a batch of two sales from
    # its stock rows, one of them under that key: the set-based statement refuses the batch
    # whole, and it is written again a request at a time (`inventory_sell_batch`)
    start_sale(sku="refused", stock=10, strategy="lua")
    assert (
        _checkout(Client(), sku="refused", qty=1, buyer="first", idempotency_key="taken")
    ).status_code == 201
    item = Item.objects.get(sku="refused")
    rows = dict(item.current_sale.shards.values_list("index", "stock"))
    index = max(rows, key=rows.__getitem__)
    batch = [
        SaleRecorder(item=item, qty=2, buyer="late").request(served_by="lua", rows={index: 2}),
        SaleRecorder(item=item, qty=1, buyer="again", idempotency_key="taken").request(
            served_by="lua", rows={index: 1}
        ),
    ]
    # and a database that stops as that statement reaches it and wakes past the deadline
    stopped = _StoppedOnSale(marker="inventory_sell_batch(")

    # When the batch is written for a checkout with a deadline of 300 ms
    try:
        with (
            deadline.checkout_deadline(0.3),
            connection.execute_wrapper(stopped),
            pytest.raises(RanPastDeadline),
        ):
            sell_batch(batch)
    finally:
        stopped.resume()

    # Then the statement was sent in time, and it ran past the deadline: nothing of the batch
    # was written, every stock row as it was
    assert stopped.sent_before_the_deadline == [True]
    assert not Order.objects.filter(buyer__in=["late", "again"]).exists()
    assert dict(item.current_sale.shards.values_list("index", "stock")) == rows


def test_a_lock_held_past_the_deadline_answers_busy_and_sells_nothing(settings):
    # Given `lock`'s item lock held by another client for longer than the deadline
    settings.FLASHSALE_CHECKOUT_DEADLINE_MS = 300
    settings.FLASHSALE_LOCK_WAIT_MS = 60_000
    start_sale(sku="locked", stock=10, strategy="lock")
    from inventory import keys
    from inventory.models import Item
    from inventory.redis_client import get_redis_client

    other = Lock(get_redis_client(), keys.item_lock(Item.objects.get(sku="locked")), timeout=30)

    def release() -> None:
        if other.owned():
            other.release()

    response = _checkout_while(
        lambda: other.acquire(blocking=False), release, sku="locked", qty=1, buyer="waiter"
    )

    assert response.status_code == 503 and response.json()["error"] == "busy"
    assert not Order.objects.filter(buyer="waiter").exists()
    assert audit_sale("locked")["db_stock"] == 10
    connection.close()


def test_a_writer_gate_held_past_the_deadline_answers_busy_and_sells_nothing(settings, monkeypatch):
    # Given `optimistic` queuing on its rows' writer gate at once (every race counted lost),
    # the gate held by another session for longer than the 300 ms deadline (lock waits of
    # their own outlast it: a minute)
    settings.FLASHSALE_CHECKOUT_DEADLINE_MS = 300
    monkeypatch.setattr(row_locks, "ROW_LOCK_TIMEOUT_MS", 60_000)
    monkeypatch.setattr(optimistic, "MAX_ATTEMPTS", 0)
    start_sale(sku="gated", stock=10, strategy="optimistic")
    holder = psycopg.connect(test_database_url().replace("postgres://", "postgresql://"))

    def hold() -> None:
        holder.execute(
            "SELECT pg_advisory_lock(%s, %s)", row_locks.gate(Item.objects.get(sku="gated").pk)
        )

    # When a buyer checks out
    response = _checkout_while(hold, holder.close, sku="gated", qty=1, buyer="queued")

    # Then it is answered 503 busy, and nothing of it was sold
    assert response.status_code == 503, response.content
    assert response.json()["error"] == "busy" and response["Retry-After"]
    assert not Order.objects.filter(buyer="queued").exists()
    assert audit_sale("gated")["db_stock"] == 10
    # and once the gate is free, the queue sells
    assert _checkout(Client(), sku="gated", qty=1, buyer="after").status_code == 201
