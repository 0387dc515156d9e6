"""The buyer processes: each runs its buyers as threads, each of which connects, waits at the
barrier and buys until sold out or capped."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from .contenders import EVALSHA, EVALSHA_SELL, HOT_ROW, BuyerReport, Contender, warm_sku
from .measure import Probe, process_cpu_seconds

# -- buyer processes ------------------------------------------------------------------------


def _backend_pid() -> int | None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def _buy_through_place_order(sku: str, label: str, worker: int) -> Callable[[], bool]:
    """One checkout of one unit through the service; True when sold, False when sold out."""
    from inventory.exceptions import SoldOut
    from inventory.services import place_order

    serial = iter(range(10**9))

    def buy() -> bool:
        try:
            place_order(sku=sku, qty=1, buyer=f"{label}-{worker}-{next(serial)}")
        except SoldOut:
            return False
        return True

    return buy


def _sell_directly(sku: str, label: str, worker: int, served_by: str) -> Callable[[], bool]:
    """One sale statement of `inventory.sale_statement.sell` (guarded UPDATE of the item row,
    order INSERT, commit), called directly: no service, no Redis, no lock."""
    from inventory.models import Item
    from inventory.sale_statement import SaleRecorder, sell
    from inventory.sale_values import Allocation
    from inventory.strategies.waits import simulate_work

    item = Item.objects.get(sku=sku)
    serial = iter(range(10**9))
    allocation = Allocation(served_by)

    def buy() -> bool:
        simulate_work()
        order = SaleRecorder(item=item, qty=1, buyer=f"{label}-{worker}-{next(serial)}")
        return sell(order, allocation) is not None

    return buy


def _buy_from_hot_row(sku: str, label: str, worker: int) -> Callable[[], bool]:
    """The hot-row ceiling: the sale statement alone."""
    return _sell_directly(sku, label, worker, "optimistic")


def _buy_by_evalsha_and_sell(sku: str, label: str, worker: int) -> Callable[[], bool]:
    """The durable floor of `lua`: its take script (one EVALSHA over the sale's stripe
    counters), then the sale statement on the stripe it names, and nothing else."""
    from inventory import keys
    from inventory.models import Item
    from inventory.sale_statement import SaleRecorder, sell
    from inventory.sale_values import Allocation
    from inventory.strategies.counters import counter as stock_counter

    item = Item.objects.get(sku=sku)
    counter = stock_counter()
    counters, cursor = keys.stripe_counters(item), keys.turn(item)
    serial = iter(range(10**9))

    def buy() -> bool:
        plan = counter.take_spread(cursor, counters, 1)
        if plan is None:
            raise RuntimeError(f"the stripe counters of {sku} are missing")
        if not plan:
            return False
        order = SaleRecorder(item=item, qty=1, buyer=f"{label}-{worker}-{next(serial)}")
        return sell(order, Allocation("lua", shard_units=plan)) is not None

    return buy


def _buy_by_evalsha(key: str) -> Callable[[], bool]:
    """The Redis ceiling: the check-and-DECRBY script of StockCounter.take, nothing else."""
    from inventory.redis_client import get_redis_client
    from locking.scripts.counter import STOCK_TAKE

    client = get_redis_client()
    sha = client.script_load(STOCK_TAKE)

    def buy() -> bool:
        left = int(client.evalsha(sha, 1, key, 1))
        if left == -2:
            raise RuntimeError(f"counter {key} is missing")
        return left >= 0

    return buy


def _buyer(contender: Contender, sku: str, worker: int) -> Callable[[], bool]:
    """One buy of the contender's way, from the sale of `sku`."""
    if contender.way == EVALSHA:
        return _buy_by_evalsha(sku)
    if contender.way == HOT_ROW:
        return _buy_from_hot_row(sku, contender.sku, worker)
    if contender.way == EVALSHA_SELL:
        return _buy_by_evalsha_and_sell(sku, contender.sku, worker)
    return _buy_through_place_order(sku, contender.sku, worker)


def buy_until_done(buy: Callable[[], bool], report: BuyerReport, duration: float) -> None:
    """Buy one unit at a time until sold out or `duration` is up. Each sale's time runs from
    the first call for its unit to the sale: a buyer told `busy` asks again for the same unit,
    so its busy answers and their waits are the sale's."""
    from inventory.exceptions import Busy

    report.started_at = time.monotonic()
    deadline = report.started_at + duration
    asked: float | None = None
    while True:
        if time.monotonic() >= deadline:
            report.capped = True
            break
        if asked is None:
            asked = time.perf_counter()
        try:
            if not buy():
                break
        except Busy:
            report.busy += 1
            continue
        report.sale_seconds.append(time.perf_counter() - asked)
        asked = None
        report.sold += 1
        report.last_sale_at = time.monotonic()


