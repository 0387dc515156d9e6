"""Lock scenarios about what waiting costs: waiters that poll, and one lock for a whole item.

Each runs on a Redis of its own, no database; its measure is a cost (lower is better).
See docs/lab.md#the-scenarios.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from locking import Lock, StockCounter

from .. import naive
from .base import Outcome, Recorder, RedisHost, Scenario, Variant
from .interleaving import NAME, in_thread


class _RoundTrips:
    """Round trips to Redis, counted on the clients' side (a script is one, whatever it runs)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def client(self, port: int) -> redis.Redis:
        trips = self

        class Counted(redis.Redis):
            def execute_command(self, *args: Any, **options: Any) -> Any:
                with trips._lock:
                    trips.count += 1
                return super().execute_command(*args, **options)

        return Counted(port=port, socket_timeout=5, retry=Retry(NoBackoff(), 0))


class PollingHerd(Scenario):
    name = "polling-herd"
    kind = "cost"
    measure = "round trips to Redis per acquisition"
    article = "best-practice"
    warning = "waiters that poll with sleep hammer Redis, and still wait longer than they need"
    explanation = (
        "10 buyers take one lock 20 times each (2 ms of work): a waiter polling every millisecond "
        "sends a SET each time; the shop's waiters sleep in BLPOP until the release hands over"
    )

    BUYERS = 10
    ROUNDS = 20

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        recorder = Recorder()
        trips = _RoundTrips()
        waits: list[float] = []
        guard = threading.Lock()

        def buyer(who: str) -> None:
            own = trips.client(redis_host.port)
            own.ping()  # connected before the count matters
            for _ in range(self.ROUNDS):
                asked = time.monotonic()
                release: Callable[[], object]
                if variant == "naive":
                    token = naive.spin_acquire(
                        own, NAME, ttl_ms=5000, wait_seconds=30, sleep_seconds=0.001
                    )
                    release = partial(
                        naive.get_then_delete_release, own, NAME, token or "", lambda: None
                    )
                else:
                    lock = Lock(own, NAME, timeout=5)
                    lock.acquire(blocking_timeout=30)
                    release = lock.release
                with guard:
                    waits.append(time.monotonic() - asked)
                recorder.acquired(who)
                time.sleep(0.002)
                recorder.released(who)
                release()

        start_count = trips.count
        threads = [in_thread(buyer, f"buyer {n}") for n in range(self.BUYERS)]
        for thread in threads:
            thread.join(120)
        acquisitions = len(waits)
        waits.sort()
        return recorder.outcome(
            round((trips.count - start_count - self.BUYERS) / acquisitions, 1),
            round_trips=trips.count - start_count - self.BUYERS,
            acquisitions=acquisitions,
            wait_p50_ms=round(1000 * statistics.median(waits), 1),
            wait_p99_ms=round(1000 * waits[int(0.99 * (len(waits) - 1))], 1),
            most_holders=recorder.most_holders,
        )


class CoarseLock(Scenario):
    name = "coarse-lock"
    kind = "cost"
    measure = "seconds to sell 100 units"
    article = "timeout"
    warning = "one lock per item serialises every sale: work inside it queues all buyers"
    explanation = (
        "10 buyers sell 100 units, 20 ms of work inside the lock each: one item lock sells one "
        "at a time; ten shards, each its own counter and lock (one script picks a free shard "
        "that holds the units and locks it), sell ten at a time"
    )

    BUYERS = 10
    UNITS = 100
    SHARDS = 10
    WORK = 0.02

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        client = redis_host.client(socket_timeout=5)
        recorder = Recorder()
        shards = 1 if variant == "naive" else self.SHARDS
        counters = [f"pitfall:item:42:stock:{index}" for index in range(shards)]
        locks = [f"{NAME}:{index}" for index in range(shards)]
        client.mset({key: self.UNITS // shards for key in counters})
        sold = 0
        guard = threading.Lock()

        def buyer(who: str, number: int) -> None:
            nonlocal sold
            own = redis_host.client(socket_timeout=5)
            counter = StockCounter(own)
            turn = number
            while True:
                token = uuid.uuid4().hex
                row, levels, fence = counter.lock_first_holding(
                    counters, locks, 1, start=turn % shards, token=token, ttl_ms=5000
                )
                turn += 1
                if row is None or (row == -1 and not any(levels)):
                    return  # sold out
                if row == -1:
                    # every shard that holds a unit is busy: wait for one, as a buyer would
                    lock = Lock(own, locks[turn % shards], timeout=5)
                    if not lock.acquire(blocking_timeout=5):
                        continue
                    row = turn % shards
                else:
                    lock = Lock(own, locks[row], timeout=5)
                    lock.adopt(token, fence)
                recorder.acquired(who, f"shard {row}")
                if counter.take(counters[row], 1) >= 0:
                    time.sleep(self.WORK)  # the work the lock guards
                    with guard:
                        sold += 1
                recorder.released(who)
                lock.release()

        started = time.monotonic()
        threads = [in_thread(buyer, f"buyer {n}", n) for n in range(self.BUYERS)]
        for thread in threads:
            thread.join(120)
        seconds = time.monotonic() - started
        return recorder.outcome(
            round(seconds, 2),
            units_sold=sold,
            shards=shards,
            most_at_once=recorder.most_holders,
            left=sum(level or 0 for level in StockCounter(client).get_many(counters)),
        )
