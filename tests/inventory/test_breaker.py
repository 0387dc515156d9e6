"""The circuit breaker in front of Redis probes in a thread of its own: no caller waits on a
Redis that may hang, and the process's checkouts meanwhile go to the database fallback."""

from __future__ import annotations

import os
import threading

import pytest
import redis

from inventory.breaker import CircuitBreaker
from inventory.redis_client import REDIS_DOWN_ERRORS
from tests.conftest import wait_until


def _breaker(probe, probe_seconds: float = 0.0, *, watch: bool = False) -> CircuitBreaker:
    """A breaker whose probes only callers start, unless `watch`: the tests count them."""
    return CircuitBreaker(
        "Test dependency",
        metric="test",
        probe_seconds=lambda: probe_seconds,
        probe=probe,
        probe_errors=REDIS_DOWN_ERRORS,
        watch=watch,
    )


def test_an_open_breaker_probes_and_closes_with_no_caller_at_all():
    # Given a breaker opened by a failure, whose first probe fails and second succeeds
    outcomes = [ConnectionError("still down"), None]

    def probe() -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    breaker = _breaker(probe, probe_seconds=0.05, watch=True)
    breaker.record_failure(ConnectionError("down"))

    # When nothing calls it (the process serves no request after the outage)
    # Then it probes on its own until a probe succeeds, and closes
    assert wait_until(lambda: not breaker.is_open, timeout=10)
    assert outcomes == []


def test_a_due_probe_runs_in_a_thread_while_callers_are_told_no():
    # Given an open breaker whose probe blocks until let go
    started, go = threading.Event(), threading.Event()
    calls = []

    def probe() -> None:
        calls.append(threading.current_thread().name)
        started.set()
        go.wait(10)

    breaker = _breaker(probe)
    breaker.record_failure(ConnectionError("down"))

    # When its wait is over, the caller that finds it so is told no and the probe starts in
    # another thread, which is still probing while every later caller is told no too
    assert breaker.allow() is False
    assert started.wait(5)
    assert breaker.allow() is False and breaker.allow() is False
    assert breaker.is_open and calls == ["test-breaker-probe"]

    # and once the probe succeeds, the breaker closes: callers use the dependency again
    go.set()
    breaker.settle(timeout=5)
    assert not breaker.is_open and breaker.allow() is True
    assert len(calls) == 1


def test_a_failed_probe_keeps_it_open_until_the_next_one_succeeds():
    outcomes = [ConnectionError("still down"), None]

    def probe() -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    breaker = _breaker(probe)
    breaker.record_failure(ConnectionError("down"))

    assert breaker.allow() is False
    breaker.settle(timeout=5)
    assert breaker.is_open and outcomes == [None]
    assert breaker.allow() is False
    breaker.settle(timeout=5)
    assert not breaker.is_open and outcomes == []


def test_a_probe_that_raises_something_else_is_logged_and_keeps_it_open(caplog):
    def probe() -> None:
        raise ValueError("a recovery step broke")

    breaker = _breaker(probe)
    breaker.record_failure(ConnectionError("down"))
    assert breaker.allow() is False
    breaker.settle(timeout=5)
    assert breaker.is_open
    assert "the probe failed" in caplog.text and "a recovery step broke" in caplog.text
    # and the trial is free again: the next due caller starts another probe
    assert breaker.allow() is False
    breaker.settle(timeout=5)
    failed = [r for r in caplog.records if r.getMessage() == "Test dependency: the probe failed"]
    assert len(failed) == 2


def test_probe_soon_starts_the_probe_before_its_wait_is_over_without_waiting_for_it():
    # Given an open breaker whose wait is not over, and whose probe blocks until let go
    started, go = threading.Event(), threading.Event()
    threads = []

    def probe() -> None:
        threads.append(threading.current_thread())
        started.set()
        go.wait(10)

    breaker = _breaker(probe, probe_seconds=60)
    breaker.record_failure(ConnectionError("down"))
    assert breaker.allow() is False and threads == []

    # When a health check, which saw the dependency answer, asks for a probe
    breaker.probe_soon()

    # Then the probe runs in its own thread and the call has returned while it still runs
    assert started.wait(5)
    assert threads and threads[0] is not threading.current_thread()
    assert breaker.is_open
    breaker.probe_soon()  # a second ask while one runs starts none
    go.set()
    breaker.settle(timeout=5)
    assert not breaker.is_open and len(threads) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_probe_runs_probes_for_itself():
    # Given a probe running (blocked) in this process's thread
    started, go = threading.Event(), threading.Event()
    breaker = _breaker(lambda: (started.set(), go.wait(10)))
    breaker.record_failure(ConnectionError("down"))
    assert breaker.allow() is False and started.wait(5)

    # When the process forks, the child's breaker is not held by a probe it does not run:
    # its next due caller probes (the child's own thread) and closes it
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's outcome is its exit status)
        go.set()  # the child's copy of the event: its probe returns at once
        breaker.allow()
        breaker.settle(timeout=5)
        os._exit(0 if not breaker.is_open else 1)
    _, status = os.waitpid(child, 0)
    go.set()
    breaker.settle(timeout=5)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_hung_redis_holds_the_probe_not_the_caller():
    from shop.processes.redis_server import RedisServer

    # Given the breaker's probe a PING of a Redis that hangs (SIGSTOP: the connection is
    # accepted, nothing is answered)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=3, socket_connect_timeout=3)
        breaker = _breaker(client.ping)
        breaker.record_failure(ConnectionError("down"))
        server.pause()
        try:
            # When a caller finds the probe due, it is told no while the PING still waits
            assert breaker.allow() is False
            probing = [t for t in threading.enumerate() if t.name == "test-breaker-probe"]
            assert probing and probing[0].is_alive() and breaker.is_open
        finally:
            server.resume()
        # and once Redis answers, the probe closes the breaker
        assert wait_until(lambda: not breaker.is_open, timeout=10)
        client.close()
