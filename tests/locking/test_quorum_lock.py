"""`locking.QuorumLock` on three real, independent redis-server processes: mutual exclusion under
contention, one master killed (the lock goes on), two killed (no quorum: a connection error,
never a grant), a master restarted empty under a holder, the watchdog, the fence source."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from locking import ProcessFences, QuorumLock
from shop.processes.redis_server import RedisServer


@pytest.fixture(scope="module")
def masters():
    servers = [RedisServer().start() for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def clients(masters):
    for server in masters:
        server.start()  # a test may have killed one
    made = [server.client(socket_timeout=0.3) for server in masters]
    for client in made:
        client.flushall()
    yield made
    for client in made:
        client.close()


def test_held_on_every_master_while_held_and_nowhere_after(clients):
    fences = ProcessFences()
    lock = QuorumLock(clients, "q:basic", timeout=5, fence_source=fences)
    assert lock.acquire()
    assert [client.get("q:basic") for client in clients] == [lock.local.token] * 3
    assert lock.owned() and lock.locked() and lock.fence == 1
    lock.release()
    assert [client.exists("q:basic") for client in clients] == [0, 0, 0]
    assert lock.acquire() and lock.fence == 2
    lock.release()


def test_a_second_contender_is_refused_while_it_is_held(clients):
    holder = QuorumLock(clients, "q:busy", timeout=5)
    other = QuorumLock(clients, "q:busy", timeout=5, retry_delay=0.01)
    assert holder.acquire()
    assert not other.acquire(blocking=False)
    assert not other.acquire(blocking_timeout=0.2)
    # and the loser left nothing behind: the holder's token is the only one anywhere
    assert [client.get("q:busy") for client in clients] == [holder.local.token] * 3
    holder.release()
    assert other.acquire(blocking=False)
    other.release()


def test_a_fence_source_that_fails_leaves_nothing_held(clients):
    def broken(name: str) -> int:
        raise RuntimeError("sequence unavailable")

    lock = QuorumLock(clients, "q:fence-fails", timeout=5, fence_source=broken)
    with pytest.raises(RuntimeError, match="sequence unavailable"):
        lock.acquire()
    assert [client.exists("q:fence-fails") for client in clients] == [0, 0, 0]
    assert not lock.owned()


def _contend(clients, name: str, threads: int = 6, cycles: int = 30) -> tuple[int, int, list]:
    """`threads` threads each take the lock `cycles` times around a read-sleep-write of a
    shared count; returns (the count, the most holders at once, the fences in grant order)."""
    fences = ProcessFences()
    state = {"count": 0, "inside": 0, "most": 0}
    granted: list[int] = []
    guard = threading.Lock()

    def work() -> None:
        lock = QuorumLock(clients, name, timeout=5, blocking_timeout=30, fence_source=fences)
        for _ in range(cycles):
            assert lock.acquire()
            with guard:
                state["inside"] += 1
                state["most"] = max(state["most"], state["inside"])
                granted.append(lock.fence)
            seen = state["count"]
            time.sleep(0.0005)  # a gap between read and write, for a second holder to fall in
            state["count"] = seen + 1
            with guard:
                state["inside"] -= 1
            lock.release()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    return state["count"], state["most"], granted


def test_contending_threads_never_hold_it_together(clients):
    for round_number in range(3):
        count, most, granted = _contend(clients, f"q:contend:{round_number}")
        assert (count, most) == (180, 1)
        assert granted == sorted(granted) and len(set(granted)) == 180


def test_with_one_master_killed_the_lock_goes_on(clients, masters):
    masters[0].kill()
    count, most, _ = _contend(clients, "q:one-down")
    assert (count, most) == (180, 1)


def test_with_two_masters_killed_no_one_is_granted_the_lock(clients, masters):
    lost = []
    holder = QuorumLock(clients, "q:two-down", timeout=0.6, watchdog=True, on_lost=lost.append)
    assert holder.acquire()
    masters[0].kill()
    masters[1].kill()
    # a newcomer is told the lock service is down, never granted the lock
    newcomer = QuorumLock(clients, "q:two-down", timeout=5)
    with pytest.raises(redis.exceptions.ConnectionError, match="1 of 3 masters answered"):
        newcomer.acquire(blocking_timeout=0.5)
    assert newcomer.local.token is None
    # and the holder's watchdog finds it can no longer renew on a majority
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == [holder] and holder.lost and not holder.owned()


def test_a_master_restarted_empty_under_a_holder_grants_no_second_holder(clients, masters):
    holder = QuorumLock(clients, "q:restart", timeout=5)
    assert holder.acquire()
    masters[0].restart()  # empty: it forgot the holder
    other = QuorumLock(clients, "q:restart", timeout=5, retry_delay=0.01)
    assert not other.acquire(blocking_timeout=0.3)  # it may win master 0 alone: no quorum
    assert holder.owned()
    holder.release()


def test_the_watchdog_keeps_it_past_its_ttl_and_reports_it_lost(clients):
    lost = []
    holder = QuorumLock(clients, "q:watchdog", timeout=0.3, watchdog=True, on_lost=lost.append)
    assert holder.acquire()
    other = QuorumLock(clients, "q:watchdog", timeout=0.3, retry_delay=0.01)
    assert not other.acquire(blocking_timeout=1.0)  # three TTLs: renewed throughout
    assert holder.owned() and not lost
    for client in clients[:2]:
        client.delete("q:watchdog")  # behind its back, on a majority
    deadline = time.monotonic() + 3
    while not lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lost == [holder] and holder.lost


def test_a_round_longer_than_the_ttl_grants_nothing(clients, masters):
    # Given a master that answers nothing (paused) and a TTL shorter than its socket timeout
    masters[2].pause()
    try:
        slow = QuorumLock(clients, "q:slow", timeout=0.2)
        # When the round waits 0.3 s on it, the two yeses come too late to hold the lock
        assert not slow.acquire(blocking=False)
    finally:
        masters[2].resume()
    # Then nothing is left held: deleted where the masters answered, and on the paused one
    # (which runs the queued SET once resumed) set with its TTL, and gone once it ran out
    assert [client.exists("q:slow") for client in clients[:2]] == [0, 0]
    left_ms = clients[2].pttl("q:slow")
    assert left_ms == -2 or 0 < left_ms <= 200, left_ms  # -2: no such key
    deadline = time.monotonic() + 5
    while clients[2].exists("q:slow") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [client.exists("q:slow") for client in clients] == [0, 0, 0]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"clients": [], "timeout": 1}, "at least one master"),
        ({"timeout": None}, "positive timeout"),
        ({"timeout": 0}, "positive timeout"),
        ({"timeout": 1, "drift_factor": 2}, "drift_factor"),
    ],
)
def test_bad_arguments_are_refused(clients, arguments, message):
    arguments = {"clients": clients, **arguments}
    with pytest.raises(ValueError, match=message):
        QuorumLock(name="q:bad", **arguments)
