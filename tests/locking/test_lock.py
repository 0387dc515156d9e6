"""Behaviour of locking.Lock (and of the RedisServer test helper it relies on).

Most tests run against the shared Redis ($REDIS_URL, else 127.0.0.1:6379/0) under a
uuid key prefix that is deleted afterwards. Tests that kill, pause or slow Redis down
run against a private redis-server (shop.processes.redis_server.RedisServer).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.lock
from redis.backoff import NoBackoff
from redis.exceptions import LockError, LockNotOwnedError
from redis.retry import Retry

import locking
from locking import Lock, LockCore, scripts, watchdog
from locking.scripts.handover import HAND_OVER
from shop.processes.redis_server import RedisServer
from tests.conftest import wait_until
from tests.support import gather_from_processes, redis_url, run_in_thread

REPO_ROOT = Path(__file__).resolve().parents[2]


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def _private_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def server(_private_server: RedisServer) -> Iterator[RedisServer]:
    """The module's private server, running, awake and empty at the start of each test."""
    if not _private_server.running:
        _private_server.start()
    yield _private_server
    if _private_server.running:
        _private_server.resume()
        admin = _private_server.client()
        admin.flushall()  # our own throwaway server, not the shared one
        admin.close()


class TakeSpyRedis(redis.Redis):
    """A client that records when a command that may take the lock times out on the client
    side: the SET of a non-blocking acquire or the take-or-queue script (EVALSHA) of a
    blocking one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.take_timeouts = 0
        self.take_timed_out = threading.Event()

    def _spied(self, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except redis.exceptions.TimeoutError:
            self.take_timeouts += 1
            self.take_timed_out.set()
            raise

    def set(self, *args, **kwargs):  # type: ignore[override]
        return self._spied(super().set, *args, **kwargs)

    def evalsha(self, *args, **kwargs):  # type: ignore[override]
        return self._spied(super().evalsha, *args, **kwargs)


def no_retry_client(server: RedisServer, cls: type[redis.Redis] = redis.Redis, **kwargs):
    """A client that surfaces timeouts at once instead of retrying them."""
    kwargs.setdefault("retry", Retry(NoBackoff(), 0))
    return cls(host="127.0.0.1", port=server.port, **kwargs)


def watchdog_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"lock-watchdog:{name}" and t.is_alive()]


# -- API mirrors redis-py --------------------------------------------------------------


def test_exceptions_are_redis_pys_own() -> None:
    assert locking.LockError is redis.exceptions.LockError
    assert locking.LockNotOwnedError is redis.exceptions.LockNotOwnedError


@pytest.mark.parametrize(
    "lock_cls", [redis.lock.Lock, LockCore, Lock], ids=["redis-py", "locking-core", "locking"]
)
def test_lock_contract(lock_cls, r: redis.Redis, prefix: str) -> None:
    """One body, every implementation: code written for redis-py's lock works with ours, and
    with our lock's core alone (which polls every `sleep`, as redis-py's does)."""
    name = prefix + "contract"
    lock = lock_cls(r, name, timeout=5)
    assert not lock.locked()
    assert not lock.owned()

    assert lock.acquire(blocking=False) is True
    assert lock.locked()
    assert lock.owned()
    assert 4000 < r.pttl(name) <= 5000
    token = r.get(name)
    assert isinstance(token, bytes) and len(token) == 32

    other = lock_cls(r, name, timeout=5)
    assert other.locked()
    assert not other.owned()
    assert other.acquire(blocking=False) is False
    assert other.acquire(blocking_timeout=0.2, sleep=0.05) is False
    with pytest.raises(LockError):
        other.release()  # never acquired
    assert r.get(name) == token

    assert lock.extend(10) is True
    assert 14000 < r.pttl(name) <= 15000
    assert lock.extend(2, replace_ttl=True) is True
    assert 1000 < r.pttl(name) <= 2000
    assert lock.reacquire() is True
    assert 4000 < r.pttl(name) <= 5000

    lock.release()
    assert not lock.locked()
    assert not lock.owned()
    assert r.exists(name) == 0
    with pytest.raises(LockError):
        lock.release()
    with pytest.raises(LockError):
        lock.extend(1)
    with pytest.raises(LockError):
        lock.reacquire()

    # A caller-supplied token is the stored value.
    assert lock.acquire(token="my-token") is True
    assert r.get(name) == b"my-token"
    assert lock.owned()

    # Someone else now holds it: nothing of ours may touch their lock.
    r.set(name, b"foreign", px=5000)
    assert not lock.owned()
    with pytest.raises(LockNotOwnedError):
        lock.extend(1)
    with pytest.raises(LockNotOwnedError):
        lock.reacquire()
    with pytest.raises(LockNotOwnedError):
        lock.release()
    assert r.get(name) == b"foreign"
    assert 4000 < r.pttl(name) <= 5000
    r.delete(name)

    with lock_cls(r, name, timeout=5) as held:
        assert held.owned()
        with pytest.raises(LockError):
            with lock_cls(r, name, timeout=5, blocking_timeout=0.1, sleep=0.05):
                pass
    assert r.exists(name) == 0

    with pytest.raises(LockNotOwnedError):
        with lock_cls(r, name, timeout=5):
            r.set(name, b"foreign")
    assert r.get(name) == b"foreign"
    r.delete(name)
    with lock_cls(r, name, timeout=5, raise_on_release_error=False):
        r.set(name, b"foreign")  # exiting must not raise
    assert r.get(name) == b"foreign"
    r.delete(name)

    no_ttl = lock_cls(r, name)
    assert no_ttl.acquire() is True
    assert r.pttl(name) == -1
    with pytest.raises(LockError):
        no_ttl.extend(1)
    no_ttl.release()
    assert r.exists(name) == 0


def test_tokens_are_thread_local_by_default(r: redis.Redis, prefix: str) -> None:
    name = prefix + "tl"
    lock = Lock(r, name, timeout=5)
    assert lock.acquire()
    thread, outcome = run_in_thread(lambda: (lock.owned(), lock.acquire(blocking=False)))
    thread.join(5)
    assert outcome["result"] == (False, False)
    assert lock.owned()
    lock.release()

    shared = Lock(r, name, timeout=5, thread_local=False)
    assert shared.acquire()
    thread, outcome = run_in_thread(shared.release)
    thread.join(5)
    assert "error" not in outcome
    assert r.exists(name) == 0


def test_works_with_decode_responses(prefix: str) -> None:
    client = redis.Redis.from_url(redis_url(), decode_responses=True)
    try:
        name = prefix + "decoded"
        lock = Lock(client, name, timeout=5)
        assert lock.acquire(token="tok")
        assert lock.owned()
        assert lock.extend(1)
        lock.ensure_held()
        lock.release()
        assert not lock.locked()
    finally:
        client.close()


def test_constructor_contract(r: redis.Redis) -> None:
    assert Lock(redis.Redis(socket_timeout=0.8), "x").max_wait_slice == 0.4
    assert Lock(redis.Redis(socket_timeout=None), "x").max_wait_slice == 1.0
    with pytest.raises(ValueError):
        Lock(r, "x", watchdog=True)  # nothing to renew without a TTL
    # The other features are classes of their own (ReentrantLock, ...), not flags
    for flag in ("reentrant", "replicas", "wake_hub", "max_wait_slice"):
        with pytest.raises(TypeError):
            Lock(r, "x", timeout=5, **{flag: 1})


def test_scripts_registered_once_per_client(r: redis.Redis) -> None:
    other = redis.Redis.from_url(redis_url())
    assert scripts.script_for(r, HAND_OVER) is scripts.script_for(r, HAND_OVER)
    assert scripts.script_for(r, HAND_OVER) is not scripts.script_for(other, HAND_OVER)
    assert scripts.script_for(other, HAND_OVER).registered_client is other
    other.close()


def test_locking_package_never_imports_django() -> None:
    code = "import sys, locking; print(sorted(m for m in sys.modules if m.startswith('django')))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# -- ownership -------------------------------------------------------------------------


def test_only_the_owner_token_releases(r: redis.Redis, prefix: str) -> None:
    name = prefix + "owner"
    owner = Lock(r, name, timeout=10)
    assert owner.acquire()
    token = r.get(name)

    intruder = Lock(r, name, timeout=10)
    assert intruder.acquire(blocking=False) is False
    with pytest.raises(LockError):
        intruder.release()
    # A lock object holding some other token (as after its own, expired, acquisition).
    intruder.local.token = b"another-token"
    with pytest.raises(LockNotOwnedError):
        intruder.release()
    intruder.local.token = b"another-token"  # the refused release forgot it, as in redis-py
    with pytest.raises(LockNotOwnedError):
        intruder.extend(5)
    with pytest.raises(LockNotOwnedError):
        intruder.reacquire()
    assert r.get(name) == token
    assert owner.owned()
    assert r.exists(name + ":wake") == 0  # a refused release wakes nobody

    owner.release()
    assert r.exists(name) == 0


def test_release_after_expiry_leaves_the_next_owner_alone(r: redis.Redis, prefix: str) -> None:
    name = prefix + "expiry"
    first = Lock(r, name, timeout=0.1)
    assert first.acquire()
    deadline = time.monotonic() + 5
    while r.exists(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.exists(name) == 0

    second = Lock(r, name, timeout=10)
    assert second.acquire(blocking=False)
    second_token = r.get(name)
    with pytest.raises(LockNotOwnedError):
        first.release()
    with pytest.raises(LockError):
        first.extend(1)  # the failed release forgot the token, as in redis-py
    assert r.get(name) == second_token
    assert second.owned()
    assert 9000 < r.pttl(name) <= 10000
    second.release()


# -- watchdog --------------------------------------------------------------------------


TTL = 0.2
WORK = 0.5


def _critical_section(client: redis.Redis, lock: Lock, occupancy_key: str) -> tuple:
    """Hold the lock for WORK seconds (> TTL); report what the holder observed."""
    if not lock.acquire(blocking_timeout=30):
        return ("timeout",)
    enter = time.monotonic()
    occupants = client.incr(occupancy_key)
    time.sleep(WORK)  # the work: held past its TTL, it stays ours only if the watchdog renews it
    lost = lock.lost
    owned = lock.owned()
    client.decr(occupancy_key)
    leave = time.monotonic()
    lock.release()  # raises LockNotOwnedError if the watchdog failed to keep it
    return ("ok", enter, leave, occupants, lost, owned)


def _assert_serialised(records: list[tuple], count: int) -> None:
    assert [rec[0] for rec in records] == ["ok"] * count, records
    records = sorted(records, key=lambda rec: rec[1])
    for _, enter, leave, occupants, lost, owned in records:
        assert occupants == 1
        assert lost is False
        assert owned is True  # still ours after WORK > TTL: the watchdog renewed it
        assert leave - enter >= WORK > TTL
    for before, after in zip(records, records[1:], strict=False):
        assert before[2] <= after[1], "two holders overlapped"


def test_watchdog_threads_never_overlap(r: redis.Redis, prefix: str) -> None:
    name, occupancy_key = prefix + "wd-threads", prefix + "occupancy"
    lock = Lock(r, name, timeout=TTL, watchdog=True)  # shared: tokens are thread-local
    barrier = threading.Barrier(8)

    def worker() -> tuple:
        barrier.wait(10)
        return _critical_section(r, lock, occupancy_key)

    started = [run_in_thread(worker) for _ in range(8)]
    for thread, _ in started:
        thread.join(60)
    errors = [outcome["error"] for _, outcome in started if "error" in outcome]
    assert errors == []
    _assert_serialised([outcome["result"] for _, outcome in started], 8)
    assert int(r.get(occupancy_key)) == 0
    assert r.exists(name) == 0
    assert watchdog_threads(name) == []


def _process_worker(url: str, name: str, occupancy_key: str, barrier, results) -> None:
    client = redis.Redis.from_url(url)
    try:
        lock = Lock(client, name, timeout=TTL, watchdog=True)
        barrier.wait(60)
        results.put(_critical_section(client, lock, occupancy_key))
    except BaseException as exc:
        results.put(("error", repr(exc)))
    finally:
        client.close()


def test_watchdog_processes_never_overlap(r: redis.Redis, prefix: str) -> None:
    name, occupancy_key = prefix + "wd-procs", prefix + "occupancy"
    # spawn: no inherited threads, sockets or locks from this process.
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(
            target=_process_worker, args=(redis_url(), name, occupancy_key, barrier, results)
        )
        for _ in range(4)
    ]
    records = gather_from_processes(procs, results)
    _assert_serialised(records, 4)
    assert [proc.exitcode for proc in procs] == [0] * 4
    assert int(r.get(occupancy_key)) == 0


def test_without_watchdog_the_lock_expires_mid_work(r: redis.Redis, prefix: str) -> None:
    name = prefix + "no-wd"
    worker = Lock(r, name, timeout=TTL)
    assert worker.acquire()
    work_started = time.monotonic()
    second = Lock(r, name, timeout=10, thread_local=False)
    second.max_wait_slice = 5
    thread, outcome = run_in_thread(lambda: second.acquire(blocking_timeout=10))

    # The first holder is still "working" (it never releases) when the second takes the lock,
    # once the TTL ran out
    thread.join(10)
    assert outcome.get("result") is True
    assert outcome["at"] > work_started + 0.15
    assert not worker.owned()
    assert worker.lost is False  # nothing watched this lock: lost is a watchdog signal
    with pytest.raises(LockNotOwnedError):
        worker.ensure_held()
    with pytest.raises(LockNotOwnedError):
        worker.release()
    assert second.owned()
    second.release()


def test_watchdog_renews_and_stops_on_release(r: redis.Redis, prefix: str) -> None:
    name = prefix + "renew"
    lock = Lock(r, name, timeout=TTL, watchdog=True)
    assert lock.acquire()
    held_until = time.monotonic() + 4 * TTL
    while time.monotonic() < held_until:  # ours throughout four TTLs: renewed, never expired
        assert lock.owned()
        time.sleep(TTL / 10)
    assert 0 < r.pttl(name) <= TTL * 1000
    assert len(watchdog_threads(name)) == 1
    lock.ensure_held()
    lock.release()
    assert watchdog_threads(name) == []  # release joined it
    assert lock.lost is False
    assert r.exists(name) == 0


def test_one_scheduler_wake_up_starts_every_watchdog_coming_due_soon() -> None:
    # A process selling hundreds of units a second schedules a lease per sale: woken once per
    # lease, the scheduler's thread would take a turn at the interpreter lock per sale.
    scheduler = watchdog._WatchdogScheduler()
    started: list[tuple[float, int]] = []
    done = threading.Event()
    soon = [0.05, 0.06, 0.07, 0.08]  # all within COALESCE of the first
    assert max(soon) - min(soon) < scheduler.COALESCE

    def start(lease: object, due: float) -> None:
        with scheduler._condition:
            still_pending = len(scheduler._pending)
        started.append((due, still_pending))
        if len(started) == len(soon):
            done.set()

    t0 = time.monotonic()
    later = watchdog._Lease(b"later")
    for offset in soon:
        scheduler.schedule(t0 + offset, watchdog._Lease(b"soon"), start)
    scheduler.schedule(t0 + 5.0, later, start)
    assert done.wait(5)
    # Each started with its own due time (its watchdog renews from then, not from the start):
    assert [due for due, _ in started] == [t0 + offset for offset in soon]
    # and all four were taken off the heap by the first wake-up: only the later one waits.
    assert {pending for _, pending in started} == {1}
    later.stop.set()


@pytest.mark.parametrize("intrusion", ["overwritten", "deleted"])
def test_watchdog_reports_a_lost_lock(r: redis.Redis, prefix: str, intrusion: str) -> None:
    name = prefix + "lost"
    calls: list[tuple] = []
    reported = threading.Event()

    def on_lost(lock: Lock) -> None:
        calls.append((lock, lock.lost))
        reported.set()

    lock = Lock(r, name, timeout=0.3, watchdog=True, on_lost=on_lost)
    assert lock.acquire()
    lock.ensure_held()
    if intrusion == "overwritten":
        r.set(name, b"intruder")
    else:
        r.delete(name)

    assert reported.wait(5)
    assert lock.lost is True
    assert calls == [(lock, True)]
    with pytest.raises(LockNotOwnedError):
        lock.ensure_held()

    # The watchdog has stopped for good: its thread ended, and reported the loss once
    assert wait_until(lambda: watchdog_threads(name) == [], timeout=5, interval=0.01)
    assert len(calls) == 1
    if intrusion == "overwritten":
        assert r.get(name) == b"intruder"
        assert r.pttl(name) == -1  # the watchdog never touched the intruder's key
    else:
        assert r.exists(name) == 0
    with pytest.raises(LockNotOwnedError):
        lock.release()


def test_watchdog_reports_a_lost_lock_when_redis_dies(server: RedisServer) -> None:
    reported = threading.Event()
    client = no_retry_client(server, socket_timeout=0.5, socket_connect_timeout=0.5)
    lock = Lock(client, "dies", timeout=0.3, watchdog=True, on_lost=lambda _lock: reported.set())
    assert lock.acquire()
    server.kill()
    assert reported.wait(5)
    assert lock.lost is True
    with pytest.raises(LockNotOwnedError):
        lock.ensure_held()
    assert watchdog_threads("dies") == []
    client.close()


# -- waking waiters --------------------------------------------------------------------


def _wait_until_blocked(r: redis.Redis, client_name: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in r.client_list():
            if entry.get("name") == client_name and entry.get("cmd") == "blpop":
                return
        time.sleep(0.005)
    raise AssertionError(f"{client_name} never blocked in BLPOP")


def test_release_wakes_a_waiter_at_once(r: redis.Redis, prefix: str) -> None:
    name = prefix + "wake"
    holder = Lock(r, name, timeout=30)
    assert holder.acquire()
    client_name = "waiter-" + uuid.uuid4().hex
    waiter_client = redis.Redis.from_url(redis_url(), client_name=client_name)
    # Its wait slice (and poll interval) of a minute, and the holder's TTL, are all past the
    # 20 s this test waits for it: only the release's wake can get it the lock in that time.
    waiter = Lock(waiter_client, name, timeout=30, sleep=60, thread_local=False)
    waiter.max_wait_slice = 60
    thread, outcome = run_in_thread(lambda: waiter.acquire(blocking_timeout=120))
    _wait_until_blocked(r, client_name)

    released_at = time.monotonic()
    holder.release()
    thread.join(20)
    assert outcome.get("result") is True
    assert outcome["at"] >= released_at
    assert waiter.owned()
    waiter.release()
    waiter_client.close()


def test_nothing_lingers_and_helper_keys_are_short_lived(r: redis.Redis, prefix: str) -> None:
    name = prefix + "one-wake"
    lock = Lock(r, name, timeout=5)
    for _ in range(3):
        assert lock.acquire()
        lock.release()
    # Without waiters, a release leaves no key behind but the last fencing token, which
    # expires within the hour.
    fence = (name + ":fence").encode()
    assert list(r.scan_iter(match=prefix + "*")) == [fence]
    assert 0 < r.pttl(fence) <= 3600 * 1000

    # While someone waits, the queue and its details expire on their own.
    assert lock.acquire()
    waiter = Lock(r, name, timeout=5, thread_local=False)
    waiter.max_wait_slice = 0.5
    thread, outcome = run_in_thread(lambda: waiter.acquire(blocking_timeout=10))
    deadline = time.monotonic() + 5
    while not r.exists(name + ":queue") and time.monotonic() < deadline:
        time.sleep(0.005)
    for key in (name + ":queue", name + ":waiters"):
        assert 0 < r.pttl(key) <= 500 + 1000  # one wait slice plus the grace
    # A handoff leaves one wake for the next owner; it expires within seconds.
    lock.release()
    thread.join(10)
    assert outcome.get("result") is True
    assert r.get(name) == waiter.local.token
    assert sorted(r.scan_iter(match=prefix + "*")) == [name.encode(), fence]  # wake consumed
    waiter.release()
    assert list(r.scan_iter(match=prefix + "*")) == [fence]
    # A wake nobody reads (its waiter died) lives a few seconds at most.
    assert lock.acquire()
    r.rpush(name + ":queue", b"dead-waiter")
    r.hset(name + ":waiters", b"dead-waiter", f"{int(time.time() * 1000) + 60_000} 100")
    lock.release()
    assert r.get(name) == b"dead-waiter"
    # (the wake carries the waiter's fencing token: the latest grant's)
    assert r.lrange(name + ":wake:dead-waiter", 0, -1) == [r.get(fence)]
    assert 0 < r.pttl(name + ":wake:dead-waiter") <= 3000


def test_a_dead_holders_lock_is_taken_when_it_expires(r: redis.Redis, prefix: str) -> None:
    name = prefix + "dead"
    # From Redis' point of view a dead holder is one that never releases.
    dead = Lock(r, name, timeout=0.5)
    assert dead.acquire()
    acquired_at = time.monotonic()
    # Its wait slice (and poll interval) of a minute is past its 10 s blocking timeout: only
    # waking when the TTL runs out can get it the lock in time.
    waiter = Lock(r, name, timeout=5, sleep=60)
    waiter.max_wait_slice = 60
    assert waiter.acquire(blocking_timeout=10)
    assert time.monotonic() - acquired_at > 0.45  # and not before the TTL ran out
    assert waiter.owned()
    waiter.release()


# -- SET timing out on the client ------------------------------------------------------


@pytest.mark.parametrize("blocking", [True, False], ids=["take-or-queue-script", "set"])
def test_set_timeout_then_get_finds_our_token(server: RedisServer, blocking: bool) -> None:
    client = no_retry_client(server, TakeSpyRedis, socket_timeout=0.2)
    client.ping()  # connect now: the handshake must not be what times out
    lock = Lock(client, "busy", timeout=10, thread_local=False)
    assert lock.acquire(blocking_timeout=1)  # loads the scripts: not what must time out
    lock.release()
    server.pause()
    try:
        thread, outcome = run_in_thread(lambda: lock.acquire(blocking=blocking, blocking_timeout=5))
        assert client.take_timed_out.wait(5)
    finally:
        # The queued SET (or script) runs first, then the lock's GET reads our token back.
        server.resume()
    thread.join(10)
    assert outcome.get("result") is True, outcome
    assert client.take_timeouts == 1
    assert lock.owned()
    assert server.client().get("busy") == lock.local.token
    lock.release()
    client.close()


@pytest.mark.parametrize(
    ("holder_ttl", "blocking_timeout", "expected"),
    [(30, 1.0, False), (1.0, 5, True)],
    ids=["gives-up-in-time", "keeps-waiting-and-gets-it"],
)
def test_set_timeout_when_another_token_got_there_first(
    server: RedisServer, holder_ttl: float, blocking_timeout: float, expected: bool
) -> None:
    admin = server.client()
    holder = Lock(admin, "busy", timeout=holder_ttl)
    assert holder.acquire()
    holder_token = admin.get("busy")
    client = no_retry_client(server, TakeSpyRedis, socket_timeout=0.2)
    client.ping()
    lock = Lock(client, "busy", timeout=10, thread_local=False)
    assert lock.acquire(blocking_timeout=0) is False  # loads the script now, not while paused
    server.pause()
    try:
        started = time.monotonic()
        thread, outcome = run_in_thread(lambda: lock.acquire(blocking_timeout=blocking_timeout))
        assert client.take_timed_out.wait(5)
    finally:
        server.resume()
    thread.join(10)
    assert outcome.get("result") is expected, outcome
    assert client.take_timeouts == 1
    # The timed-out script queued us once it ran; nothing of that is left behind.
    assert admin.exists("busy:queue", "busy:waiters") == 0
    if expected:
        assert lock.owned()
        assert outcome["at"] - started >= holder_ttl * 0.9  # only once the holder's TTL ran out
        lock.release()
    else:
        assert not lock.owned()
        assert outcome["at"] - started >= blocking_timeout * 0.9
        assert admin.get("busy") == holder_token
        assert holder.owned()
        holder.release()
    client.close()
    admin.close()


def _wait_until_asleep(probe: redis.Redis) -> None:
    """Return once the server of `probe` (a client that retries nothing) answers nothing: its
    PING times out."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            probe.ping()
        except redis.exceptions.TimeoutError:
            return
    raise AssertionError("the server never fell asleep")


