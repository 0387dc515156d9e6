"""One contender, one round: prepare its sale, fork the buyer processes, gather and audit."""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import threading
import time
from typing import Any

from .buyers import buyer_process
from .contenders import (
    EVALSHA,
    EVALSHA_SELL,
    HOT_ROW,
    BuyerReport,
    Contender,
    Result,
    warm_sku,
)
from .measure import (
    host_cpu_times,
    lock_wait_allowed_seconds,
    percentile_ms,
    redis_cpu_seconds,
    wal_position,
)

# -- one contender ---------------------------------------------------------------------------


def _prepare(contender: Contender, stock: int, ceiling_stock: int, warmup: int) -> None:
    """Start the contender's sale of `stock` units, and its warm-up sale (`warm_sku`) of
    `warmup` units, sold before the measured one starts."""
    from inventory.redis_client import get_redis_client
    from inventory.services import start_sale

    for sku, units in ((contender.sku, stock), (warm_sku(contender), warmup)):
        if contender.way == EVALSHA:
            get_redis_client().set(sku, ceiling_stock if sku == contender.sku else warmup)
        elif not units:
            continue
        elif contender.way == HOT_ROW:
            start_sale(sku=sku, stock=units, strategy="optimistic", name="Bench hot row")
        elif contender.way == EVALSHA_SELL:
            start_sale(sku=sku, stock=units, strategy="lua", name="Bench take + row sale")
        else:
            strategy = contender.strategy if contender.kind == "strategy" else "lock"
            start_sale(sku=sku, stock=units, strategy=strategy, name=f"Bench {strategy}")


def _audit(contender: Contender, stock: int, sold: int) -> dict[str, Any]:
    if contender.way == EVALSHA:
        from inventory.redis_client import get_redis_client

        client = get_redis_client()
        raw = client.get(contender.sku)
        client.delete(contender.sku)
        left = None if raw is None else int(raw)
        return {
            "initial_stock": stock,
            "accepted_units": sold,
            "oversold": max(0, sold - stock),
            "remaining": left,
            "consistent": left is not None and left == stock - sold and left >= 0,
        }
    from inventory.selectors import audit_sale

    return audit_sale(contender.sku)


def _units_per_commit(contender: Contender) -> float | None:
    """The orders of the contender's sale over its commits: `batch_statement.sell_batch`
    stamps the orders of one batch with one `created_at`. None when it sold nothing."""
    from django.db.models import Count

    from inventory.models import Item, Order

    sale = Item.objects.get(sku=contender.sku).current_sale_id
    if sale is None:
        return None
    counts = Order.objects.filter(sale_id=sale).aggregate(
        orders=Count("pk"), commits=Count("created_at", distinct=True)
    )
    return counts["orders"] / counts["commits"] if counts["commits"] else None


