"""One contender, one round: prepare its sale, fork the buyers, gather and audit."""

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
    process_cpu_seconds,
    redis_cpu_seconds,
    scheduled_seconds,
    wal_position,
)

# -- one contender ---------------------------------------------------------------------------


def _prepare(contender: Contender, stock: int, ceiling_stock: int, warmup: int) -> None:
    """Start the contender's sale of `stock` units, and its warm-up sale (`warm_sku`) of
    `warmup` units, sold before the measured one starts."""
    from inventory.redis_client import get_redis_client
    from inventory.services import start_sale

    for sku, units in ((contender.sku, stock), (warm_sku(contender), warmup)):
        if contender.name == EVALSHA:
            get_redis_client().set(sku, ceiling_stock if sku == contender.sku else warmup)
        elif not units:
            continue
        elif contender.name == HOT_ROW:
            start_sale(sku=sku, stock=units, strategy="optimistic", name="Bench hot row")
        elif contender.name == EVALSHA_SELL:
            start_sale(sku=sku, stock=units, strategy="lua", name="Bench take + row sale")
        else:
            strategy = contender.strategy if contender.kind == "strategy" else "lock"
            start_sale(sku=sku, stock=units, strategy=strategy, name=f"Bench {strategy}")


def _audit(contender: Contender, stock: int, sold: int) -> dict[str, Any]:
    if contender.name == EVALSHA:
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


def _serve_sales(path: str, ready: Any) -> None:
    """Body of the sale writer's process, for a contender that sells through one."""
    import signal

    from django.conf import settings
    from inventory.writer import SaleWriter, take_priority

    from inventory.api import answer_checkout

    refused = take_priority(settings.FLASHSALE_SALE_WRITER_NICE)
    if refused:
        print(f"warning: {refused}", flush=True)
    writer = SaleWriter(path, answer=answer_checkout)
    signal.signal(signal.SIGTERM, lambda *_: writer.stop())
    writer.serve_forever(ready=ready.set)


class _Writer:
    """The sale writer a contender's buyers send their sales to, started for its round: its
    CPU and its database backend's are counted with the buyers'."""

    def __init__(self, context: Any, path: str) -> None:
        self.path = path
        ready = context.Event()
        self.process = context.Process(target=_serve_sales, args=(path, ready), name="writer")
        self.process.start()
        if not ready.wait(30):
            self.process.kill()
            raise RuntimeError("the sale writer did not start")
        self.mark()

    def mark(self) -> None:
        """Count its CPU, its backend's and its stats from now on (the warm-up's are not)."""
        self.stats = self._stats()
        self.cpu = process_cpu_seconds(self.process.pid) or 0.0
        self.backend_cpu = _backends_cpu(self.stats)
        self.scheduled = self._scheduled(self.stats)

    def _scheduled(self, stats: dict[str, Any]) -> dict[str, tuple[float, float] | None]:
        return {
            "writer": scheduled_seconds(self.process.pid),
            "its backends": _backends_scheduled(stats),
        }

    def _stats(self) -> dict[str, Any]:
        from inventory.writer import writer_stats

        for _ in range(100):
            stats = writer_stats(self.path)
            if stats["backend_pid"]:
                return stats
            time.sleep(0.05)
        raise RuntimeError("the sale writer has no database connection")

    def finish(self) -> tuple[float, float, dict[str, Any]]:
        """(its CPU seconds, its backend's, its stats) since the last mark; then stop it."""
        stats = self._stats()
        cpu = (process_cpu_seconds(self.process.pid) or 0.0) - self.cpu
        backend = _backends_cpu(stats) - self.backend_cpu
        scheduled = self._scheduled(stats)
        stats = {
            name: value - self.stats[name] if name in _COUNTED else value
            for name, value in stats.items()
        }
        # A new backend (after a lost connection) has no earlier reading to count from.
        same_backend = _pids(stats) == _pids(self.stats)
        stats["scheduled"] = {
            role: (now[0] - before[0], now[1] - before[1])
            for role, now in scheduled.items()
            if now is not None
            and (before := self.scheduled[role]) is not None
            and (role == "writer" or same_backend)
        }
        self.process.terminate()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return cpu, backend, stats


