"""Lock scenarios about expiry: a lock that never expires, and one that expires too soon.

Each runs on a Redis of its own, no database; the interleavings are forced
(`interleaving`). See docs/lab.md#the-scenarios.
"""

from __future__ import annotations

import multiprocessing
import time

from redis.exceptions import LockNotOwnedError

from locking import Lock

from .. import naive
from .base import Outcome, Recorder, RedisHost, Scenario, Variant
from .interleaving import NAME, TTL, in_thread, sleep_until


class SetnxExpireGap(Scenario):
    name = "setnx-expire-gap"
    measure = "locks left that never expire"
    article = "setnx-expire"
    warning = "SETNX then EXPIRE: a crash between the two leaves the lock with no expiry"
    explanation = (
        "the holder dies after SETNX and before EXPIRE: nobody can ever take the item's lock "
        "again; SET NX PX sets the lock and its expiry in one command"
    )

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        client = redis_host.client(socket_timeout=5)
        recorder = Recorder()
        context = multiprocessing.get_context("fork")
        holding = context.Event()

        def crash_point() -> None:
            holding.set()
            time.sleep(60)  # the lab kills it here

        def holder() -> None:
            own = redis_host.client(socket_timeout=5)
            if variant == "naive":
                # dies between the two commands
                naive.setnx_then_expire(own, NAME, "A", 1, crash_point)
            else:
                Lock(own, NAME, timeout=TTL).acquire(blocking=False)
                holding.set()
                time.sleep(60)  # dies holding the lock

        process = context.Process(target=holder, daemon=True)
        process.start()
        try:
            if not holding.wait(10):
                raise RuntimeError("the holder did not take the lock")
            recorder.acquired("A", "SETNX" if variant == "naive" else "SET NX PX")
            process.kill()  # SIGKILL
            process.join()
            recorder.note("A", "crashed", "SIGKILL")
        finally:
            if process.is_alive():
                process.kill()
        never_expires = client.pttl(NAME) == -1
        # B wants the item: it waits three TTLs for the lock
        lock = Lock(client, NAME, timeout=TTL)
        waited = time.monotonic()
        got = lock.acquire(blocking_timeout=3 * TTL)
        waited = time.monotonic() - waited
        if got:
            recorder.acquired("B", f"after {waited:.2f} s")
            lock.release()
            recorder.released("B")
        else:
            recorder.note("B", "refused", f"the lock was still held after {waited:.2f} s")
        return recorder.outcome(
            int(never_expires), b_waited_seconds=round(waited, 2), b_got_the_lock=got, ttl=TTL
        )


class ExpiryMidWork(Scenario):
    name = "expiry-mid-work"
    measure = "holders at once beyond one"
    article = "timeout"
    warning = "a lock that expires while its holder still works lets a second buyer in"
    explanation = (
        f"A works 3x its lock's TTL ({TTL:g} s): without renewal B takes the expired lock while "
        "A still works; the watchdog renews it every TTL/3 while A is alive"
    )

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        client = redis_host.client(socket_timeout=5)
        recorder = Recorder()
        watchdog = variant == "fixed"
        start = time.monotonic()

        def a() -> None:
            lock = Lock(client, NAME, timeout=TTL, watchdog=watchdog)
            lock.acquire()
            recorder.acquired("A")
            sleep_until(start, 3 * TTL)  # the work
            recorder.released("A")
            try:
                lock.release()
            except LockNotOwnedError:
                recorder.note("A", "lost", "its lock had expired and was someone else's")

        def b() -> None:
            sleep_until(start, 0.1)
            lock = Lock(redis_host.client(socket_timeout=5), NAME, timeout=TTL, watchdog=watchdog)
            if lock.acquire(blocking_timeout=10 * TTL):
                recorder.acquired("B")
                time.sleep(0.1)
                recorder.released("B")
                lock.release()

        for thread in [in_thread(a), in_thread(b)]:
            thread.join(30)
        return recorder.outcome(recorder.most_holders - 1, most_holders=recorder.most_holders)
