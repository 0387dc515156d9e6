"""The order pipeline's benchmark: how fast workers settle what a flood of checkouts accepted.

    python manage.py bench settle [--orders 3000] [--buyers 8] [--workers 1,2,4]
        [--payment-ms 50] [--timeout 300] [--json PATH]

Needs DATABASE_URL and REDIS_URL; sells in the load-run sandbox. A `lua` sale of --orders units
is bought out by --buyers processes with no worker running (the flood: orders accepted per
second); then, for each count in --workers, that many Celery workers, started as the project
starts them, settle the backlog with payments of --payment-ms, its messages sent as the web
processes' publishers would have sent them at the flood's pace. Every count settles the same
backlog, made pending again before it. Invariant held: every order paid exactly once and
confirmed within --timeout, or the run exits 1. Target: one worker settles at least what the
flood accepts. See docs/benchmarks.md#the-order-pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .arguments import whole
from .contenders import Contender
from .measure import process_cpu_seconds
from .rounds import run_contender
from .strategies import delete_task_queue, sandboxed, setup_django

SKU = "bench-settle"
#: What one worker must settle, per order the flood accepted in the same time.
TARGET = 1.0


@dataclass
class SettleResult:
    workers: int
    orders: int
    seconds: float
    settled_per_second: float
    worker_cpu_ms_per_order: float | None
    paid_once: bool
    timed_out: bool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="manage.py bench settle",
        description="How fast workers settle the orders a lua flood accepted.",
    )
    parser.add_argument("--orders", type=whole(10), default=3000, help="units sold (3000)")
    parser.add_argument("--buyers", type=whole(1), default=8, help="buyer processes (8)")
    parser.add_argument(
        "--workers", type=_counts, default=[1, 2, 4], help="worker counts to try (1,2,4)"
    )
    parser.add_argument(
        "--payment-ms", type=whole(0), default=50, help="payment latency in ms (50)"
    )
    parser.add_argument(
        "--timeout", type=whole(1), default=300, help="seconds a backlog may take (300)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def _counts(value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError("a list of worker counts, e.g. 1,2,4") from None
    if not counts or any(count < 1 or count > 16 for count in counts):
        raise argparse.ArgumentTypeError("worker counts from 1 to 16, e.g. 1,2,4")
    return counts


def _tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its children (a prefork pool's processes), from /proc."""
    total = process_cpu_seconds(pid) or 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            total += process_cpu_seconds(int(entry)) or 0.0
    return total


def _flood(args: argparse.Namespace) -> tuple[float, int]:
    """Sell the whole stock with no worker running; (accepted/s, sale id)."""
    from inventory.models import Item

    contender = Contender("lua", "strategy", SKU, safe=True, strategy="lua")
    flood_args = argparse.Namespace(
        buyers=args.buyers,
        stock=args.orders,
        ceiling_stock=args.orders,
        duration=max(60.0, args.timeout),
        profile=False,
        # No warm-up sale: its orders would join the backlog the workers are timed on.
        warmup=0,
    )
    result = run_contender(contender, flood_args, 0)
    if result.errors or result.sold != args.orders or result.broken:
        raise RuntimeError(f"the flood went wrong: {result.errors or result.audit}")
    sale_id = Item.objects.get(sku=SKU).current_sale_id
    assert sale_id is not None
    return result.buys_per_second, sale_id


def _settle(
    args: argparse.Namespace, sale_id: int, workers: int, chunk: int, queue: str, logs: Path
) -> SettleResult:
    from inventory import orders, publishing
    from inventory.models import Order, OrderStatus, PaymentAttempt
    from shop.processes.servers import CeleryWorker

    pks = list(Order.objects.filter(sale_id=sale_id).order_by("pk").values_list("pk", flat=True))
    env = {
        "FLASHSALE_TASK_QUEUE": queue,
        "FLASHSALE_PAYMENT_LATENCY_MS": str(args.payment_ms),
        "FLASHSALE_PAYMENT_FAILURE_RATE": "0",
    }
    started = [CeleryWorker(env, log_path=logs).start() for _ in range(workers)]
    try:
        cpu_before = sum(_tree_cpu_seconds(w.process.pid) for w in started if w.process)
        began = time.monotonic()
        for start in range(0, len(pks), chunk):
            publishing.publish_orders(pks[start : start + chunk])
        deadline = began + args.timeout
        open_orders = Order.objects.filter(sale_id=sale_id, status__in=orders.OPEN_STATUSES)
        timed_out = False
        while open_orders.exists():
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        seconds = time.monotonic() - began
        cpu = sum(_tree_cpu_seconds(w.process.pid) for w in started if w.process) - cpu_before
    finally:
        for worker in started:
            worker.stop()
    paid = PaymentAttempt.objects.filter(order__sale_id=sale_id)
    confirmed = Order.objects.filter(sale_id=sale_id, status=OrderStatus.CONFIRMED).count()
    paid_once = (
        confirmed == len(pks)
        and paid.count() == len(pks)
        and paid.values("order_id").distinct().count() == len(pks)
    )
    return SettleResult(
        workers=workers,
        orders=len(pks),
        seconds=seconds,
        settled_per_second=len(pks) / seconds if seconds > 0 else 0.0,
        worker_cpu_ms_per_order=1000 * cpu / len(pks) if pks else None,
        paid_once=paid_once,
        timed_out=timed_out,
    )


