"""Lock waiters that share one wake-up channel per process (locking.wakes): connections that do
not grow with the waiters, a holder that always finds one to release, FIFO kept, a hub whose
connection is killed, a forked child with a hub of its own.

Against the shared Redis ($REDIS_URL) under a per-test key prefix; each client is named so
that CLIENT LIST tells its connections from everyone else's.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid

import redis

from locking import Lock, WakeHubLock
from locking.wakes import hub_for
from tests.support import redis_url, run_in_thread


def _bounded_client(name: str, connections: int) -> redis.Redis:
    """A client whose pool never opens more than `connections` connections, and waits at most
    a second for a free one (then raises ConnectionError)."""
    pool = redis.BlockingConnectionPool.from_url(
        redis_url(), max_connections=connections, timeout=1.0, client_name=name
    )
    return redis.Redis(connection_pool=pool)


def _connections(r: redis.Redis, name: str) -> list[dict]:
    return [entry for entry in r.client_list() if entry.get("name") == name]


def _hub_blocked(r: redis.Redis, name: str) -> bool:
    """Whether one of the connections named `name` (the hub's) is blocked in BLPOP."""
    return any(entry["cmd"] == "blpop" for entry in _connections(r, name))


def _queue(r: redis.Redis, name: str) -> list[bytes]:
    return r.lrange(f"{name}:queue", 0, -1)


def _wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _queue_waiters(
    client: redis.Redis, r: redis.Redis, name: str, count: int, hub: str | None
) -> tuple[list[bytes], list[tuple[threading.Thread, dict]], list[bytes]]:
    """`count` threads queued for the lock `name` (each with a token of its own); returns the
    tokens, the threads, and the order in which each got the lock, filled as they do."""
    tokens = [uuid.uuid4().hex.encode() for _ in range(count)]
    granted: list[bytes] = []

    def wait(token: bytes) -> bool:
        lock = WakeHubLock(client, name, timeout=30, hub_prefix=hub)
        if not lock.acquire(blocking_timeout=60, token=token):
            return False
        granted.append(token)
        lock.release()
        return True

    threads = [run_in_thread(lambda token=token: wait(token)) for token in tokens]
    assert _wait_until(lambda: len(_queue(r, name)) == count), len(_queue(r, name))
    return tokens, threads, granted


def test_a_thousand_waiters_share_the_pools_connections_and_get_the_lock_in_turn(
    r: redis.Redis, prefix: str
) -> None:
    # Given a process whose pool opens at most 4 connections, and a lock held
    client_name = f"hub-{uuid.uuid4().hex[:8]}"
    client = _bounded_client(client_name, 4)
    name, hub = prefix + "crowded", prefix + "wakes"
    holder = WakeHubLock(client, name, timeout=30, hub_prefix=hub)
    assert holder.acquire()
    try:
        # When a thousand threads of it queue for the lock
        _, threads, granted = _queue_waiters(client, r, name, 1000, hub)
        queued = _queue(r, name)
        # all of them queued, waiting through the hub
        assert _wait_until(lambda: _hub_blocked(r, client_name), 10)
        connections = _connections(r, client_name)
        # and the holder lets go (it must find a connection to do so)
        holder.release()
        for thread, _ in threads:
            thread.join(60)
    finally:
        hub_for(client, hub).close()
        client.close()

    # Then the process held the pool's connections and the hub's one, no more, while they
    # waited; one of them blocked for all the waiters
    assert len(connections) <= 5, connections
    assert [entry["cmd"] for entry in connections].count("blpop") == 1, connections
    # and every waiter got the lock, in the order they queued
    assert [outcome.get("result") for _, outcome in threads] == [True] * 1000
    assert granted == queued
    assert r.exists(name, f"{name}:queue", f"{name}:waiters") == 0
    assert list(r.scan_iter(match=f"{hub}:*")) == []


def test_the_holder_of_a_two_connection_pool_releases_at_once_past_its_waiters(
    r: redis.Redis, prefix: str
) -> None:
    """What a waiter blocking on a connection of its own does to a pool of two: both waiters
    hold both connections, and the holder's release waits for one (or fails after the pool's
    1 s). Through the hub, the waiters hold none while they wait."""
    client_name = f"hub-{uuid.uuid4().hex[:8]}"
    client = _bounded_client(client_name, 2)
    name, hub = prefix + "two", prefix + "wakes"
    holder = WakeHubLock(client, name, timeout=30, hub_prefix=hub)
    assert holder.acquire()
    try:
        _, threads, granted = _queue_waiters(client, r, name, 2, hub)
        assert _wait_until(lambda: _hub_blocked(r, client_name), 10)  # both waiting through it
        holder.release()  # raises ConnectionError if no connection comes within 1 s
        for thread, _ in threads:
            thread.join(30)
    finally:
        hub_for(client, hub).close()
        client.close()
    assert [outcome.get("result") for _, outcome in threads] == [True, True]
    assert len(granted) == 2


def test_waiters_get_the_lock_when_the_hubs_connection_is_killed(
    r: redis.Redis, prefix: str
) -> None:
    # Given five waiters of a process, waiting through its hub
    client_name = f"hub-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url(), client_name=client_name)
    name, hub = prefix + "killed", prefix + "wakes"
    holder = WakeHubLock(client, name, timeout=30, hub_prefix=hub)
    assert holder.acquire()
    try:
        _, threads, granted = _queue_waiters(client, r, name, 5, hub)
        queued = _queue(r, name)
        # When the hub's connection is killed while they wait, and the holder lets go
        assert _wait_until(lambda: _hub_blocked(r, client_name), 10)
        blocked = [e for e in _connections(r, client_name) if e["cmd"] == "blpop"]
        assert len(blocked) == 1
        r.execute_command("CLIENT", "KILL", "ID", blocked[0]["id"])
        holder.release()
        for thread, _ in threads:
            thread.join(30)
    finally:
        hub_for(client, hub).close()
        client.close()
    # Then every one of them got the lock all the same, in turn
    assert [outcome.get("result") for _, outcome in threads] == [True] * 5
    assert granted == queued


def _wait_in_child(client: redis.Redis, name: str, hub: str, results) -> None:
    lock = WakeHubLock(client, name, timeout=30, hub_prefix=hub)
    got = lock.acquire(blocking_timeout=20)
    results.put((got, hub_for(client, hub).delivered))
    if got:
        lock.release()


def test_a_forked_child_waits_through_a_hub_of_its_own(r: redis.Redis, prefix: str) -> None:
    # Given a parent whose hub is running (it has waited through it once)
    client = redis.Redis.from_url(redis_url())
    name, hub = prefix + "forked", prefix + "wakes"
    holder = Lock(client, name, timeout=30)
    assert holder.acquire()
    waiter = WakeHubLock(client, name, timeout=30, thread_local=False, hub_prefix=hub)
    thread, outcome = run_in_thread(lambda: waiter.acquire(blocking_timeout=10))
    assert _wait_until(lambda: len(_queue(r, name)) == 1)
    holder.release()
    thread.join(10)
    assert outcome.get("result") is True
    parent_hub = hub_for(client, hub)
    try:
        # When a forked child queues for the lock the parent holds, with the same client
        ctx = multiprocessing.get_context("fork")
        results = ctx.Queue()
        child = ctx.Process(target=_wait_in_child, args=(client, name, hub, results))
        child.start()
        assert _wait_until(lambda: len(_queue(r, name)) == 1)
        waiter.release()
        got, delivered = results.get(timeout=20)
        child.join(10)
    finally:
        parent_hub.close()
        client.close()
    # Then a hub of its own (not the parent's, whose thread the fork left behind) woke it
    assert got is True and delivered == 1
    assert parent_hub.delivered == 1
