"""The order lifecycle after the 201: services for workers, the sweeper and the reconciler.

    pending ──pay──> paid ──confirm──> confirmed
       │ └─declined─> failed    (units given back)
       └──hold time─> expired   (units given back)

Every transition is a guarded change of the current status under the order's row lock, so a
task delivered twice, or a worker and the sweeper racing, change an order once. The payment
attempt is written in the same transaction as the move out of `pending`: a worker killed
mid-payment leaves nothing behind and the redelivered task pays once.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Q, Sum
from django.template.defaultfilters import pluralize
from django.utils import timezone

from . import metrics, stock
from .models import (
    LIVE_STATUSES,
    Item,
    Order,
    OrderStatus,
    PaymentAttempt,
    SaleRepair,
    StockShard,
)
from .publishing import GIVE_BACK_TASK, PROCESS_ORDER_TASK, OrderPublisher, hand_over, publish
from .redis_client import REDIS_DOWN_ERRORS
from .strategies import get_strategy

logger = logging.getLogger(__name__)

#: Statuses a worker still has to move on.
OPEN_STATUSES = (OrderStatus.PENDING, OrderStatus.PAID)
#: Statuses whose units went back to the item.
RETURNED_STATUSES = (OrderStatus.FAILED, OrderStatus.EXPIRED)
#: How many payments a worker process waits on at once, whatever batches they belong to:
#: threads that only wait (no database connection each), so that a batch's payments overlap
#: instead of queueing one behind the other.
PAYMENT_CONCURRENCY = 128
#: Open orders untouched this long (seconds) are published again by the sweeper: far longer
#: than a worker takes to settle a batch, so a message still in flight is rarely sent twice.
REQUEUE_AFTER_SECONDS = 30


def enqueue_order(order_pk: int) -> bool:
    """Publish the order's processing task; False (and logged) if the broker is unreachable.

    Never raises: the order row is the outbox, and the sweeper enqueues what this missed.
    """
    return publish(PROCESS_ORDER_TASK, order_pk, what=f"order {order_pk}")


#: This process's publisher of checkout's orders.
publisher = OrderPublisher()
os.register_at_fork(after_in_child=publisher.forget_after_fork)


def order_placed(order_pk: int) -> None:
    """Hand a just-committed order to the workers (soon, from the background publisher)."""
    if settings.FLASHSALE_PUBLISH_INTERVAL_MS <= 0:
        enqueue_order(order_pk)
    else:
        publisher.add(order_pk)


def orders_placed(order_pks: list[int]) -> None:
    """Hand many just-committed orders to the workers at once, as `order_placed`; with an
    interval of 0, one message per batch."""
    hand_over(order_pks, publisher)


def charge(order_pk: int) -> bool:
    """The payment provider stand-in: takes FLASHSALE_PAYMENT_LATENCY_MS (an I/O wait, as a
    provider's answer is) and declines a FLASHSALE_PAYMENT_FAILURE_RATE share of payments.
    Touches no database, so many may run at once in threads."""
    if settings.FLASHSALE_PAYMENT_LATENCY_MS > 0:
        time.sleep(settings.FLASHSALE_PAYMENT_LATENCY_MS / 1000)
    return random.random() >= settings.FLASHSALE_PAYMENT_FAILURE_RATE


def simulate_payment(order: Order) -> bool:
    """Charge the order and record the attempt."""
    approved = charge(order.pk)
    PaymentAttempt.objects.create(order=order, approved=approved)
    return approved


class _Payments:
    """A per-process pool of threads that wait on payments (created on first use, and again in
    a forked child, which has none of its parent's threads)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def charge_all(self, order_pks: list[int]) -> list[bool]:
        concurrency = getattr(settings, "FLASHSALE_PAYMENT_CONCURRENCY", PAYMENT_CONCURRENCY)
        if len(order_pks) <= 1 or concurrency <= 1:
            return [charge(pk) for pk in order_pks]
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._pool = ThreadPoolExecutor(
                    max_workers=concurrency,
                    thread_name_prefix="payment",
                )
            pool = self._pool
        return list(pool.map(charge, order_pks))


payments = _Payments()


@dataclass
class Settled:
    """What `settle_orders` did with a batch, by outcome: order keys."""

    confirmed: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    #: Gone, or already past pending and paid (settled by an earlier delivery, or expired).
    skipped: list[int] = field(default_factory=list)


_ORDERS = Order._meta.db_table
_ORDER_KEY = Order._meta.pk.column

#: A batch's open orders, locked in key order: their keys, status and creation (Unix time).
_LOCK_OPEN = f"""
SELECT {_ORDER_KEY}, status, extract(epoch FROM created_at)::float8 FROM {_ORDERS}
WHERE {_ORDER_KEY} = ANY(%(orders)s::bigint[]) AND status = ANY(%(open)s::text[])
ORDER BY {_ORDER_KEY} FOR UPDATE
"""

#: One round trip records a batch's payments and confirms its approved orders: what the ORM
#: would build as a model instance per order and two statements with a parameter per order.
_RECORD_AND_CONFIRM = f"""
WITH attempts AS (
    INSERT INTO {PaymentAttempt._meta.db_table} (order_id, approved, created_at)
    SELECT paid.order_id, paid.approved, %(now)s
    FROM unnest(%(paid)s::bigint[], %(approved)s::boolean[]) AS paid(order_id, approved)
)
UPDATE {_ORDERS} SET status = %(confirmed)s, updated_at = %(now)s
WHERE {_ORDER_KEY} = ANY(%(confirm)s::bigint[])
"""


def settle_orders(order_pks: list[int]) -> Settled:
    """Pay and confirm a batch of orders in one transaction: what a worker does with the orders
    one checkout message carries.

    The batch's open orders are locked (in key order, so two overlapping batches cannot
    deadlock), their payments run at once on the payment threads (PAYMENT_CONCURRENCY),
    and one commit records every attempt and moves every order: approved ones to confirmed, in
    one statement with the attempts; declined ones to failed, their units given back. An order
    paid by an earlier delivery is confirmed without paying again. A worker killed mid-batch
    commits nothing, and the redelivered batch pays each order once. Redis gets failed units
    back after the commit.

    The orders are read as keys, status and age, not as model instances: a batch of hundreds
    is what a worker settles at a flood's pace, and the instances were most of its CPU.
    """
    result = Settled()
    declined: list[Order] = []
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                _LOCK_OPEN,
                {"orders": list(order_pks), "open": [status.value for status in OPEN_STATUSES]},
            )
            batch: list[tuple[int, str, float]] = cursor.fetchall()
        open_pks = {pk for pk, _, _ in batch}
        result.skipped = [pk for pk in dict.fromkeys(order_pks) if pk not in open_pks]
        to_pay = [pk for pk, status, _ in batch if status == OrderStatus.PENDING]
        approvals = payments.charge_all(to_pay)
        result.failed = [pk for pk, ok in zip(to_pay, approvals, strict=True) if not ok]
        result.confirmed = sorted(open_pks - set(result.failed))
        now = timezone.now()
        if to_pay or result.confirmed:
            with connection.cursor() as cursor:
                cursor.execute(
                    _RECORD_AND_CONFIRM,
                    {
                        "now": now,
                        "paid": to_pay,
                        "approved": approvals,
                        "confirmed": OrderStatus.CONFIRMED.value,
                        "confirm": result.confirmed,
                    },
                )
        if result.failed:
            declined = list(Order.objects.filter(pk__in=result.failed).order_by("pk"))
            Order.objects.filter(pk__in=result.failed).update(
                status=OrderStatus.FAILED, updated_at=now
            )
            stock.return_units_of(declined)
    metrics.ORDERS_SETTLED.labels("confirmed").inc(len(result.confirmed))
    metrics.ORDERS_SETTLED.labels("failed").inc(len(result.failed))
    settled_at = now.timestamp()
    for _, _, created_at in batch:
        metrics.SETTLE_LAG.observe(settled_at - created_at)
    # Redis gets the units back after the commit, or later from the give-back queue. A batch
    # delivered again (its worker died before this) gives back what an earlier delivery
    # declined: at most once per order all the same.
    if result.skipped:
        declined += Order.objects.filter(pk__in=result.skipped, status=OrderStatus.FAILED)
    give_back_to_redis(declined)
    return result


def pay_order(order_pk: int) -> str | None:
    """Move a pending order to paid or failed; return its status (None if it is gone)."""
    with transaction.atomic():
        order = Order.objects.select_for_update().filter(pk=order_pk).first()
        if order is None or order.status != OrderStatus.PENDING:
            return None if order is None else order.status
        if simulate_payment(order):
            order.status = OrderStatus.PAID
        else:
            order.status = OrderStatus.FAILED
            stock.return_units(order)
        order.save(update_fields=["status", "updated_at"])
        return order.status


def confirm_order(order_pk: int) -> bool:
    """paid -> confirmed; False if the order was not paid (already confirmed, say)."""
    changed = Order.objects.filter(pk=order_pk, status=OrderStatus.PAID).update(
        status=OrderStatus.CONFIRMED, updated_at=timezone.now()
    )
    return changed == 1


def give_back_to_redis(failed: list[Order]) -> list[int]:
    """Give failed or expired orders' units back to Redis (at most once each); the keys of
    those Redis could not take now, handed to a `give_back_task` on the give-back queue (or,
    with the broker down too, left to the reconciler), so that a Redis outage holds up no
    payment."""
    later = []
    for order in failed:
        try:
            return_units_to_redis(order)
        except REDIS_DOWN_ERRORS as exc:
            logger.warning("order %s: Redis give-back deferred (%s)", order.pk, exc)
            later.append(order.pk)
    if later:
        publish(GIVE_BACK_TASK, later, what=f"the give-back of {len(later)} orders")
    return later


def give_back(order_pks: list[int]) -> int:
    """What the give-back task does: Redis gets back the units of those orders that failed or
    expired, at most once each. Raises Redis connection errors (the task retries). Returns
    how many orders it gave back for."""
    returned = list(Order.objects.filter(pk__in=order_pks, status__in=RETURNED_STATUSES))
    for order in returned:
        return_units_to_redis(order)
    return len(returned)


def return_units_to_redis(order: Order) -> None:
    """Give a failed or expired order's units back to Redis, at most once per order.

    Raises Redis connection errors (a task retries); a sale restarted since has nothing to
    give back to.
    """
    item = Item.objects.get(pk=order.item_id)
    if item.current_sale_id == order.sale_id:
        get_strategy(item.strategy).return_units(item=item, order=order)


def process_order(*, order_pk: int) -> str | None:
    """What a worker does with an order: pay, confirm, or give failed units back to Redis.

    Idempotent: running it again for the same order changes nothing more.
    """
    status = pay_order(order_pk)
    if status == OrderStatus.PAID and confirm_order(order_pk):
        status = OrderStatus.CONFIRMED
    if status in RETURNED_STATUSES:
        give_back_to_redis([Order.objects.get(pk=order_pk)])
    return status


def expire_order(order_pk: int) -> bool:
    """pending -> expired, giving the units back; skips an order a worker is paying now."""
    with transaction.atomic():
        order = (
            Order.objects.select_for_update(skip_locked=True)
            .filter(pk=order_pk, status=OrderStatus.PENDING)
            .first()
        )
        if order is None:
            return False
        order.status = OrderStatus.EXPIRED
        order.save(update_fields=["status", "updated_at"])
        stock.return_units(order)
    give_back_to_redis([order])
    return True


@dataclass
class SweepReport:
    expired: list[int] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)
    not_requeued: int = 0


