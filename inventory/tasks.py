"""Celery tasks. Each takes primary keys, calls one service, and is safe to run twice."""

from __future__ import annotations

from contextlib import suppress
from typing import Any, TypedDict

from celery import shared_task
from django.db import InterfaceError, OperationalError

from . import orders
from .models import Item, SaleRepair
from .redis_client import REDIS_DOWN_ERRORS

#: Errors worth retrying: the database or Redis was briefly unreachable.
TRANSIENT_ERRORS = (OperationalError, InterfaceError, *REDIS_DOWN_ERRORS)
#: How an order task runs: acknowledged once done, delivered again if its worker died, retried
#: with growing, jittered waits (at most 30 s apart) while the database or Redis is away.
ORDER_TASK: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "autoretry_for": TRANSIENT_ERRORS,
    "retry_backoff": 1,
    "retry_backoff_max": 30,
    "retry_jitter": True,
    "max_retries": 20,
}


class SettledCount(TypedDict):
    """What a worker did with a message's orders: how many it confirmed, found failed (units
    given back) and skipped (settled before, or expired)."""

    confirmed: int
    failed: int
    skipped: int


class SweptCount(TypedDict):
    """What a sweep did: orders pending past their hold expired, open ones published again."""

    expired: int
    requeued: int


@shared_task(**ORDER_TASK)
def process_order_task(order_pk: int) -> str | None:
    """Pay and confirm an order, or give a failed one's units back."""
    return orders.process_order(order_pk=order_pk)


@shared_task(**ORDER_TASK)
def settle_orders_task(order_pks: list[int]) -> SettledCount:
    """Pay and confirm the orders one checkout message carries, as one batch."""
    settled = orders.settle_orders(order_pks)
    return {
        "confirmed": len(settled.confirmed),
        "failed": len(settled.failed),
        "skipped": len(settled.skipped),
    }


@shared_task(**ORDER_TASK)
def dispatch_orders_task(order_pks: list[int]) -> SettledCount:
    """The name checkout's batches had before they were settled as one: a message published
    under it (a deployment's older web process) is settled the same way."""
    return settle_orders_task(order_pks)


@shared_task(**{**ORDER_TASK, "max_retries": 120})
def give_back_task(order_pks: list[int]) -> int:
    """Give failed or expired orders' units back to Redis, once Redis takes them (at most once
    per order): retried, on a queue of its own, for about an hour; the reconciler repairs what
    is left after that."""
    return orders.give_back(order_pks)


@shared_task
def sweep_orders_task() -> SweptCount:
    report = orders.sweep_orders()
    return {"expired": len(report.expired), "requeued": len(report.requeued)}


@shared_task
def reconcile_sales_task() -> list[str]:
    changes: list[str] = []
    for sku in Item.objects.exclude(current_sale=None).values_list("sku", flat=True):
        with suppress(orders.RepairInProgress):  # another process repairs it now
            changes.extend(orders.reconcile_sale(sku, cause=SaleRepair.Cause.RECONCILER))
    return changes
