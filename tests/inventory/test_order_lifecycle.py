"""The order lifecycle services on real PostgreSQL and Redis: transitions happen once, units come
back exactly once, the sweeper expires what waited too long, the reconciler repairs drift."""

from __future__ import annotations

import base64
import json
import threading
from datetime import timedelta
from io import StringIO

import pytest
import redis
from django.core.management import call_command
from django.utils import timezone

from inventory import orders
from inventory.keys import shard_hint, stripe_counter
from inventory.models import BuyerAllowance, Item, Order, OrderStatus, PaymentAttempt
from inventory.redis_client import get_redis_client
from inventory.selectors import audit_sale
from inventory.services import place_order, start_sale
from inventory.strategies import get_strategy
from inventory.tasks import give_back_task
from shop import queues
from tests.conftest import TASK_QUEUE

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded_smoke]


@pytest.fixture(autouse=True)
def _no_broker_needed(settings):
    settings.FLASHSALE_PAYMENT_LATENCY_MS = 0


def _sell(sku: str, count: int, qty: int = 1) -> list[Order]:
    return [place_order(sku=sku, qty=qty, buyer=f"b{n}").order for n in range(count)]


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_processing_twice_pays_once_and_confirms(strategy):
    start_sale(sku="widget", stock=10, strategy=strategy)
    (order,) = _sell("widget", 1)

    assert orders.process_order(order_pk=order.pk) == OrderStatus.CONFIRMED
    assert orders.process_order(order_pk=order.pk) == OrderStatus.CONFIRMED

    assert PaymentAttempt.objects.filter(order=order).count() == 1
    assert audit_sale("widget")["consistent"]


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_a_declined_payment_gives_units_back_once(settings, strategy):
    settings.FLASHSALE_PAYMENT_FAILURE_RATE = 1.0
    start_sale(sku="widget", stock=10, strategy=strategy, limit=3)
    (order,) = _sell("widget", 1, qty=3)
    assert Item.objects.get(sku="widget").units_left == 7

    assert orders.process_order(order_pk=order.pk) == OrderStatus.FAILED
    # a redelivered task: nothing more comes back
    assert orders.process_order(order_pk=order.pk) == OrderStatus.FAILED

    audit = audit_sale("widget")
    assert audit["db_stock"] == 10 and audit["accepted_units"] == 0, audit
    assert audit["consistent"], audit
    if strategy in ("lua", "segmented"):
        assert audit["redis_stock"] == 10, audit
    # and the buyer may buy again
    assert BuyerAllowance.objects.get(buyer="b0").units == 0
    place_order(sku="widget", qty=3, buyer="b0")


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_a_batch_pays_each_order_once_and_gives_declined_units_back_once(
    settings, monkeypatch, strategy
):
    # Given eight orders of two units, one already paid by an earlier delivery, a payment
    # provider that declines every other payment, and a key that is no order
    settings.FLASHSALE_PAYMENT_LATENCY_MS = 5
    start_sale(sku="widget", stock=20, strategy=strategy, limit=2)
    placed = _sell("widget", 8, qty=2)
    Order.objects.filter(pk=placed[0].pk).update(status=OrderStatus.PAID)
    PaymentAttempt.objects.create(order=placed[0], approved=True)
    answers = iter([True, False] * 4)
    drawing = threading.Lock()
    charge = orders.charge

    def every_other(order):
        charge(order)
        with drawing:
            return next(answers)

    monkeypatch.setattr(orders, "charge", every_other)
    pks = [order.pk for order in placed]

    # When the batch is settled, then delivered again
    first = orders.settle_orders([*pks, 999_999])
    again = orders.settle_orders(pks)

    # Then each order was paid once: seven charged (four approved, three declined), the paid
    # one confirmed without a second charge
    assert len(first.confirmed) == 5 and len(first.failed) == 3, first
    assert placed[0].pk in first.confirmed
    assert first.skipped == [999_999]
    assert again.confirmed == again.failed == [] and sorted(again.skipped) == sorted(pks)
    for order in placed:
        assert PaymentAttempt.objects.filter(order=order).count() == 1
    statuses = dict(Order.objects.filter(pk__in=pks).values_list("pk", "status"))
    assert {statuses[pk] for pk in first.confirmed} == {OrderStatus.CONFIRMED}
    assert {statuses[pk] for pk in first.failed} == {OrderStatus.FAILED}
    # and the declined units came back exactly once, to the database and to Redis
    audit = audit_sale("widget")
    assert audit["accepted_units"] == 10 and audit["db_stock"] == 10, audit
    assert audit["consistent"], audit
    if strategy in ("lua", "segmented"):
        assert audit["redis_stock"] == 10, audit
    declined_buyer = Order.objects.get(pk=first.failed[0]).buyer
    assert BuyerAllowance.objects.get(buyer=declined_buyer).units == 0