def _pids(stats: dict[str, Any]) -> list[int]:
    """The PostgreSQL backends of the writer's connections."""
    return [pid for pid in stats["backend_pids"] if pid]


def _backends_cpu(stats: dict[str, Any]) -> float:
    return sum(process_cpu_seconds(pid) or 0.0 for pid in _pids(stats))


def _backends_scheduled(stats: dict[str, Any]) -> tuple[float, float] | None:
    """(on a CPU, waiting for one) of the writer's backends together; None when unreadable."""
    pids = _pids(stats)
    readings = [reading for pid in pids if (reading := scheduled_seconds(pid)) is not None]
    if not pids or len(readings) < len(pids):
        return None
    return sum(running for running, _ in readings), sum(waiting for _, waiting in readings)


#: The writer's stats that count up (the rest name its process).
_COUNTED = (
    "sales",
    "batches",
    "take_seconds",
    "take_cpu_seconds",
    "commit_seconds",
    "commit_cpu_seconds",
    "handed",
    "released",
    "taken_ahead",
    "sold_ahead",
    "returned_ahead",
    "ahead_seconds",
    "ahead_cpu_seconds",
)


def _writer_summary(stats: dict[str, Any], cpu: float, seconds: float) -> str:
    """Its batches, and where one batch's turn went: a batch every `seconds` / batches, of
    which the take and the statement are timed; the rest is the wait for the buyers to send
    again (their own CPU, on cores they share) and the answers. Then how long the writer's
    thread and its database backend, the two a batch passes through in turn, ran on a CPU and
    waited for one, per batch (Linux's schedstat: the time a woken process queues behind
    others is the part of the turn that CPU counts cannot show)."""
    batches = max(stats["batches"], 1)

    def per_batch(seconds: float) -> str:
        return f"{1000 * seconds / batches:.2f}"

    summary = (
        f"sale writer: {stats['sales']} sales in {stats['batches']} batches "
        f"({stats['sales'] / batches:.1f} per batch, one every {per_batch(seconds)} ms); "
        f"per batch, ms: take "
        f"{per_batch(stats['take_seconds'])} ({per_batch(stats['take_cpu_seconds'])} CPU), "
        f"statement {per_batch(stats['commit_seconds'])} "
        f"({per_batch(stats['commit_cpu_seconds'])} CPU); "
        f"its CPU per sale {1000 * cpu / max(stats['sales'], 1):.2f} ms; "
        f"statements in flight at once, at most: {stats['most_in_flight']} "
        f"of {len(_pids(stats))} connections"
    )
    if stats.get("taken_ahead"):
        summary += (
            f"; taken ahead: {stats['taken_ahead']} units "
            f"({per_batch(stats['ahead_seconds'])} ms a batch, "
            f"{per_batch(stats['ahead_cpu_seconds'])} CPU), {stats['sold_ahead']} sales served "
            f"from them, {stats['returned_ahead']} given back"
        )
    if stats.get("held"):
        summary += (
            f"; waited for the last batch's buyers: {stats['held']} batches, "
            f"{1000 * stats['held_seconds'] / stats['held']:.2f} ms each"
        )
    if stats.get("released"):
        summary += f"; holders' locks released with their commits: {stats['released']}"
    scheduled = stats.get("scheduled")
    if scheduled:
        summary += "\n      per batch, ms on a CPU / waiting for one: " + ", ".join(
            f"{role} {per_batch(running)} / {per_batch(waiting)}"
            for role, (running, waiting) in scheduled.items()
        )
    return summary


