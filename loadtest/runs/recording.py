"""What a load run records: its SaleRun row, the sale's audit and settle lag, who ran it.

Where the figures live, beside SaleRun's own fields: `goodput` is the window's units/s; `audit`
holds the sale's audit plus `window`, `lost_updates` (units accepted beyond what the stock went
down by), `sold_out_answers`, `settle`, and `missing`: each figure the run could not measure
and why (a run never fails for want of its history); `parameters` holds the settings, the
sale's stock and, when it was sized, the `probe` that sized it. Runs left `running` by a load
run process that is gone are ended here (`end_orphaned_runs`).
See docs/load-runs.md#the-comparison.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Sum
from django.utils import timezone

from inventory.models import LIVE_STATUSES, Item, Order
from inventory.orders import OPEN_STATUSES
from inventory.selectors import audit_sale
from loadtest.bench.measure import percentile_ms, stat_fields
from loadtest.models import SaleRun
from shop import queues

from .config import Progress

logger = logging.getLogger(__name__)


def drop_queue(queue: str) -> None:
    """Delete a batch's task queue from the broker, its messages with it."""
    from kombu import Connection

    # Bound as Celery binds them (each to a direct exchange of its name), so that deleting
    # one removes its binding as well as its messages.
    with Connection(settings.CELERY_BROKER_URL) as connection:
        for declaration in queues.declarations(queue):
            bound = declaration(connection.default_channel)
            bound.declare()
            bound.delete()


def runner_record(pid: int, queue: str | None = None) -> dict[str, Any]:
    """Who records a run (`SaleRun.runner`): this host, process `pid` and when it started (a
    pid alone may be a later process's), and the task queue of the batch's worker."""
    return {"host": socket.gethostname(), "pid": pid, "since": _started(pid), "queue": queue}


def _started(pid: int) -> int | None:
    """When the process started, in clock ticks since boot; None when there is no such
    process (or no /proc)."""
    fields = stat_fields(pid)
    try:
        return None if fields is None else int(fields[19])
    except (IndexError, ValueError):
        return None


def _runner_gone(runner: dict[str, Any]) -> bool:
    """Whether the process that recorded a run is known to be gone (on a host without /proc,
    or for a run recorded without one, it is never known)."""
    if runner.get("host") != socket.gethostname() or not isinstance(runner.get("since"), int):
        return False
    pid = runner.get("pid")
    return not isinstance(pid, int) or _started(pid) != runner["since"]


def end_orphaned_runs(progress: Progress | None = None) -> list[SaleRun]:
    """End the runs left `running` by a load run process of this host that is gone (killed
    outright, SIGKILL or the OOM killer, with no chance to record it): each is marked failed,
    `interrupted`, and its batch's task queue deleted, as the process would have done. Runs
    recorded on another host are left alone (their process cannot be seen from here); the
    compare page lets a new batch start past them after an hour all the same."""
    ended = []
    for run in SaleRun.objects.filter(status=SaleRun.Status.RUNNING).order_by("pk"):
        runner = run.runner or {}
        if not _runner_gone(runner):
            continue
        run.status = SaleRun.Status.FAILED
        run.error = f"interrupted: its load run process ({runner.get('pid')}) is gone"
        run.finished_at = timezone.now()
        run.save(update_fields=["status", "error", "finished_at"])
        ended.append(run)
    for queue in sorted({run.runner.get("queue") for run in ended} - {None}):
        try:
            drop_queue(queue)
        except Exception as exc:  # the broker away: the runs are ended all the same
            logger.warning("could not delete the task queue %s of an ended run: %s", queue, exc)
    if ended and progress is not None:
        batches = ", ".join(sorted({run.batch for run in ended}))
        progress(f"ended {len(ended)} run(s) left running by a load run that is gone: {batches}")
    return ended


def note_missing(run: SaleRun, figure: str) -> None:
    """Say in the run's audit that a figure could not be measured, and why (the notes under the
    comparison show it)."""
    run.audit = {**run.audit, "missing": [*run.audit.get("missing", []), figure]}


def current_sale_id(sku: str) -> int:
    return Item.objects.filter(sku=sku).values_list("current_sale_id", flat=True).get()


