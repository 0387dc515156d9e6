"""Failure modes of a whole sale: the strategies' own code against a Redis of the run's own and
the database (`manage.py pitfall` runs these in the load-run sandbox, beside the shop's).

A checkout here is the strategy's `take` with the shop's sale statement, as `place_order` runs
it, without the HTTP request around it and without handing the order to the workers: the lab
sells to nobody, its orders stay pending in the sandbox.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connection, connections
from django.test.utils import override_settings

from inventory.breaker import breaker
from inventory.exceptions import Busy, SoldOut
from inventory.models import Item, Order
from inventory.redis_client import REDIS_DOWN_ERRORS
from inventory.sale_statement import SaleRecorder
from inventory.sale_values import Allocation, Sold
from inventory.services import start_sale
from inventory.strategies import get_strategy
from inventory.strategies.base import PreparedWrite, StockStrategy
from inventory.strategies.lua import LuaStrategy

from .. import naive
from .base import Outcome, Recorder, RedisHost, Scenario, Variant


@contextmanager
def _shop_on(redis_host: RedisHost, **settings: object) -> Iterator[None]:
    """The shop's code talks to the run's Redis and forgets, afterwards, that it was ever down.
    `settings` are the shop's, or the lab's seams (shop.lab_settings), for this process."""
    breaker.reset()
    try:
        with override_settings(REDIS_URL=f"redis://127.0.0.1:{redis_host.port}/0", **settings):
            yield
    finally:
        breaker.reset()


def _checkout(strategy: StockStrategy, sku: str, buyer: str) -> Order:
    item = Item.objects.get(sku=sku)
    return strategy.take(item=item, qty=1, record=SaleRecorder(item=item, qty=1, buyer=buyer))


def _crowd(
    strategy: StockStrategy, sku: str, *, buyers: int, attempts: int, recorder: Recorder
) -> int:
    """`buyers` threads check out one unit at a time, each at most `attempts` times, until
    sold out; returns how many checkouts were answered busy."""
    busy = 0
    guard = threading.Lock()

    def buyer(who: str) -> None:
        nonlocal busy
        try:
            for number in range(attempts):
                try:
                    _checkout(strategy, sku, f"{who}-{number}")
                except Busy:
                    with guard:
                        busy += 1
                    continue
                except SoldOut:
                    return
                recorder.note(who, "sold")
        finally:
            connection.close()

    threads = [threading.Thread(target=buyer, args=(f"buyer {n}",)) for n in range(buyers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return busy


def _sku(scenario: str, variant: Variant) -> str:
    return f"pitfall-{scenario}-{variant}-{uuid.uuid4().hex[:8]}"


class LostUpdate(Scenario):
    name = "lost-update"
    measure = "lost updates"
    article = "timeout"
    warning = "read the stock, decide, write it back: concurrent buyers overwrite each other"
    explanation = (
        "8 buyers take 50 units: `unsafe` reads the stock, waits 5 ms and writes back what it "
        "read minus one, so overlapping buyers sell units the stock never goes down by; `lock` "
        "takes the item's lock and a guarded decrement (stock >= qty) in one statement"
    )
    needs_database = True

    STOCK = 50
    BUYERS = 8

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        recorder = Recorder()
        strategy_name = "unsafe" if variant == "naive" else "lock"
        sku = _sku(self.name, variant)
        with _shop_on(redis_host, FLASHSALE_UNSAFE_DELAY_MS=5):
            start_sale(sku=sku, stock=self.STOCK, strategy=strategy_name)
            strategy = get_strategy(strategy_name)
            _crowd(strategy, sku, buyers=self.BUYERS, attempts=self.STOCK, recorder=recorder)
        item = Item.objects.get(sku=sku)
        accepted = Order.objects.filter(item=item).count()
        went_down_by = self.STOCK - item.units_left
        return recorder.outcome(
            accepted - went_down_by,
            strategy=strategy_name,
            stock=self.STOCK,
            accepted=accepted,
            stock_went_down_by=went_down_by,
            sku=sku,
        )


class RedisDown(Scenario):
    name = "redis-down"
    measure = "checkouts failed"
    article = "timeout"
    warning = "when Redis dies mid-sale, a shop that only knows Redis stops selling"
    explanation = (
        "Redis is killed after 10 of 20 checkouts: `lua` alone fails every checkout after it; "
        "the shop's `lua` (wrapped with the database fallback) serves them through `optimistic`"
    )
    needs_database = True

    CHECKOUTS = 20

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        recorder = Recorder()
        sku = _sku(self.name, variant)
        failed = fallback = 0
        with _shop_on(redis_host, FLASHSALE_BREAKER_PROBE_SECONDS=60):
            start_sale(sku=sku, stock=100, strategy="lua")
            strategy = LuaStrategy() if variant == "naive" else get_strategy("lua")
            for number in range(self.CHECKOUTS):
                if number == self.CHECKOUTS // 2:
                    redis_host.kill()
                    recorder.note("redis", "died", "SIGKILL")
                try:
                    order = _checkout(strategy, sku, f"buyer-{number}")
                except REDIS_DOWN_ERRORS as exc:
                    failed += 1
                    recorder.note(f"buyer {number}", "failed", exc.__class__.__name__)
                    continue
                fallback += order.fallback
                recorder.note(
                    f"buyer {number}", "sold", "by the database fallback" if order.fallback else ""
                )
        item = Item.objects.get(sku=sku)
        return recorder.outcome(
            failed,
            checkouts=self.CHECKOUTS,
            sold=Order.objects.filter(item=item).count(),
            served_by_the_fallback=fallback,
            sku=sku,
        )


class TrustTheLock(Scenario):
    name = "trust-the-lock"
    measure = "units oversold"
    article = "timeout"
    warning = "a write that trusts the lock oversells as soon as a lock expires under its holder"
    explanation = (
        "6 buyers take 12 units, each holding the item's lock 80 ms while it lives 25 ms (no "
        "watchdog): holders overlap; writing back the stock read under the lock sells units "
        "twice, the shop's guarded decrement (stock >= qty) refuses them, watchdog or not"
    )
    needs_database = True

    STOCK = 12
    BUYERS = 6

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        recorder = Recorder()
        sku = _sku(self.name, variant)
        with _shop_on(
            redis_host,
            FLASHSALE_LOCK_TTL_MS=25,
            FLASHSALE_HOLD_DELAY_MS=80,
            FLASHSALE_LOCK_WATCHDOG=False,
        ):
            start_sale(sku=sku, stock=self.STOCK, strategy="lock")
            strategy = naive.TrustingLockStrategy() if variant == "naive" else get_strategy("lock")
            busy = _crowd(
                strategy, sku, buyers=self.BUYERS, attempts=10 * self.STOCK, recorder=recorder
            )
        accepted = Order.objects.filter(item__sku=sku).count()
        return recorder.outcome(
            max(0, accepted - self.STOCK),
            stock=self.STOCK,
            accepted=accepted,
            busy=busy,
            sku=sku,
        )


class _BeforeWrite:
    """A checkout's recorder that calls `hook` when the strategy hands it the sale to write:
    the buyer holds the lock then, and has checked it."""

    def __init__(self, record: SaleRecorder, hook: Callable[[], object]) -> None:
        self.record = record
        self.hook = hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self.record, name)

    def __call__(self, allocation: Allocation) -> Sold | None:
        self.hook()
        return self.record(allocation)

    def prepare(self, allocation: Allocation) -> _HookedWrite:
        return _HookedWrite(self.record.prepare(allocation), self.hook)


class _HookedWrite:
    """A prepared write that calls `hook` when it is written."""

    def __init__(self, write: PreparedWrite, hook: Callable[[], object]) -> None:
        self.write = write
        self.hook = hook

    def __enter__(self) -> _HookedWrite:
        self.write.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.write.__exit__(*exc_info)

    def __call__(self, *, fence: int | None = None) -> Sold | None:
        self.hook()
        return self.write(fence=fence)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP), per /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


class StallPastTtl(Scenario):
    name = "stall-past-ttl"
    measure = "stale writes accepted"
    article = "timeout"
    warning = "a holder paused past its TTL (a long GC) loses its lock, watchdog or not"
    explanation = (
        "A holds the item's lock (watchdog on) and is frozen by SIGSTOP right before its write; "
        "the lock expires, B takes it and sells; A wakes and writes: without a fencing token "
        "the write goes through, with the shop's the item row refuses A's older token"
    )
    needs_database = True

    STOCK = 10
    TTL_MS = 400

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        recorder = Recorder()
        sku = _sku(self.name, variant)
        lock_factory = "pitfalls.naive.UnfencedLock" if variant == "naive" else "locking.Lock"
        context = multiprocessing.get_context("fork")
        paused, answers = context.Event(), context.Queue()
        with _shop_on(
            redis_host,
            FLASHSALE_LOCK_TTL_MS=self.TTL_MS,
            FLASHSALE_LOCK_WATCHDOG=True,
            FLASHSALE_LOCK_WAIT_MS=5 * self.TTL_MS,
            FLASHSALE_LOCK_FACTORY=lock_factory,
        ):
            start_sale(sku=sku, stock=self.STOCK, strategy="lock")
            strategy = get_strategy("lock")

            def pause() -> None:
                paused.set()
                os.kill(os.getpid(), signal.SIGSTOP)

            def holder() -> None:
                item = Item.objects.get(sku=sku)
                record = _BeforeWrite(SaleRecorder(item=item, qty=1, buyer="A"), pause)
                try:
                    strategy.take(item=item, qty=1, record=record)
                    answers.put(("stale write accepted", ""))
                except Exception as refused:  # noqa: BLE001 - the parent reports what it was
                    answers.put(("refused", f"{refused.__class__.__name__}: {refused}"))
                finally:
                    connection.close()

            connections.close_all()  # the holder's process opens its own
            process = context.Process(target=holder, daemon=True)
            process.start()
            pid = process.pid
            assert pid is not None  # started
            try:
                if not paused.wait(30):
                    raise RuntimeError("the holder never reached its write")
                recorder.acquired("A", "checked its lock; about to write")
                deadline = time.monotonic() + 10
                while not _stopped(pid):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the holder did not stop")
                    time.sleep(0.001)
                recorder.note("A", "paused", "SIGSTOP: its watchdog thread stops too")
                # B buys: it waits for A's lock, which expires since nobody renews it.
                item = Item.objects.get(sku=sku)
                b_record = SaleRecorder(item=item, qty=1, buyer="B")
                order = strategy.take(
                    item=item,
                    qty=1,
                    record=_BeforeWrite(
                        b_record, lambda: recorder.acquired("B", "A's lock expired under A")
                    ),
                )
                recorder.note("B", "sold", f"order {order.pk}")
                recorder.released("B")
                os.kill(pid, signal.SIGCONT)
                recorder.note("A", "resumed", "SIGCONT: A believes it still holds the lock")
                answer, detail = answers.get(timeout=30)
                recorder.note("A", answer, detail)
                recorder.released("A")
                process.join(30)
            finally:
                if process.is_alive():
                    os.kill(pid, signal.SIGCONT)
                    process.kill()
        item = Item.objects.get(sku=sku)
        return recorder.outcome(
            Order.objects.filter(item__sku=sku, buyer="A").count(),
            lock_ttl_ms=self.TTL_MS,
            a_answer=detail or answer,
            sold=Order.objects.filter(item__sku=sku).count(),
            item_row_fence=item.fence,
            most_holders=recorder.most_holders,
            sku=sku,
        )