def run_contender(contender: Contender, args: argparse.Namespace, round_: int) -> Result:
    from django.db import connections

    stock = args.ceiling_stock if contender.name == EVALSHA else args.stock
    buyer_count = contender.buyers or args.buyers
    _prepare(contender, args.stock, args.ceiling_stock, args.warmup * buyer_count)
    # Children open their own connections: a connection shared across fork is corrupted.
    connections.close_all()

    context = multiprocessing.get_context("fork")
    writer_path = contender.settings.get("FLASHSALE_SALE_WRITER")
    writer = _Writer(context, writer_path) if writer_path else None
    barrier = context.Barrier(buyer_count + 1)
    reports = context.Queue()
    processes = [
        context.Process(
            target=buyer_process,
            args=(contender, worker, args.duration, args.profile, args.warmup, barrier, reports),
            name=f"buyer-{contender.sku}-{worker}",
        )
        for worker in range(buyer_count)
    ]
    for process in processes:
        process.start()

    gathered: dict[int, dict[str, Any]] = {}
    host_before = redis_before = wal_before = None
    started_at = time.monotonic()
    try:
        # Two turns of the barrier: the first once every buyer is warm and waiting, so that
        # the counters read between the two (the writer's sales among them) take in none of
        # the warm-up and none of the round.
        barrier.wait(120)
        try:
            host_before = host_cpu_times()
            redis_before = redis_cpu_seconds()
            wal_before = wal_position()
            if writer is not None:
                writer.mark()
        except BaseException:
            barrier.abort()  # the buyers stop waiting (and report it) rather than time out
            raise
        barrier.wait(120)
        started_at = time.monotonic()
    except threading.BrokenBarrierError:
        pass  # a buyer failed to start: its report says why
    wait_limit = args.duration + 2 * lock_wait_allowed_seconds() + 60
    try:
        while len(gathered) < buyer_count:
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
    writer_cpu = writer_backend_cpu = 0.0
    writer_stats: dict[str, Any] = {}
    notes = []
    if writer is not None:
        writer_cpu, writer_backend_cpu, writer_stats = writer.finish()

    buyers = [BuyerReport(**gathered[worker]) for worker in sorted(gathered)]
    errors = [report.error for report in buyers if report.error]
    missing = buyer_count - len(buyers)
    if missing:
        errors.append(f"{missing} buyer process(es) reported nothing")
    sold = sum(report.sold for report in buyers)
    start = min([started_at, *(report.started_at for report in buyers if report.started_at)])
    ends = [report.last_sale_at for report in buyers if report.last_sale_at]
    seconds = (max(ends) - start) if ends else 0.0
    if writer_stats.get("batches"):
        notes.append(_writer_summary(writer_stats, writer_cpu, seconds))
    audit = _audit(contender, stock, sold)

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
        client_cpu_ms_per_buy=per_buy(sum(report.cpu_seconds for report in buyers) + writer_cpu),
        postgres_cpu_ms_per_buy=None
        if contender.name == EVALSHA or None in backend or not backend
        else per_buy(sum(seconds or 0.0 for seconds in backend) + writer_backend_cpu),
        redis_cpu_ms_per_buy=per_buy(redis_cpu),
        host_cpu_busy=host_busy,
        wal_bytes_per_buy=(wal_after - wal_before) / sold
        if wal_before is not None and wal_after is not None and sold
        else None,
        p50_ms=percentile_ms(durations, 0.50),
        p99_ms=percentile_ms(durations, 0.99),
        p999_ms=percentile_ms(durations, 0.999),
        longest_ms=percentile_ms(durations, 1.0),
        fewest_share=min(report.sold for report in buyers) * len(buyers) / sold
        if sold and buyers and not missing
        else None,
        audit={key: value for key, value in audit.items() if key != "orders_by_status"},
        phases_ms_per_buy={phase: 1000 * total / sold for phase, total in phases.items()}
        if sold
        else {},
        notes=notes,
    )
