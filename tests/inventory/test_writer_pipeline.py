"""The sale writer keeps a batch's statement in flight while it takes the next, and sends that
one beside it on a connection of its own (FLASHSALE_SALE_WRITER_CONNECTIONS): a buyer is
answered only once its order row is committed, batches in flight together never wait for each
other, a writer stopped mid-statement answers before it exits, and a connection lost
mid-statement costs its batch a `busy`, not the writer its life."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection

from inventory.exceptions import Busy, LimitReached, SoldOut
from inventory.models import Item, Order
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import plumbing
from tests.conftest import test_database_url, wait_until
from tests.conftest import writer_in_thread as serving

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def stock_rows_locked(item: Item) -> Iterator[None]:
    """Hold every stock row of item's sale locked from another connection: a statement that
    must write one waits until the block ends."""
    with psycopg.connect(test_database_url().replace("postgres://", "postgresql://", 1)) as other:
        other.execute(
            "SELECT id FROM inventory_stockshard WHERE sale_id = %s FOR UPDATE",
            [item.current_sale_id],
        )
        yield
        other.rollback()


class Checkout(threading.Thread):
    """One checkout in a thread of its own; afterwards `outcome` holds the order or the error,
    and `committed` whether its order row could be read at once by another connection."""

    def __init__(self, sku: str, buyer: str) -> None:
        super().__init__()
        self.sku, self.buyer = sku, buyer
        self.outcome: Any = None
        self.committed: bool | None = None

    def run(self) -> None:
        try:
            order = place_order(sku=self.sku, qty=1, buyer=self.buyer).order
            self.outcome = order
            # This thread's own connection sees only what was committed.
            self.committed = Order.objects.filter(public_id=order.public_id).exists()
        except Exception as error:  # noqa: BLE001 - the outcome is what is checked
            self.outcome = error
        finally:
            connection.close()


@pytest.fixture
def widget_writer(settings) -> Iterator[tuple[Any, Item]]:
    """A writer in a thread, checkouts sent to it, and a lua sale of 10 widgets. It takes
    nothing ahead: each checkout's take is seen in Redis when it happens (`in_flight`)."""
    settings.FLASHSALE_ROW_LOCK_TIMEOUT_MS = 20_000
    settings.FLASHSALE_SALE_WRITER_AHEAD_MS = 0
    start_sale(sku="widget", stock=10, strategy="lua")
    with serving() as writer:
        settings.FLASHSALE_SALE_WRITER = writer.path
        yield writer, Item.objects.get(sku="widget")


@contextmanager
def in_flight(item: Item, buyer: str) -> Iterator[Checkout]:
    """A checkout whose units the writer has taken and whose statement waits on the stock rows,
    locked until the block ends."""
    before = plumbing.rows_total(item) or 0
    with stock_rows_locked(item):
        checkout = Checkout(item.sku, buyer)
        checkout.start()
        assert wait_until(lambda: plumbing.rows_total(item) == before - 1, timeout=10)
        yield checkout


def test_a_writer_stopped_with_a_statement_in_flight_answers_it_before_it_exits(widget_writer):
    writer, item = widget_writer
    # Given a checkout whose statement is in flight
    with in_flight(item, "ann") as checkout:
        # When the writer is told to stop
        writer.stop()
        checkout.join(0.5)
        # Then it waits for the statement rather than leaving the buyer without an answer
        assert checkout.is_alive()
    checkout.join(20)

    assert isinstance(checkout.outcome, Order), checkout.outcome
    assert checkout.committed is True and writer.sales == 1
    audit = audit_sale("widget")
    assert audit["db_stock"] == audit["redis_stock"] == 9 and audit["consistent"], audit