def _pending_again(sale_id: int) -> None:
    """The same backlog for the next count: every order pending, no payment recorded."""
    from inventory.models import Order, OrderStatus, PaymentAttempt

    PaymentAttempt.objects.filter(order__sale_id=sale_id).delete()
    Order.objects.filter(sale_id=sale_id).update(status=OrderStatus.PENDING)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = setup_django() or sandboxed("loadtest.bench.settle", argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    from django.conf import settings

    import inventory.services  # noqa: F401  (warm before the buyers fork)
    from inventory.keys import key as redis_key
    from inventory.publishing import PUBLISH_BATCH
    from shop import queues
    from shop.celery import app

    pool = f"{settings.CELERY_WORKER_POOL} x{settings.CELERY_WORKER_CONCURRENCY}"
    print(
        f"{args.orders} orders: a lua flood by {args.buyers} buyer processes with no worker, "
        f"then {', '.join(map(str, args.workers))} worker(s) ({pool} each) on the backlog, "
        f"payments of {args.payment_ms} ms, {os.cpu_count()} CPUs"
    )
    # The flood's own publishers send to a queue nobody reads, dropped after it; the backlog
    # goes to another, which the workers read.
    flood_queue = redis_key("bench", os.getpid(), "flood")
    settle_queue = redis_key("bench", os.getpid(), "settle")
    queues.use(app, flood_queue)
    try:
        accepted, sale_id = _flood(args)
    finally:
        delete_task_queue(flood_queue)
    interval = settings.FLASHSALE_PUBLISH_INTERVAL_MS / 1000
    # What one web process's publisher gathers in an interval at the flood's pace.
    chunk = max(1, min(PUBLISH_BATCH, round(accepted * interval / args.buyers)))
    print(f"  flood: {accepted:.0f} orders accepted/s; backlog sent in messages of {chunk}")
    queues.use(app, settle_queue)
    logs = Path(tempfile.gettempdir()) / f"bench-settle-{os.getpid()}.log"
    results: list[SettleResult] = []
    try:
        for n, workers in enumerate(args.workers):
            if n:
                _pending_again(sale_id)
            result = _settle(args, sale_id, workers, chunk, settle_queue, logs)
            results.append(result)
            print(
                f"  {workers} worker(s): {result.settled_per_second:.0f} settled/s in "
                f"{result.seconds:.2f} s" + ("" if result.paid_once else "  NOT PAID ONCE"),
                flush=True,
            )
    finally:
        delete_task_queue(settle_queue)

    _print(accepted, results)
    if args.json:
        args.json.write_text(json.dumps(_document(args, accepted, chunk, results), indent=2) + "\n")
    failed = [r for r in results if r.timed_out or not r.paid_once]
    if failed:
        print(
            "backlog not settled exactly once by: "
            + ", ".join(f"{r.workers} worker(s)" for r in failed),
            file=sys.stderr,
        )
    return 1 if failed else 0


def _print(accepted: float, results: list[SettleResult]) -> None:
    header = f"{'phase':<20} {'orders/s':>9} {'vs flood':>9} {'seconds':>8} {'cpu ms/order':>13}"
    print()
    print(header)
    print("-" * len(header))
    print(f"{'flood (accepted)':<20} {accepted:>9.0f} {'':>9} {'':>8} {'':>13}")
    for r in results:
        cpu = "-" if r.worker_cpu_ms_per_order is None else f"{r.worker_cpu_ms_per_order:.2f}"
        name = f"settle, {r.workers} worker" + ("s" if r.workers > 1 else "")
        print(
            f"{name:<20} {r.settled_per_second:>9.0f} {r.settled_per_second / accepted:>8.2f}x "
            f"{r.seconds:>8.2f} {cpu:>13}"
        )
    one = next((r for r in results if r.workers == 1), None)
    if one is not None:
        ratio = one.settled_per_second / accepted
        verdict = "met" if ratio >= TARGET else "MISSED"
        print(
            f"\ntarget: one worker settles / the flood accepts: {ratio:.2f}x "
            f"(target >= {TARGET:.1f}x): {verdict}"
        )
    print(
        "(cpu ms/order: the worker processes, their pools included, per order settled; "
        "PostgreSQL's share is not in it.)"
    )


def _document(
    args: argparse.Namespace, accepted: float, chunk: int, results: list[SettleResult]
) -> dict[str, Any]:
    from django.conf import settings

    return {
        "parameters": {
            "orders": args.orders,
            "buyers": args.buyers,
            "workers": args.workers,
            "payment_ms": args.payment_ms,
            "pool": settings.CELERY_WORKER_POOL,
            "concurrency": settings.CELERY_WORKER_CONCURRENCY,
            "publish_interval_ms": settings.FLASHSALE_PUBLISH_INTERVAL_MS,
            "message_orders": chunk,
            "cpus": os.cpu_count(),
        },
        "accepted_per_second": accepted,
        "results": [asdict(r) for r in results],
    }


if __name__ == "__main__":
    sys.exit(main())