def buyer_process(
    contender: Contender,
    workers: list[int],
    duration: float,
    profile: bool,
    warmup: int,
    barrier: Any,
    reports: Any,
) -> None:
    """Body of one buyer process: a thread per buyer of `workers` (each with its own
    connection) buys `warmup` units of the warm-up sale the contender's way; once every thread
    is warm, the process waits for the others, then its threads buy until sold out or capped.
    It reports its threads' figures summed (and each one's units), under its first worker."""
    report = BuyerReport()
    probe = Probe() if profile else None
    threads: list[_BuyerThread] = []
    try:
        from inventory.redis_client import get_redis_client

        get_redis_client().ping()
        from django.conf import settings

        for name, value in contender.settings.items():
            setattr(settings, name, value)
        if contender.hold_ms is not None:
            settings.FLASHSALE_HOLD_DELAY_MS = contender.hold_ms
        if contender.peer is not None:
            # The seam the strategies build their locks through: nothing else differs.
            settings.FLASHSALE_LOCK_FACTORY = contender.peer.factory
        if probe is not None and contender.name != EVALSHA:
            probe.install()
        warm = threading.Barrier(len(workers) + 1)
        go = threading.Barrier(len(workers) + 1)
        threads = [
            _BuyerThread(contender, worker, duration, warmup, probe, warm, go) for worker in workers
        ]
        for thread in threads:
            thread.start()
        warm.wait()  # every thread warm, or one failed (the barrier is then broken)
    except BaseException:
        report.error = traceback.format_exc(limit=4)
        _abandon(threads, barrier)
        reports.put((workers[0], asdict(_summed(report, threads))))
        return

    cpu = time.process_time()  # every thread's, from here on
    try:
        barrier.wait(120)  # every buyer is warm: the round's counters are read now
        barrier.wait(120)  # and the round starts
        go.wait()
    except BaseException:
        report.error = traceback.format_exc(limit=6)
        go.abort()
    for thread in threads:
        thread.join()
    report.cpu_seconds = time.process_time() - cpu
    if probe is not None:
        report.timings = probe.seconds
    reports.put((workers[0], asdict(_summed(report, threads))))


def _abandon(threads: list[_BuyerThread], barrier: Any) -> None:
    """A process that cannot take part: its threads stop waiting, and so do the other
    processes and the round (they report it rather than time out)."""
    barrier.abort()
    for thread in threads:
        thread.warm.abort()
        thread.go.abort()
    for thread in threads:
        thread.join()


def _summed(report: BuyerReport, threads: list[_BuyerThread]) -> BuyerReport:
    """The process's report: its threads' figures added to `report`'s."""
    mine = [thread.report for thread in threads]
    report.sold = sum(each.sold for each in mine)
    report.busy = sum(each.busy for each in mine)
    report.capped = any(each.capped for each in mine)
    started = [each.started_at for each in mine if each.started_at]
    report.started_at = min(started) if started else 0.0
    ends = [each.last_sale_at for each in mine if each.last_sale_at]
    report.last_sale_at = max(ends) if ends else None
    report.sale_seconds = [seconds for each in mine for seconds in each.sale_seconds]
    report.thread_sold = [each.sold for each in mine]
    backend = [each.backend_cpu_seconds for each in mine]
    if backend and None not in backend:
        report.backend_cpu_seconds = sum(seconds or 0.0 for seconds in backend)
    errors = [report.error, *(each.error for each in mine)]
    report.error = "\n".join(error for error in errors if error) or None
    return report


class _BuyerThread(threading.Thread):
    """One buyer: its own database connection (Django opens one per thread), warm-up, then
    buying; it reads its backend's CPU around the round, and closes its connection at the end."""

    def __init__(
        self,
        contender: Contender,
        worker: int,
        duration: float,
        warmup: int,
        probe: Probe | None,
        warm: threading.Barrier,
        go: threading.Barrier,
    ) -> None:
        super().__init__(name=f"buyer-{worker}", daemon=True)
        self.contender = contender
        self.worker = worker
        self.duration = duration
        self.warmup = warmup
        self.probe = probe
        self.warm = warm
        self.go = go
        self.report = BuyerReport()
        self.backend_pid: int | None = None

    def run(self) -> None:
        from django.db import connections

        try:
            self._run()
        finally:
            connections.close_all()  # this thread's connections

    def _run(self) -> None:
        from inventory.exceptions import Busy

        contender, report = self.contender, self.report
        try:
            if contender.name != EVALSHA:
                self.backend_pid = _backend_pid()
                if self.probe is not None:
                    self.probe.watch_connection()
            if self.warmup:
                # Connections, prepared statements, caches: warm before the barrier, so that a
                # round measures selling rather than starting up.
                warm_buy = _buyer(contender, warm_sku(contender), self.worker)
                for _ in range(self.warmup):
                    try:
                        warm_buy()
                    except Busy:
                        pass
            buy = _buyer(contender, contender.sku, self.worker)
        except BaseException:
            report.error = traceback.format_exc(limit=4)
            self.warm.abort()
            return
        backend_cpu = process_cpu_seconds(self.backend_pid) if self.backend_pid else None
        try:
            self.warm.wait()
            self.go.wait()
            buy_until_done(buy, report, self.duration)
        except threading.BrokenBarrierError:
            return  # another buyer of the process, or the process, failed: its report says why
        except BaseException:
            report.error = traceback.format_exc(limit=6)
        if backend_cpu is not None and self.backend_pid is not None:
            # Read before the connection closes: its backend exits with it.
            after = process_cpu_seconds(self.backend_pid)
            report.backend_cpu_seconds = None if after is None else after - backend_cpu