def run_contender(contender: Contender, args: argparse.Namespace, round_: int) -> Result:
    from django.db import connections

    stock = args.ceiling_stock if contender.way == EVALSHA else args.stock
    buyer_count = contender.buyers or args.buyers
    _prepare(contender, args.stock, args.ceiling_stock, args.warmup * buyer_count)
    # Children open their own connections: a connection shared across fork is corrupted.
    connections.close_all()

    # The buyers, numbered from 0, in processes of `contender.threads` threads (the last one
    # takes what is left).
    buyer_numbers = list(range(buyer_count))
    groups = [
        buyer_numbers[first : first + contender.threads]
        for first in range(0, buyer_count, contender.threads)
    ]
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(len(groups) + 1)
    reports = context.Queue()
    processes = [
        context.Process(
            target=buyer_process,
            args=(contender, workers, args.duration, args.profile, args.warmup, barrier, reports),
            name=f"buyer-{contender.sku}-{workers[0]}",
        )
        for workers in groups
    ]
    for process in processes:
        process.start()

    gathered: dict[int, dict[str, Any]] = {}
    host_before = redis_before = wal_before = None
    started_at = time.monotonic()
    try:
        # Two turns of the barrier: the first once every buyer is warm and waiting, so that
        # the counters read between the two take in none of the warm-up and none of the round.
        barrier.wait(120)
        try:
            host_before = host_cpu_times()
            redis_before = redis_cpu_seconds()
            wal_before = wal_position()
        except BaseException:
            barrier.abort()  # the buyers stop waiting (and report it) rather than time out
            raise
        barrier.wait(120)
        started_at = time.monotonic()
    except threading.BrokenBarrierError:
        pass  # a buyer failed to start: its report says why
    wait_limit = args.duration + 2 * lock_wait_allowed_seconds() + 60
    try:
        while len(gathered) < len(groups):
            worker, report = reports.get(
                timeout=max(1.0, started_at + wait_limit - time.monotonic())
            )
            gathered[worker] = report
    except queue.Empty:
        pass  # the missing buyers are reported below
    host_after = host_cpu_times()
    redis_after = redis_cpu_seconds()
    wal_after = wal_position()
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()

    buyers = [BuyerReport(**gathered[worker]) for worker in sorted(gathered)]
    errors = [report.error for report in buyers if report.error]
    missing = len(groups) - len(buyers)
    if missing:
        errors.append(f"{missing} buyer process(es) reported nothing")
    sold = sum(report.sold for report in buyers)
    start = min([started_at, *(report.started_at for report in buyers if report.started_at)])
    ends = [report.last_sale_at for report in buyers if report.last_sale_at]
    seconds = (max(ends) - start) if ends else 0.0
    audit = _audit(contender, stock, sold)
    notes = []
    units_per_commit = _units_per_commit(contender) if contender.batched else None
    if units_per_commit is not None:
        notes.append(f"units per commit {units_per_commit:.1f}")
    # Each thread is a buyer: the fewest share is over threads, not processes.
    thread_sold = [units for report in buyers for units in report.thread_sold]

    def per_buy(total: float | None) -> float | None:
        return None if total is None or not sold else 1000 * total / sold

    backend = [report.backend_cpu_seconds for report in buyers]
    host_busy = None
    if host_before and host_after and host_after[1] > host_before[1]:
        host_busy = (host_after[0] - host_before[0]) / (host_after[1] - host_before[1])
    redis_cpu = None
    if redis_before is not None and redis_after is not None:
        redis_cpu = redis_after - redis_before
    durations = sorted(seconds for report in buyers for seconds in report.sale_seconds)
    phases: dict[str, float] = {}
    for report in buyers:
        for phase, phase_seconds in report.timings.items():
            phases[phase] = phases.get(phase, 0.0) + phase_seconds
    return Result(
        contender=contender.name,
        kind=contender.kind,
        round=round_,
        buyers=buyer_count,
        stock=stock,
        sold=sold,
        busy=sum(report.busy for report in buyers),
        seconds=seconds,
        buys_per_second=sold / seconds if seconds > 0 else 0.0,
        capped=any(report.capped for report in buyers),
        errors=errors,
        accepted_units=audit["accepted_units"],
        oversold=audit["oversold"],
        remaining=audit["remaining"],
        consistent=bool(audit["consistent"]),
        safe=contender.safe,
        client_cpu_ms_per_buy=per_buy(sum(report.cpu_seconds for report in buyers)),
        postgres_cpu_ms_per_buy=None
        if contender.way == EVALSHA or None in backend or not backend
        else per_buy(sum(seconds or 0.0 for seconds in backend)),
        redis_cpu_ms_per_buy=per_buy(redis_cpu),
        host_cpu_busy=host_busy,
        wal_bytes_per_buy=(wal_after - wal_before) / sold
        if wal_before is not None and wal_after is not None and sold
        else None,
        p50_ms=percentile_ms(durations, 0.50),
        p99_ms=percentile_ms(durations, 0.99),
        p999_ms=percentile_ms(durations, 0.999),
        longest_ms=percentile_ms(durations, 1.0),
        fewest_share=min(thread_sold) * len(thread_sold) / sold
        if sold and thread_sold and not missing and len(thread_sold) == buyer_count
        else None,
        units_per_commit=units_per_commit,
        audit={key: value for key, value in audit.items() if key != "orders_by_status"},
        phases_ms_per_buy={phase: 1000 * total / sold for phase, total in phases.items()}
        if sold
        else {},
        notes=notes,
    )