def sweep_orders(*, now=None, batch: int = 1000) -> SweepReport:
    """Expire orders pending past the hold time; enqueue again those left open too long."""
    now = now or timezone.now()
    report = SweepReport()
    hold_cutoff = now - timedelta(seconds=settings.FLASHSALE_ORDER_HOLD_SECONDS)
    overdue = Order.objects.filter(status=OrderStatus.PENDING, created_at__lt=hold_cutoff)
    for order_pk in overdue.order_by("pk").values_list("pk", flat=True)[:batch]:
        if expire_order(order_pk):
            report.expired.append(order_pk)
    requeue_after = getattr(settings, "FLASHSALE_REQUEUE_AFTER_SECONDS", REQUEUE_AFTER_SECONDS)
    requeue_cutoff = now - timedelta(seconds=requeue_after)
    stale = Order.objects.filter(
        Q(requeued_at__isnull=True) | Q(requeued_at__lt=requeue_cutoff),
        status__in=OPEN_STATUSES,
        updated_at__lt=requeue_cutoff,
    )
    for order_pk in stale.order_by("pk").values_list("pk", flat=True)[:batch]:
        if not enqueue_order(order_pk):
            report.not_requeued = stale.count() - len(report.requeued)
            break
        Order.objects.filter(pk=order_pk).update(requeued_at=now)
        report.requeued.append(order_pk)
    return report