def test_a_connection_lost_mid_statement_answers_busy_and_the_writer_goes_on(widget_writer):
    writer, item = widget_writer
    place_order(sku="widget", qty=1, buyer="ann")
    # Given a checkout whose statement is in flight
    with in_flight(item, "bob") as checkout:
        # When the writer's database connection is cut under it
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [writer.backend_pid])
        checkout.join(20)

    # Then that buyer is told busy (the statement may or may not have committed)
    assert isinstance(checkout.outcome, Busy), checkout.outcome
    # and the next checkout is written on a new connection
    cat = place_order(sku="widget", qty=1, buyer="cat").order
    assert Order.objects.filter(pk=cat.pk).exists()
    assert writer.sales == 2

    # The cut statement was rolled back: Redis is short of its unit until reconciled
    audit = audit_sale("widget")
    assert audit["accepted_units"] == 2 and audit["db_stock"] == 8, audit
    assert audit["oversold"] == 0 and audit["redis_stock"] == 7, audit


def test_a_lone_lua_request_waits_for_a_second_one_when_nothing_is_in_flight(settings):
    # Given a writer that waits up to 30 s for company for a `lua` request
    settings.FLASHSALE_SALE_WRITER_LINGER_US = 30_000_000
    start_sale(sku="widget", stock=10, strategy="lua")
    item = Item.objects.get(sku="widget")
    with serving() as writer:
        settings.FLASHSALE_SALE_WRITER = writer.path
        # When one buyer checks out with no statement in flight
        first = Checkout("widget", "ann")
        first.start()
        first.join(0.5)
        # Then its units are not taken yet: it waits for company
        assert first.is_alive() and plumbing.rows_total(item) == 10
        assert writer.batches == 0

        # and when a second buyer checks out, both go at once, in one batch
        second = Checkout("widget", "bob")
        second.start()
        for checkout in (first, second):
            checkout.join(20)
            assert isinstance(checkout.outcome, Order), checkout.outcome
            assert checkout.committed is True
        assert writer.sales == 2 and writer.batches == 1
    audit = audit_sale("widget")
    assert audit["db_stock"] == audit["redis_stock"] == 8 and audit["consistent"], audit


def test_a_lone_lock_holders_sale_waits_only_the_linger(settings):
    # Given a writer that would wait 30 s for company for a `lua` request, 1 ms for a lock
    # holder's sale
    settings.FLASHSALE_SALE_WRITER_LINGER_US = 30_000_000
    settings.FLASHSALE_SALE_WRITER_HOLDER_LINGER_US = 1000
    start_sale(sku="widget", stock=10, strategy="segmented")
    with serving() as writer:
        settings.FLASHSALE_SALE_WRITER = writer.path
        # When one `segmented` buyer checks out: a shard's lock holder, alone
        checkout = Checkout("widget", "ann")
        checkout.start()
        checkout.join(10)

        # Then its sale is written after the holders' linger: its shard stays locked while it
        # waits
        assert isinstance(checkout.outcome, Order), checkout.outcome
        assert checkout.committed is True
        assert writer.sales == 1 and writer.batches == 1
    audit = audit_sale("widget")
    assert audit["db_stock"] == 9 and audit["oversold"] == 0 and audit["consistent"], audit