@pytest.mark.parametrize("strategy", ["segmented", "lua"])
def test_overlapping_batches_settled_at_once_pay_each_order_once(settings, strategy):
    # Given 60 orders, a third of the payments declined, and four workers' batches that share
    # orders (each batch in its own order, as deliveries of different messages would be)
    settings.FLASHSALE_PAYMENT_LATENCY_MS = 5
    settings.FLASHSALE_PAYMENT_FAILURE_RATE = 0.34
    start_sale(sku="widget", stock=60, strategy=strategy)
    pks = [order.pk for order in _sell("widget", 60)]
    batches = [pks[0:40], pks[20:60][::-1], pks[10:50], pks[::-1]]
    results: list[orders.Settled] = []
    errors: list[BaseException] = []
    start = threading.Barrier(len(batches))

    def settle(batch: list[int]) -> None:
        from django.db import connection

        try:
            start.wait()
            results.append(orders.settle_orders(batch))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
        finally:
            connection.close()

    # When they settle them all at the same time, on connections of their own, three times over
    for _ in range(3):
        threads = [threading.Thread(target=settle, args=(batch,)) for batch in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # Then nothing failed or deadlocked, each order was paid exactly once and moved once (every
    # later batch skipped it), and the declined orders' units came back exactly once
    assert errors == []
    confirmed = [pk for result in results for pk in result.confirmed]
    failed = [pk for result in results for pk in result.failed]
    assert sorted(confirmed + failed) == sorted(pks)
    assert failed, "a third of the payments should have been declined"
    attempts = dict(
        PaymentAttempt.objects.filter(order_id__in=pks).values_list("order_id", "approved")
    )
    assert PaymentAttempt.objects.filter(order_id__in=pks).count() == len(pks)
    assert {pk for pk, approved in attempts.items() if not approved} == set(failed)
    statuses = dict(Order.objects.filter(pk__in=pks).values_list("pk", "status"))
    assert {statuses[pk] for pk in confirmed} == {OrderStatus.CONFIRMED}
    assert {statuses[pk] for pk in failed} == {OrderStatus.FAILED}
    audit = audit_sale("widget")
    assert audit["accepted_units"] == len(confirmed), audit
    assert audit["db_stock"] == len(failed) and audit["redis_stock"] == len(failed), audit
    assert audit["consistent"], audit


@pytest.mark.parametrize("strategy", ["segmented", "lua"])
def test_a_give_back_redis_refuses_waits_on_its_own_queue_and_happens_once(
    settings, monkeypatch, strategy
):
    # Given three declined orders whose give-back Redis refuses (down for the moment)
    settings.FLASHSALE_PAYMENT_FAILURE_RATE = 1.0
    start_sale(sku="widget", stock=10, strategy=strategy)
    pks = [order.pk for order in _sell("widget", 3)]
    client = get_redis_client()
    queue = queues.give_back(TASK_QUEUE)
    queued = client.llen(queue)
    give_back_now = orders.return_units_to_redis

    def redis_down(order):
        raise redis.ConnectionError("Redis is down")

    monkeypatch.setattr(orders, "return_units_to_redis", redis_down)

    # When a worker settles them
    settled = orders.settle_orders(pks)

    # Then the payments are done with (nothing held up), the database has the units back,
    # and the give-back waits in the give-back queue, not in the orders' queue
    assert sorted(settled.failed) == sorted(pks)
    assert audit_sale("widget")["db_stock"] == 10
    assert audit_sale("widget")["redis_stock"] == 7
    assert client.llen(queue) == queued + 1
    envelope = json.loads(client.lindex(queue, 0))
    assert envelope["headers"]["task"] == "inventory.tasks.give_back_task"
    (args,) = json.loads(base64.b64decode(envelope["body"]))[0]
    assert sorted(args) == sorted(pks)

    # and once Redis is back, the task gives the units back, once however often it runs
    monkeypatch.setattr(orders, "return_units_to_redis", give_back_now)
    assert give_back_task.apply(args=(args,)).get() == 3
    assert give_back_task.apply(args=(args,)).get() == 3
    audit = audit_sale("widget")
    assert audit["redis_stock"] == 10 and audit["consistent"], audit


@pytest.mark.parametrize("strategy", ["segmented", "lua"])
def test_the_sweeper_expires_overdue_orders_and_returns_their_units(strategy):
    start_sale(sku="widget", stock=10, strategy=strategy)
    overdue = _sell("widget", 2, qty=2)
    fresh = _sell("widget", 1)[0]
    Order.objects.filter(pk__in=[o.pk for o in overdue]).update(
        created_at=timezone.now() - timedelta(hours=1)
    )

    report = orders.sweep_orders()
    again = orders.sweep_orders()

    assert sorted(report.expired) == sorted(o.pk for o in overdue)
    assert again.expired == []
    assert Order.objects.get(pk=fresh.pk).status == OrderStatus.PENDING
    audit = audit_sale("widget")
    assert audit["accepted_units"] == 1 and audit["db_stock"] == 9, audit
    assert audit["redis_stock"] == 9 and audit["consistent"], audit


def test_the_sweeper_enqueues_orders_left_open_and_not_twice_in_a_row():
    start_sale(sku="widget", stock=10, strategy="lua")
    stale = _sell("widget", 2)
    Order.objects.filter(pk__in=[o.pk for o in stale]).update(
        updated_at=timezone.now() - timedelta(minutes=5)
    )
    _sell("widget", 1)  # fresh: left alone

    first = orders.sweep_orders()
    second = orders.sweep_orders()

    assert sorted(first.requeued) == sorted(o.pk for o in stale)
    assert second.requeued == []


def test_reconcile_repairs_database_and_redis_drift():
    start_sale(sku="widget", stock=20, strategy="segmented")
    _sell("widget", 3, qty=4)
    item = Item.objects.get(sku="widget")
    # drift: a shard row loses units, Redis hints go wrong
    item.shards.filter(sale=item.current_sale, index=9).update(stock=0)
    get_redis_client().set(shard_hint(item, 3), 99)
    assert not audit_sale("widget")["consistent"]

    out = StringIO()
    call_command("sale", "reconcile", "widget", stdout=out)

    assert "stock row 9 0 -> 2" in out.getvalue()
    assert "Redis stock" in out.getvalue()
    audit = audit_sale("widget")
    assert audit["db_stock"] == 8 and audit["shard_stock"] == 8 and audit["redis_stock"] == 8
    assert audit["consistent"], audit

    out = StringIO()
    call_command("sale", "reconcile", "widget", stdout=out)
    assert "already agree" in out.getvalue()


def test_reconcile_restores_a_lua_counter_left_low_by_a_crash():
    start_sale(sku="widget", stock=10, strategy="lua")
    _sell("widget", 2)
    item = Item.objects.get(sku="widget")
    # a process died between its DECRBY and its commit: Redis is low, units look sold
    holding = item.shards.filter(sale=item.current_sale, stock__gt=0).order_by("index")[:3]
    for index in holding.values_list("index", flat=True):
        get_redis_client().decrby(stripe_counter(item, index), 1)
    assert get_strategy("lua").redis_stock(item=item) == 5
    repairs_before = _sample("flashsale_reconciler_repairs_total", store="redis")
    units_before = _sample("flashsale_reconciler_drift_units_total", store="redis")

    changes = orders.reconcile_sale("widget")

    assert changes == ["widget: Redis stock 5 -> 8"]
    assert audit_sale("widget")["consistent"]
    # and the metrics count the repair and the 3 units of drift
    assert _sample("flashsale_reconciler_repairs_total", store="redis") == repairs_before + 1
    assert _sample("flashsale_reconciler_drift_units_total", store="redis") == units_before + 3


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0
