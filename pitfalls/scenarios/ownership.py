"""Lock scenarios about who owns the lock: a release that deletes another's lock, a retry that
meets its own, a second acquisition by the same holder.

Each runs on a Redis of its own, no database; the interleavings are forced
(`interleaving`). See docs/lab.md#the-scenarios.
"""

from __future__ import annotations

import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.exceptions import LockNotOwnedError
from redis.retry import Retry

from locking import Lock, ReentrantLock
from locking.scripts.handover import TAKE_OR_QUEUE

from .. import naive
from ..proxy import LossyProxy
from .base import Outcome, Recorder, RedisHost, Scenario, Variant
from .interleaving import NAME, TTL, in_thread, sleep_until


class ForeignRelease(Scenario):
    name = "foreign-release"
    measure = "locks released by a non-owner"
    article = "pitfalls"
    warning = "a release that does not check the owner deletes someone else's lock"
    explanation = (
        "A's lock expired mid-work and B holds it now: A's plain DEL deletes B's lock and lets "
        "C in beside B; the shop's release deletes the lock only if it still holds A's token"
    )

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        client = redis_host.client(socket_timeout=5)
        recorder = Recorder()
        start = time.monotonic()
        released_by_others = 0
        ttl_ms = int(TTL * 1000)

        def acquire(who: str, at: float) -> tuple[redis.Redis, Lock | str | None]:
            sleep_until(start, at)
            own = redis_host.client(socket_timeout=5)
            held: Lock | str | None
            if variant == "naive":
                held = naive.spin_acquire(
                    own, NAME, ttl_ms=ttl_ms, wait_seconds=3.0, sleep_seconds=0.005
                )
            else:
                lock = Lock(own, NAME, timeout=TTL)
                held = lock if lock.acquire(blocking_timeout=3.0) else None
            if held is not None:
                recorder.acquired(who)
            return own, held

        def a() -> None:
            nonlocal released_by_others
            own, held = acquire("A", 0.0)
            sleep_until(start, TTL + 0.3)  # works past its TTL: the lock is B's by now
            recorder.released("A")
            if isinstance(held, Lock):
                try:
                    held.release()
                except LockNotOwnedError:
                    recorder.note("A", "release refused", "the lock is not A's any more")
                deleted_other = client.get(NAME) is None
            else:
                # Whose lock the DEL removes is read just before it: B holds it 0.5 s, so it
                # cannot change hands in between, while after the DEL C's spin may have taken it.
                holder = client.get(NAME)
                naive.delete_release(own, NAME)
                deleted_other = holder is not None and holder != (held or "").encode()
            if deleted_other and "B" in recorder.holding():
                released_by_others += 1
                recorder.note("A", "deleted B's lock")

        def b_or_c(who: str, at: float, works: float) -> None:
            own, held = acquire(who, at)
            if held is None:
                return
            time.sleep(works)
            recorder.released(who)
            if isinstance(held, Lock):
                try:
                    held.release()
                except LockNotOwnedError:
                    pass
            else:
                naive.delete_release(own, NAME)

        threads = [
            in_thread(a),
            in_thread(b_or_c, "B", 0.1, 0.5),
            in_thread(b_or_c, "C", TTL + 0.35, 0.05),
        ]
        for thread in threads:
            thread.join(30)
        return recorder.outcome(released_by_others, most_holders=recorder.most_holders)


