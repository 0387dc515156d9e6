"""The lock's own failure modes: each on a Redis of its own, no database.

Every timing below is a forced interleaving, with margins of hundreds of milliseconds: a
holder works past its lock's TTL on purpose, a waiter arrives while the lock is held, a pause
sits between two commands that should have been one. The damage therefore happens (or is
prevented) the same way on every run, on a busy machine too.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import LockNotOwnedError
from redis.retry import Retry

from locking import Lock, ProcessFences, QuorumLock, StockCounter
from locking.scripts.handover import TAKE_OR_QUEUE
from shop.processes.redis_server import RedisServer

from .. import naive
from ..proxy import LossyProxy
from .base import Outcome, Recorder, RedisHost, Scenario, Variant

NAME = "pitfall:item:42:lock"
#: The lock's TTL in the scenarios where it expires: short, so that a run takes a second or
#: two, long enough that a busy machine's scheduling delays (tens of ms) change nothing.
TTL = 0.5


def _in_thread(target, *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _at(start: float, seconds: float) -> None:
    """Sleep until `seconds` after `start` (monotonic)."""
    time.sleep(max(0.0, start + seconds - time.monotonic()))


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
            _at(start, 3 * TTL)  # the work
            recorder.released("A")
            try:
                lock.release()
            except LockNotOwnedError:
                recorder.note("A", "lost", "its lock had expired and was someone else's")

        def b() -> None:
            _at(start, 0.1)
            lock = Lock(redis_host.client(socket_timeout=5), NAME, timeout=TTL, watchdog=watchdog)
            if lock.acquire(blocking_timeout=10 * TTL):
                recorder.acquired("B")
                time.sleep(0.1)
                recorder.released("B")
                lock.release()

        for thread in [_in_thread(a), _in_thread(b)]:
            thread.join(30)
        return recorder.outcome(recorder.most_holders - 1, most_holders=recorder.most_holders)


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
            _at(start, at)
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
            _at(start, TTL + 0.3)  # works past its TTL: the lock is B's by now
            recorder.released("A")
            if isinstance(held, Lock):
                try:
                    held.release()
                except LockNotOwnedError:
                    recorder.note("A", "release refused", "the lock is not A's any more")
            else:
                naive.delete_release(own, NAME)
            if client.get(NAME) is None and "B" in recorder.holding():
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
            _in_thread(a),
            _in_thread(b_or_c, "B", 0.1, 0.5),
            _in_thread(b_or_c, "C", TTL + 0.35, 0.05),
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
            _at(start, TTL + 0.2)  # the lock expires during the pause and B takes it

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
            _at(start, 0.05)
            lock = Lock(redis_host.client(socket_timeout=5), NAME, timeout=5.0)
            if lock.acquire(blocking_timeout=3.0):
                recorder.acquired("B")
                b_holds.set()
                _at(start, TTL + 0.6)
                b_holds.clear()
                recorder.released("B")
                try:
                    lock.release()
                except LockNotOwnedError:
                    recorder.note("B", "release refused", "its lock was deleted")

        for thread in [_in_thread(a), _in_thread(b)]:
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
        threads = [_in_thread(buyer, f"buyer {n}") for n in range(self.BUYERS)]
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
        threads = [_in_thread(buyer, f"buyer {n}", n) for n in range(self.BUYERS)]
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


def _replica_of(port: int) -> RedisServer:
    """A replica of the Redis at `port`, started and synchronised."""
    replica = RedisServer(args=["--replicaof", "127.0.0.1", str(port)]).start()
    client = replica.client(socket_timeout=5)
    deadline = time.monotonic() + 10
    while client.info("replication").get("master_link_status") != "up":
        if time.monotonic() > deadline:
            replica.stop()
            raise RuntimeError("the replica did not synchronise within 10 s")
        time.sleep(0.02)
    return replica


def _holding(clients: list[redis.Redis], token: bytes | None) -> int:
    """How many of the masters hold the lock with `token` (none when there is no token)."""
    if token is None:
        return 0
    return sum(client.get(NAME) == token for client in clients)


class FailoverLosesLock(Scenario):
    name = "failover-loses-lock"
    measure = "holders at once beyond one"
    article = "setnx-expire"
    warning = "a lock the primary granted and never replicated is granted again by the replica"
    explanation = (
        "the link to the replica is cut, A takes the lock on the primary, the primary dies, the "
        "replica is promoted and grants the lock to B: two holders. The shop's two fixes, one "
        "after the other: an acquire that WAITs for the replica does not count a lock only the "
        "primary holds (A is refused, B alone holds); a quorum lock on three independent "
        "masters, the first failing over the same way, still finds A's lock on the other two "
        "(B is refused until A releases)"
    )

    #: The quorum lock's masters, how long B keeps asking them while A holds the lock, and how
    #: long B works once it holds it.
    MASTERS = 3
    B_ASKS = 0.3
    WORK = 0.1

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        recorder = Recorder()
        replicas = 0 if variant == "naive" else 1
        holders, replicated_while_up = self._one_primary(redis_host, recorder, replicas)
        details: dict[str, Any] = {"acquire_with_the_replica_up": replicated_while_up}
        if variant == "fixed":
            details["most_holders_waiting_for_the_replica"] = holders
            details |= self._quorum(recorder)
        return recorder.outcome(
            recorder.most_holders - 1, most_holders=recorder.most_holders, **details
        )

    def _one_primary(
        self, redis_host: RedisHost, recorder: Recorder, replicas: int
    ) -> tuple[int, bool]:
        """`Lock(replicas=...)` on `redis_host`, the primary, and a replica behind a cut link:
        (how many held the lock at once after B asked for it, whether an acquire was granted
        while the link was up)."""
        with LossyProxy(redis_host.port) as link:
            replica = _replica_of(link.port)  # it replicates through the proxy
            try:
                primary = redis_host.client(socket_timeout=5)
                promoted = replica.client(socket_timeout=5)
                # With the replica in step, the WAITed acquire takes the lock as usual.
                check = Lock(primary, f"{NAME}:check", timeout=5, replicas=replicas)
                replicated_while_up = check.acquire(blocking=False)
                if replicated_while_up:
                    check.release()
                link.cut()  # a partition: the replica hears nothing from now on
                recorder.note("replica", "cut off")
                a = Lock(primary, NAME, timeout=5, replicas=replicas, replica_timeout=0.2)
                if a.acquire(blocking=False):
                    recorder.acquired("A", "on the primary")
                else:
                    recorder.note("A", "refused", "no replica acknowledged the lock")
                redis_host.kill()
                recorder.note("primary", "died", "SIGKILL")
                promoted.replicaof("NO", "ONE")
                recorder.note("replica", "promoted")
                b = Lock(promoted, NAME, timeout=5)
                if not b.acquire(blocking_timeout=2):
                    return len(recorder.holding()), replicated_while_up
                recorder.acquired("B", "on the promoted replica")
                holders = len(recorder.holding())
                time.sleep(self.WORK)
                recorder.released("B")
                b.release()
                return holders, replicated_while_up
            finally:
                replica.stop()

    def _quorum(self, recorder: Recorder) -> dict[str, Any]:
        """`QuorumLock` on MASTERS masters of the run's own; the first replicates to a replica
        behind a cut link, dies after granting A's lock, and its replica takes its place."""
        fences = ProcessFences()
        with contextlib.ExitStack() as servers:
            masters = [servers.enter_context(RedisServer()) for _ in range(self.MASTERS)]
            link = servers.enter_context(LossyProxy(masters[0].port))
            replica = _replica_of(link.port)
            servers.callback(replica.stop)
            clients = [master.client(socket_timeout=0.5) for master in masters]
            link.cut()
            recorder.note(
                "replica 1", "cut off", f"from master 1, one of {self.MASTERS} independent masters"
            )
            a = QuorumLock(clients, NAME, timeout=5, fence_source=fences)
            a_holds = a.acquire(blocking=False)
            if a_holds:
                granted = _holding(clients, a.local.token)
                recorder.acquired("A", f"on {granted} of {self.MASTERS} masters, fence {a.fence}")
            else:
                recorder.note("A", "refused", "no majority of the masters granted the lock")
            masters[0].kill()
            recorder.note("master 1", "died", "SIGKILL")
            promoted = replica.client(socket_timeout=0.5)
            promoted.replicaof("NO", "ONE")
            recorder.note("replica 1", "promoted", "in master 1's place, without A's lock")
            clients[0] = promoted
            holding_a = _holding(clients, a.local.token)
            b = QuorumLock(clients, NAME, timeout=5, fence_source=fences, retry_delay=0.05)
            b_holds = b.acquire(blocking_timeout=self.B_ASKS)
            if b_holds:
                recorder.acquired("B", f"on a majority of the masters, fence {b.fence}")
            else:
                recorder.note(
                    "B",
                    "refused",
                    f"for {self.B_ASKS:g} s: A's lock is on {holding_a} of {self.MASTERS} masters",
                )
            holders = len(recorder.holding())
            handed_out = [a.fence]
            if a_holds:
                recorder.released("A")
                a.release()  # master 1 is gone: the others delete it
            granted_once_a_released = False
            if not b_holds:
                granted_once_a_released = b_holds = b.acquire(blocking=False)
                if b_holds:
                    recorder.acquired("B", f"once A released, fence {b.fence}")
            handed_out.append(b.fence)
            if b_holds:
                time.sleep(self.WORK)
                recorder.released("B")
                b.release()
        return {
            "most_holders_on_the_quorum": holders,
            "masters_holding_a_after_the_failover": holding_a,
            "b_granted_once_a_released": granted_once_a_released,
            "quorum_fences": handed_out,
        }


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
        reentrant = variant == "fixed"

        def method_b() -> bool:
            lock = Lock(client, NAME, timeout=5, reentrant=reentrant)
            if not lock.acquire(blocking_timeout=1.0):
                recorder.note("methodB", "refused", "waited 1 s for its own caller's lock")
                return False
            recorder.note("methodB", "acquired", "again, in the same thread")
            lock.release()
            recorder.note("methodB", "released")
            return True

        outer = Lock(client, NAME, timeout=5, reentrant=reentrant)
        outer.acquire()
        recorder.acquired("methodA")
        done = method_b()
        recorder.released("methodA")
        outer.release()
        return recorder.outcome(int(not done), lock_left=client.exists(NAME))