class RepairInProgress(Exception):
    """Another process is repairing this sale at this moment (`reconcile_sale`)."""


def reconcile_sale(sku: str, *, cause: str = SaleRepair.Cause.COMMAND) -> list[str]:
    """Recompute what is left from the orders; repair the stock rows or item row, and Redis.

    For an item sold from stock rows, also folds their total into the item row's stock.
    Returns one line per change made (empty when everything already agreed); a repair that
    changed anything is recorded (`SaleRepair`, with `cause`), which the audit lists.
    RepairInProgress if another process is repairing the sale right now: one repair of a sale
    at a time, or two (web processes starting together, the reconciler beside a breaker
    closing) would each find Redis short and each record the same repair. The other is not
    waited for: a repair that waits could wait on one stuck in a stalled dependency.
    """
    # A session-level advisory lock, as Redis is repaired after the commit.
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s, hashtext(%s))", [RECONCILE_LOCK, sku])
        if not cursor.fetchone()[0]:
            raise RepairInProgress(f"{sku}: another process is repairing this sale right now")
        try:
            # The periodic pass leaves Redis alone while processes hold units taken ahead;
            # any other repair (a process starting, Redis back, an operator) sets it anyway.
            changes = _reconcile(sku, redis_now=cause != SaleRepair.Cause.RECONCILER)
            if changes:
                sale_id = (
                    Item.objects.filter(sku=sku).values_list("current_sale_id", flat=True).first()
                )
                if sale_id is not None:
                    SaleRepair.objects.create(sale_id=sale_id, cause=cause, changes=changes)
        finally:
            with suppress(DatabaseError):  # a connection lost took the lock with it
                cursor.execute("SELECT pg_advisory_unlock(%s, hashtext(%s))", [RECONCILE_LOCK, sku])
    return changes


