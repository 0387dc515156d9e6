"""The buyer processes: each connects, waits at the barrier and buys until sold out or capped."""

from __future__ import annotations

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
    """One sale statement of `inventory.stock.sell` (guarded UPDATE of the item row, order
    INSERT, commit), called directly: no service, no Redis, no lock."""
    from inventory.models import Item
    from inventory.stock import SaleRecorder, sell, simulate_work
    from inventory.strategies.base import Allocation

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
    from inventory.stock import SaleRecorder, sell
    from inventory.strategies import plumbing
    from inventory.strategies.base import Allocation

    item = Item.objects.get(sku=sku)
    counter = plumbing.counter()
    counters, cursor = keys.rows(item), keys.turn(item)
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
    from locking import scripts

    client = get_redis_client()
    sha = client.script_load(scripts.STOCK_TAKE)

    def buy() -> bool:
        left = int(client.evalsha(sha, 1, key, 1))
        if left == -2:
            raise RuntimeError(f"counter {key} is missing")
        return left >= 0

    return buy


def _buyer(contender: Contender, sku: str, worker: int) -> Callable[[], bool]:
    """One buy of the contender's way, from the sale of `sku`."""
    if contender.name == EVALSHA:
        return _buy_by_evalsha(sku)
    if contender.name == HOT_ROW:
        return _buy_from_hot_row(sku, contender.sku, worker)
    if contender.name == EVALSHA_SELL:
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
    worker: int,
    duration: float,
    profile: bool,
    warmup: int,
    barrier: Any,
    reports: Any,
) -> None:
    """Body of one buyer process: connect, buy `warmup` units of the warm-up sale the same
    way, wait for the others, buy until sold out or capped."""
    from inventory.exceptions import Busy

    report = BuyerReport()
    backend_pid = None
    probe = Probe() if profile else None
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
        if contender.name != EVALSHA:
            backend_pid = _backend_pid()
        if warmup:
            # Connections, prepared statements, caches, the writer's backend: warm before the
            # barrier, so that a round measures selling rather than starting up.
            warm_buy = _buyer(contender, warm_sku(contender), worker)
            for _ in range(warmup):
                try:
                    warm_buy()
                except Busy:
                    pass
        buy = _buyer(contender, contender.sku, worker)
        if probe is not None and contender.name != EVALSHA:
            probe.install()
    except BaseException:
        barrier.abort()
        report.error = traceback.format_exc(limit=4)
        reports.put((worker, asdict(report)))
        return

    backend_cpu = process_cpu_seconds(backend_pid) if backend_pid else None
    cpu = time.process_time()
    try:
        barrier.wait(120)  # every buyer is warm: the round's counters are read now
        barrier.wait(120)  # and the round starts
        buy_until_done(buy, report, duration)
    except BaseException:
        report.error = traceback.format_exc(limit=6)
    report.cpu_seconds = time.process_time() - cpu
    if probe is not None:
        report.timings = probe.seconds
    if backend_cpu is not None and backend_pid is not None:
        after = process_cpu_seconds(backend_pid)
        report.backend_cpu_seconds = None if after is None else after - backend_cpu
    reports.put((worker, asdict(report)))