def live_orders(sku: str) -> list[tuple[datetime, int]]:
    """(created_at, qty) of the live orders of sku's current sale, oldest first."""
    return list(
        Order.objects.filter(sale_id=current_sale_id(sku), status__in=LIVE_STATUSES)
        .order_by("created_at")
        .values_list("created_at", "qty")
    )


def units_sold(sku: str) -> int:
    live = Order.objects.filter(sale_id=current_sale_id(sku), status__in=LIVE_STATUSES)
    return live.aggregate(units=Sum("qty"))["units"] or 0


def units_left(audit: dict[str, Any]) -> int:
    """Units the database still holds for sale, per an audit."""
    if audit.get("db_stock") is not None:
        return audit["db_stock"]
    return audit["remaining"]


def record_audit(run: SaleRun, opened_at: datetime) -> list[tuple[datetime, int]]:
    """Audit the sale; record the time it took to sell out and the lost updates. Return its
    live orders (created_at, qty), oldest first, which its window is measured from."""
    audit = audit_sale(run.sku)
    left = units_left(audit)
    run.audit = {
        **audit,
        **run.audit,
        "lost_updates": audit["accepted_units"] - (audit["initial_stock"] - left),
        "sold_out": left == 0,
    }
    run.accepted_units = audit["accepted_units"]
    run.oversold = audit["oversold"]
    run.remaining = audit["remaining"]
    run.fallback_activations = audit["fallback_orders"]
    orders = live_orders(run.sku)
    if left == 0 and orders:
        run.sold_out_after_seconds = max((orders[-1][0] - opened_at).total_seconds(), 0.001)
    return orders


def wait_until_settled(sku: str, *, timeout: float) -> bool:
    """Wait until every order of sku's current sale is final (a worker paid or failed it)."""
    open_orders = Order.objects.filter(sale_id=current_sale_id(sku), status__in=OPEN_STATUSES)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not open_orders.exists():
            return True
        time.sleep(0.25)
    return False


def record_settling(run: SaleRun, opened_at: datetime, *, waited: float | None) -> None:
    """The settle lag of the sale's orders (from the 201 to a final status: p50, p99), the
    orders not settled when it was measured, and how many were pending, second by second."""
    orders = list(
        Order.objects.filter(sale_id=current_sale_id(run.sku)).values_list(
            "created_at", "updated_at", "status"
        )
    )
    settle = settle_figures(orders, opened_at)
    settle["waited_seconds"] = waited
    run.audit["settle"] = settle
    run.settle_p50_ms = settle["p50_ms"]
    run.settle_p99_ms = settle["p99_ms"]


def settle_figures(
    orders: list[tuple[datetime, datetime, str]], opened_at: datetime
) -> dict[str, Any]:
    """From (created_at, updated_at, status) of a sale's orders: the settle lag of the final
    ones (an order's updated_at is the time of its last change, the one that made it final),
    how many are still open, and the most orders pending in each second from the opening."""
    lags = sorted(
        (updated - created).total_seconds()
        for created, updated, status in orders
        if status not in OPEN_STATUSES
    )

    def percentile(share: float) -> float | None:
        value = percentile_ms(lags, share)
        return None if value is None else round(value, 1)

    # +1 at each order's creation, -1 when it became final; the most pending in each second.
    changes = [((created - opened_at).total_seconds(), 1) for created, _, _ in orders]
    changes += [
        ((updated - opened_at).total_seconds(), -1)
        for _, updated, status in orders
        if status not in OPEN_STATUSES
    ]
    changes.sort()
    pending: list[list[float]] = []
    if changes:
        level, index = 0, 0
        first = max(0, math.floor(changes[0][0]))
        last = max(first, math.floor(changes[-1][0]))
        for second in range(first, last + 1):
            peak = level  # pending as the second begins
            while index < len(changes) and changes[index][0] < second + 1:
                level += changes[index][1]
                peak = max(peak, level)
                index += 1
            pending.append([second, peak])
        pending.append([last + 1, level])
    return {
        "orders": len(orders),
        "settled": len(lags),
        "unsettled": len(orders) - len(lags),
        "p50_ms": percentile(0.5),
        "p99_ms": percentile(0.99),
        "pending": pending,
    }
