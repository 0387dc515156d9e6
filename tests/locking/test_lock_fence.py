"""The lock's fencing token: every grant of a lock name gets a larger one than every grant
before it, however the lock was granted (taken free, handed over, read back after a lost reply,
kept by a waiter that gave up), across Lock objects, threads and a Redis restarted empty."""

from __future__ import annotations

import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from locking import Lock, ReentrantLock
from pitfalls.proxy import LossyProxy
from shop.processes.redis_server import RedisServer


def test_each_grant_of_a_name_gets_a_larger_fence_than_the_last(
    r: redis.Redis, prefix: str
) -> None:
    name = prefix + "fenced"
    fences = []
    for blocking in (True, False, True, False):
        lock = Lock(r, name, timeout=5)
        assert lock.fence is None  # nothing held, no fence
        assert lock.acquire(blocking=blocking)
        fences.append(lock.fence)
        lock.release()
        assert lock.fence is None
    assert all(isinstance(fence, int) and fence > 0 for fence in fences)
    assert fences == sorted(set(fences))  # strictly growing
    # another name's grants have a sequence of their own, interleaved or not
    other = Lock(r, prefix + "other", timeout=5)
    assert other.acquire()
    assert other.fence and other.fence > fences[-1]  # (both follow the server's clock)
    other.release()


def test_a_waiter_handed_the_lock_gets_a_fence_larger_than_its_holders(
    r: redis.Redis, prefix: str
) -> None:
    name = prefix + "handed"
    holder = Lock(r, name, timeout=5)
    assert holder.acquire()
    held_fence = holder.fence
    waiters = [Lock(r, name, timeout=5, thread_local=False) for _ in range(3)]
    got: list[int | None] = []

    def wait(lock: Lock) -> None:
        assert lock.acquire(blocking_timeout=10)
        got.append(lock.fence)  # in hand-over order: each after the previous released
        lock.release()

    threads = []
    for lock in waiters:
        threads.append(threading.Thread(target=wait, args=(lock,)))
        threads[-1].start()
        while r.llen(name + ":queue") < len(threads):  # queued in this order
            pass
    holder.release()
    for thread in threads:
        thread.join(10)
    assert len(got) == 3 and held_fence is not None
    assert [held_fence, *got] == sorted(set([held_fence, *got]))


def test_a_take_whose_reply_was_lost_reads_its_fence_back(r: redis.Redis, prefix: str) -> None:
    with RedisServer() as server:
        direct = server.client()
        before = Lock(direct, "item", timeout=5)
        assert before.acquire()
        earlier = before.fence
        before.release()
        with LossyProxy(server.port) as proxy:
            through = redis.Redis(port=proxy.port, socket_timeout=0.25, retry=Retry(NoBackoff(), 0))
            through.ping()
            # loaded first, so that the lost reply is the take's own
            lock = Lock(through, "item", timeout=5)
            lock.acquire(blocking=False)
            lock.release()
            proxy.drop_next_reply()
            assert lock.acquire(blocking_timeout=2)
            assert proxy.dropped == 1
            assert lock.fence == int(direct.get("item:fence"))
            assert earlier is not None and lock.fence > earlier
            lock.release()
            through.close()


def test_a_reentrant_acquisition_keeps_the_first_ones_fence(r: redis.Redis, prefix: str) -> None:
    outer = ReentrantLock(r, prefix + "again", timeout=5)
    assert outer.acquire()
    inner = ReentrantLock(r, prefix + "again", timeout=5)
    assert inner.acquire()  # methodA -> methodB: the same grant
    assert inner.fence == outer.fence is not None
    inner.release()
    outer.release()


def test_fences_go_on_growing_after_redis_restarted_empty() -> None:
    with RedisServer() as server:
        lock = Lock(server.client(), "item", timeout=5)
        assert lock.acquire()
        before_restart = lock.fence
        lock.release()
        server.restart()  # no persistence: the fence key is gone with everything else
        client = server.client()
        assert client.exists("item:fence") == 0
        lock = Lock(client, "item", timeout=5)
        assert lock.acquire()
        assert before_restart is not None and lock.fence and lock.fence > before_restart
        lock.release()


def test_the_watchdog_tells_its_listeners_of_each_renewal_and_of_the_loss(
    r: redis.Redis, prefix: str
) -> None:
    from locking import watchdog

    heard: list[tuple[str, bool]] = []

    def listener(lock: Lock, renewed: bool) -> None:
        heard.append((lock.name, renewed))

    watchdog.listeners.append(listener)
    try:
        name = prefix + "watched"
        lock = Lock(r, name, timeout=0.3, watchdog=True)
        assert lock.acquire()
        deadline = time.monotonic() + 5
        while (name, True) not in heard and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (name, True) in heard  # renewed every TTL/3 while held
        r.delete(name)  # the lock slips away (an expiry, a failover)
        while (name, False) not in heard and time.monotonic() < deadline:
            time.sleep(0.01)
        assert heard[-1] == (name, False) and lock.lost
    finally:
        watchdog.listeners.remove(listener)