def test_set_timeout_while_server_sleeps_with_client_retries(server: RedisServer) -> None:
    """DEBUG SLEEP keeps Redis busy past the socket timeout. redis-py's default policy
    retries the timed-out SET; the retry finds our own first SET, and the lock reads the
    key back instead of waiting for itself."""
    admin = server.client()
    sleeper = server.client()
    sleeper.ping()
    # Redis(...) retries timed-out commands by default (from_url(...) does not).
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.2)
    assert client.get_retry().get_retries() > 0
    client.ping()
    probe = no_retry_client(server, socket_timeout=0.05)
    probe.ping()  # connected now: its connection is not one the count below may see
    connections_before = admin.info("stats")["total_connections_received"]
    lock = Lock(client, "slow", timeout=10, thread_local=False)

    busy, busy_outcome = run_in_thread(lambda: sleeper.execute_command("DEBUG", "SLEEP", "0.5"))
    _wait_until_asleep(probe)
    started = time.monotonic()
    assert lock.acquire(blocking_timeout=5) is True
    elapsed = time.monotonic() - started
    busy.join(5)
    assert "error" not in busy_outcome
    assert lock.owned()
    assert admin.get("slow") == lock.local.token
    assert elapsed > 0.3  # the server could only answer after its sleep
    # Our client dropped its connection after the timeout and reconnected.
    assert admin.info("stats")["total_connections_received"] > connections_before
    lock.release()
    for c in (admin, sleeper, client, probe):
        c.close()