#: The advisory-lock namespace of `reconcile_sale` (beside `row_locks`' writer gates').
RECONCILE_LOCK = 0x46530003


def _reconcile(sku: str, *, redis_now: bool) -> list[str]:
    changes: list[str] = []
    with transaction.atomic():
        # The row locks (the sale's stock rows in index order, then the item: no writer locks
        # them the other way round) hold back checkouts, payments and expiries of this sale, so
        # the orders read below are exactly those behind its stock. The item row is locked FOR
        # NO KEY UPDATE: an order insert's foreign-key check does not wait for it.
        item = Item.objects.select_related("current_sale").get(sku=sku)
        sale = item.current_sale
        if sale is None:
            return changes
        levels = stock.shard_stocks(sale.pk, for_update=True)
        item = (
            Item.objects.select_for_update(of=("self",), no_key=True)
            .select_related("current_sale")
            .get(pk=item.pk)
        )
        if item.current_sale_id != sale.pk:
            return changes  # restarted meanwhile: the new sale is reconciled on the next pass
        live = Order.objects.filter(sale=sale, status__in=LIVE_STATUSES)
        accepted = live.aggregate(units=Sum("qty"))["units"] or 0
        expected = sale.supply - accepted
        if expected < 0:
            changes.append(
                f"{sku}: oversold by {-expected} unit{pluralize(-expected)}; "
                "nothing to repair it with"
            )
            return changes
        if item.shard_count:
            expected_rows = dict(
                StockShard.objects.filter(sale=sale).values_list("index", "supplied")
            )
            for shard_units in live.exclude(shard_units=None).values_list("shard_units", flat=True):
                for index, units in (shard_units or {}).items():
                    expected_rows[int(index)] -= units
            for index, units in sorted(levels.items()):
                if units != expected_rows[index] and expected_rows[index] >= 0:
                    changes.append(f"{sku}: stock row {index} {units} -> {expected_rows[index]}")
                    stock.set_shard_stock(sale.pk, index, expected_rows[index])
                    metrics.RECONCILER_REPAIRS.labels("database").inc()
                    drift = abs(units - expected_rows[index])
                    metrics.RECONCILER_DRIFT_UNITS.labels("database").inc(drift)
        if item.stock != expected:
            if not item.shard_count:
                changes.append(f"{sku}: database stock {item.stock} -> {expected}")
                metrics.RECONCILER_REPAIRS.labels("database").inc()
                metrics.RECONCILER_DRIFT_UNITS.labels("database").inc(abs(item.stock - expected))
            Item.objects.filter(pk=item.pk).update(stock=expected)
            item.stock = expected
    strategy = get_strategy(item.strategy)
    if not strategy.counts_in_redis:
        # Its Redis state, if any, is a sold-out mark (`lock`'s): voided on every pass, so that
        # none outlives units a restock or a give-back added while Redis missed it.
        strategy.sync_redis(item=item)
    elif redis_now or strategy.redis_settled(item=item):
        # (While processes hold units taken ahead, Redis counts fewer than the database; they
        # give them back within a second, and the next pass compares.)
        before = strategy.redis_stock(item=item)
        if before != expected:
            strategy.sync_redis(item=item, force=True)
            changes.append(f"{sku}: Redis stock {before} -> {strategy.redis_stock(item=item)}")
            metrics.RECONCILER_REPAIRS.labels("redis").inc()
            if before is not None:
                metrics.RECONCILER_DRIFT_UNITS.labels("redis").inc(abs(before - expected))
    return changes