def _backends_waiting_for_a_lock() -> set[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
        return {pid for (pid,) in cursor.fetchall()}


@pytest.mark.parametrize("connections", [2, 1])
def test_a_batch_is_sent_beside_the_one_in_flight_while_a_connection_is_free(settings, connections):
    # Given a writer with this many database connections, and a lua sale of 10 widgets
    settings.FLASHSALE_SALE_WRITER_CONNECTIONS = connections
    settings.FLASHSALE_ROW_LOCK_TIMEOUT_MS = 20_000
    start_sale(sku="widget", stock=10, strategy="lua")
    item = Item.objects.get(sku="widget")
    with serving() as writer:
        settings.FLASHSALE_SALE_WRITER = writer.path
        assert len(set(writer.backend_pids)) == connections
        # and a checkout whose statement waits on the stock rows
        with in_flight(item, "ann") as first:
            # When two more buyers check out while it is in flight
            others = [Checkout("widget", "bob"), Checkout("widget", "cat")]
            for checkout in others:
                checkout.start()
            assert wait_until(lambda: plumbing.rows_total(item) == 7, timeout=10)

            # Then with a second connection their batch is sent at once, and both statements
            # wait on the rows, each on its own connection; with one, theirs waits its turn
            assert wait_until(
                lambda: (
                    _backends_waiting_for_a_lock() & set(writer.backend_pids)
                    == set(writer.backend_pids)
                ),
                timeout=10,
            )
            assert writer.most_in_flight == connections
            assert all(checkout.is_alive() for checkout in [first, *others])
            assert writer.sales == 0 and Order.objects.count() == 0
        for checkout in [first, *others]:
            checkout.join(20)

    # and once the rows are free, all three are sold in two batches, each buyer answered with
    # its order committed
    for checkout in [first, *others]:
        assert isinstance(checkout.outcome, Order), checkout.outcome
        assert checkout.committed is True
    assert writer.sales == 3 and writer.batches == 2
    audit = audit_sale("widget")
    assert audit["accepted_units"] == 3 and audit["db_stock"] == audit["redis_stock"] == 7, audit
    assert audit["consistent"], audit


class ReturningBuyer(threading.Thread):
    """Checks out for each of its names in turn on one connection to the writer (its thread's),
    as a buyer process does; then keeps that connection open until `leave` is set."""

    def __init__(self, sku: str, names: list[str]) -> None:
        super().__init__()
        self.sku, self.names = sku, names
        self.outcomes: list[Any] = []
        self.leave = threading.Event()

    def run(self) -> None:
        try:
            for name in self.names:
                self.outcomes.append(place_order(sku=self.sku, qty=1, buyer=name).order)
        except Exception as error:  # noqa: BLE001 - the outcome is what is checked
            self.outcomes.append(error)
        finally:
            self.leave.wait(30)
            connection.close()


@contextmanager
def two_taken_behind_one_in_flight(item: Item, first: ReturningBuyer) -> Iterator[list[Checkout]]:
    """`first` checks out and its statement waits on the stock rows (locked for at least half
    a second); meanwhile two other buyers' checkouts are taken, their batch waiting for the
    connection. Yields those two once the rows are free again."""
    with stock_rows_locked(item):
        first.start()
        assert wait_until(lambda: plumbing.rows_total(item) == 9, timeout=10)
        others = [Checkout(item.sku, "bob"), Checkout(item.sku, "cat")]
        for checkout in others:
            checkout.start()
        assert wait_until(lambda: plumbing.rows_total(item) == 7, timeout=10)
        time.sleep(0.5)  # the statement in flight takes this long at least
    yield others


def test_the_next_batch_waits_for_the_buyers_the_last_one_answered(widget_writer):
    writer, item = widget_writer
    # Given a buyer whose checkout is in flight, who checks out again once answered, and two
    # other buyers' checkouts taken meanwhile
    ann = ReturningBuyer("widget", ["ann", "ann-again"])
    with two_taken_behind_one_in_flight(item, ann) as others:
        # When ann's statement is over
        for checkout in others:
            checkout.join(20)
        assert wait_until(lambda: len(ann.outcomes) == 2, timeout=20)
        ann.leave.set()
        ann.join(20)

    # Then the two taken waited for ann to come back, and one statement sold her second unit
    # with theirs: two batches, not three
    for outcome in [*ann.outcomes, *(checkout.outcome for checkout in others)]:
        assert isinstance(outcome, Order), outcome
    assert all(checkout.committed for checkout in others)
    assert writer.sales == 4 and writer.batches == 2 and writer.held == 1
    audit = audit_sale("widget")
    assert audit["db_stock"] == audit["redis_stock"] == 6 and audit["consistent"], audit


def test_a_buyer_that_does_not_come_back_holds_the_next_batch_no_longer_than_a_statement(
    widget_writer,
):
    writer, item = widget_writer
    # Given a buyer whose checkout is in flight, who stays connected once answered and checks
    # out no more, and two other buyers' checkouts taken meanwhile
    ann = ReturningBuyer("widget", ["ann"])
    with two_taken_behind_one_in_flight(item, ann) as others:
        # When ann's statement is over
        for checkout in others:
            checkout.join(20)
        # Then the two taken are sold after a wait no longer than that statement's, while ann
        # is still connected
        assert ann.is_alive() and len(ann.outcomes) == 1
        ann.leave.set()
        ann.join(20)

    for outcome in [*ann.outcomes, *(checkout.outcome for checkout in others)]:
        assert isinstance(outcome, Order), outcome
    assert writer.sales == 3 and writer.batches == 2 and writer.held == 1
    audit = audit_sale("widget")
    assert audit["db_stock"] == audit["redis_stock"] == 7 and audit["consistent"], audit


BUYER_NAMES = [f"buyer-{n}" for n in range(15)]
LIMIT = 2


class LimitedBuyer(threading.Thread):
    """Checks out for every buyer name in its own order, again and again, until a round of
    them sells nothing and the sale's orders hold its stock (a unit refused to a buyer at its
    limit goes back to the stock, so a `sold out` may come before the last unit is sold), or
    for 50 rounds; keeps what each attempt ended in."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.outcomes: list[Any] = []

    def run(self) -> None:
        names = BUYER_NAMES[self.seed % 15 :] + BUYER_NAMES[: self.seed % 15]
        try:
            for _ in range(50):
                sold = 0
                for name in names:
                    try:
                        self.outcomes.append(place_order(sku="limited", qty=1, buyer=name).order)
                        sold += 1
                    except Exception as error:  # noqa: BLE001 - the outcome is what is checked
                        self.outcomes.append(error)
                placed = Order.objects.filter(item__sku="limited").count()
                if not sold and placed == len(BUYER_NAMES) * LIMIT:
                    return
        finally:
            connection.close()


@pytest.mark.parametrize("round_", range(3))
def test_batches_in_flight_together_with_the_same_buyers_keep_each_buyer_s_limit(settings, round_):
    # Given a writer with two database connections, and a lua sale of 30 units, at most 2 a
    # buyer, for 15 buyers: exactly the stock
    settings.FLASHSALE_SALE_WRITER_CONNECTIONS = 2
    start_sale(sku="limited", stock=len(BUYER_NAMES) * LIMIT, strategy="lua", limit=LIMIT)
    with serving() as writer:
        settings.FLASHSALE_SALE_WRITER = writer.path
        # When 12 threads check out for all 15 buyers at once, each in its own order, so that
        # batches in flight together hold the same buyers in different orders
        crowd = [LimitedBuyer(seed) for seed in range(12)]
        for buyer in crowd:
            buyer.start()
        for buyer in crowd:
            buyer.join(120)
            assert not buyer.is_alive()

    # Then no batch failed (two statements waiting for each other would end in a deadlock
    # error and a busy answer): every attempt was sold or refused for the limit or the stock
    outcomes = [outcome for buyer in crowd for outcome in buyer.outcomes]
    unexpected = [
        outcome for outcome in outcomes if not isinstance(outcome, (Order, LimitReached, SoldOut))
    ]
    assert unexpected == []
    # and each buyer got exactly its limit, the stock sold exactly once
    sold = [outcome for outcome in outcomes if isinstance(outcome, Order)]
    assert len(sold) == len(BUYER_NAMES) * LIMIT
    assert sorted({order.buyer for order in sold}) == sorted(BUYER_NAMES)
    for name in BUYER_NAMES:
        assert Order.objects.filter(item__sku="limited", buyer=name).count() == LIMIT
    audit = audit_sale("limited")
    assert audit["accepted_units"] == 30 and audit["oversold"] == 0, audit
    assert audit["db_stock"] == audit["redis_stock"] == 0 and audit["consistent"], audit