def test_when_the_get_fails_the_error_propagates(server: RedisServer) -> None:
    client = no_retry_client(server, socket_timeout=0.2)
    client.ping()
    lock = Lock(client, "down", timeout=10)
    server.pause()
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            lock.acquire(blocking_timeout=5)
    finally:
        server.resume()
    server.kill()
    with pytest.raises(redis.exceptions.ConnectionError):
        lock.acquire(blocking_timeout=5)
    client.close()


def test_locks_keep_working_after_redis_restarts_empty(server: RedisServer) -> None:
    client = no_retry_client(server)
    lock = Lock(client, "restart", timeout=5, watchdog=True)
    assert lock.acquire()
    lock.release()
    release_sha = scripts.script_for(client, HAND_OVER).sha
    assert client.script_exists(release_sha) == [True]
    server.restart()
    assert client.script_exists(release_sha) == [False]
    assert lock.acquire()
    assert lock.extend(1)
    lock.release()  # EVALSHA answered NOSCRIPT; redis-py fell back to EVAL
    assert client.exists("restart") == 0
    client.close()


# -- the RedisServer helper ------------------------------------------------------------


def test_redis_server_kill_and_restart_on_the_same_port() -> None:
    with RedisServer() as server:
        client = server.client()
        client.set("k", "v")
        port, pid = server.port, server.pid
        server.kill()
        assert not server.running
        with pytest.raises(redis.exceptions.ConnectionError):
            client.ping()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        server.restart()
        assert server.port == port
        assert server.url == f"redis://127.0.0.1:{port}/0"
        assert server.pid != pid
        assert client.ping() is True
        assert client.dbsize() == 0
        client.close()


def test_redis_server_pause_and_resume() -> None:
    with RedisServer() as server:
        client = server.client(socket_timeout=0.2)
        assert client.ping()
        server.pause()
        with pytest.raises(redis.exceptions.TimeoutError):
            client.ping()
        server.resume()
        assert client.ping() is True
        server.pause()  # stopping a paused server must not hang or leak it
        pid = server.pid
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