class GetDelRace(Scenario):
    name = "get-del-race"
    measure = "locks released by a non-owner"
    article = "pitfalls"
    warning = "GET, compare, then DEL: the lock can change hands between the two commands"
    explanation = (
        "A checks the lock is its own, pauses (a GC pause, a slow network) while it expires and "
        "B takes it, then deletes B's lock; the shop's release compares and deletes in one script"
    )

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        client = redis_host.client(socket_timeout=5)
        recorder = Recorder()
        start = time.monotonic()
        released_by_others = 0
        b_holds = threading.Event()

        def pause() -> None:
            sleep_until(start, TTL + 0.2)  # the lock expires during the pause and B takes it

        def a() -> None:
            nonlocal released_by_others
            lock = Lock(client, NAME, timeout=TTL)
            lock.acquire()
            token = lock.local.token.decode()
            recorder.acquired("A")
            time.sleep(TTL / 2)
            recorder.released("A")
            if variant == "naive":
                naive.get_then_delete_release(client, NAME, token, pause)
            else:
                pause()
                try:
                    lock.release()
                except LockNotOwnedError:
                    recorder.note("A", "release refused", "the lock is B's now")
            if b_holds.is_set() and client.get(NAME) is None:
                released_by_others += 1
                recorder.note("A", "deleted B's lock")

        def b() -> None:
            sleep_until(start, 0.05)
            lock = Lock(redis_host.client(socket_timeout=5), NAME, timeout=5.0)
            if lock.acquire(blocking_timeout=3.0):
                recorder.acquired("B")
                b_holds.set()
                sleep_until(start, TTL + 0.6)
                b_holds.clear()
                recorder.released("B")
                try:
                    lock.release()
                except LockNotOwnedError:
                    recorder.note("B", "release refused", "its lock was deleted")

        for thread in [in_thread(a), in_thread(b)]:
            thread.join(30)
        return recorder.outcome(released_by_others, most_holders=recorder.most_holders)


class SetTimeoutSucceeded(Scenario):
    name = "set-timeout-succeeded"
    measure = "checkouts refused"
    article = "own-lock"
    warning = "a SET that timed out on the client may have succeeded: the retry meets its own lock"
    explanation = (
        "the SET's reply is lost: the naive retry finds the lock taken (by itself) and refuses "
        "the checkout until the TTL frees it; the shop's lock reads the key back and finds its "
        "own token"
    )

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        client = redis_host.client(socket_timeout=5)
        recorder = Recorder()
        ttl = 5.0
        # The scripts are loaded first: the lost reply must be the take's, not a NOSCRIPT.
        client.script_load(TAKE_OR_QUEUE)
        with LossyProxy(redis_host.port) as proxy:
            through = redis.Redis(port=proxy.port, socket_timeout=0.25, retry=Retry(NoBackoff(), 0))
            through.ping()
            proxy.drop_next_reply()
            if variant == "naive":
                token = naive.spin_acquire(
                    through, NAME, ttl_ms=int(ttl * 1000), wait_seconds=1.0, sleep_seconds=0.05
                )
                got = token is not None
            else:
                got = Lock(through, NAME, timeout=ttl).acquire(blocking_timeout=1.0)
            dropped = proxy.dropped
            through.close()
        if got:
            recorder.acquired("A", "the checkout goes on")
        else:
            recorder.note("A", "refused", "its own lock stands in its way")
        return recorder.outcome(
            int(not got),
            replies_lost=dropped,
            lock_left_for_seconds=round(client.pttl(NAME) / 1000, 2) if not got else 0,
        )


class ReentrantDeadlock(Scenario):
    name = "reentrant-deadlock"
    measure = "checkouts failed"
    article = "best-practice"
    warning = "a lock that is not reentrant deadlocks on itself when methodA calls methodB"
    explanation = (
        "methodA takes the item's lock and calls methodB, which takes the same lock: it waits "
        "for its own holder until it gives up (forever, without a wait limit); a reentrant lock "
        "counts the second acquisition of the same thread and releases at the last release"
    )

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        client = redis_host.client(socket_timeout=5)
        recorder = Recorder()
        lock_class = ReentrantLock if variant == "fixed" else Lock

        def method_b() -> bool:
            lock = lock_class(client, NAME, timeout=5)
            if not lock.acquire(blocking_timeout=1.0):
                recorder.note("methodB", "refused", "waited 1 s for its own caller's lock")
                return False
            recorder.note("methodB", "acquired", "again, in the same thread")
            lock.release()
            recorder.note("methodB", "released")
            return True

        outer = lock_class(client, NAME, timeout=5)
        outer.acquire()
        recorder.acquired("methodA")
        done = method_b()
        recorder.released("methodA")
        outer.release()
        return recorder.outcome(int(not done), lock_left=client.exists(NAME))
