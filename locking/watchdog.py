"""The lock's watchdog: keeps a held lock's TTL short and renewed while its holder lives, and
says when the lock slipped away (`Watchdog.lost`, ``on_lost``, `listeners`).

One daemon thread per process (`_WatchdogScheduler`) starts a lease's renewal thread only once
the lock has been held for one renewal interval (``timeout / 3``): a short critical section,
the common case, never creates or joins a thread. A fencing token (`LockCore.fence`), not the
watchdog, is what protects a store from a holder paused past its TTL: the watchdog was paused
too. See docs/design.md#locks.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from redis.exceptions import RedisError

from .core import LockCore

logger = logging.getLogger(__name__)

#: Told of every watchdog renewal of this process's locks: called as ``listener(lock, renewed)``
#: from the watchdog's thread, ``renewed`` False when the renewal failed and the lock is taken
#: for lost (an application's metrics, say). A listener that raises is logged and ignored.
listeners: list[Callable[[Any, bool], object]] = []


class _Lease:
    """One acquisition: its token and, once due, the thread renewing it."""

    __slots__ = ("token", "stop", "thread", "lost", "state_lock")

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.lost = False
        # Serialises "release stops the watchdog" with "watchdog declares the lock
        # lost" and with "the scheduler starts the watchdog's thread", so a renewal
        # failing because of our own release is not reported, and no thread starts
        # for a lease that is already released.
        self.state_lock = threading.Lock()


class _Leases(threading.local):
    """This thread's current lease; the class attribute is every new thread's default."""

    lease: _Lease | None = None


class Watchdog(LockCore):
    """The core lock, renewed while held when ``watchdog=True``.

    Contract, beside :class:`LockCore`'s:

    * ``watchdog=True`` (requires ``timeout``) renews the TTL every ``timeout / 3`` from a
      daemon thread while the lock is held. If a renewal finds the lock is not ours any more,
      or Redis fails, the watchdog stops, :attr:`lost` becomes True and ``on_lost(lock)`` is
      called once, from the watchdog thread. A holder whose lock is lost must not commit its
      work.
    * ``release`` (and ``released_elsewhere``) stops the watchdog before Redis is told.
    * The watchdog state is per thread with ``thread_local=True``, as the token is.
    """

    def __init__(
        self,
        *args: Any,
        watchdog: bool = False,
        on_lost: Callable[[Any], object] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if watchdog and not self.timeout:
            raise ValueError("watchdog=True needs a timeout: there is no TTL to renew")
        self.watchdog = watchdog
        self.on_lost = on_lost
        self._leases: Any = _Leases() if self.thread_local else SimpleNamespace(lease=None)

    @property
    def lost(self) -> bool:
        """True once the watchdog found the current acquisition gone or could not renew it.

        Stays True after release until the next acquire. Always False without a
        watchdog: nothing monitors the lock then, use :meth:`ensure_held`.
        """
        lease = self._leases.lease
        return lease is not None and lease.lost

    def _held(self, token: bytes, fence: int | None) -> None:
        if not self.watchdog:
            super()._held(token, fence)
            return
        self._stop_watchdog()
        super()._held(token, fence)
        lease = self._leases.lease = _Lease(token)
        self._start_watchdog(lease)

    def _letting_go(self) -> None:
        self._stop_watchdog()
        super()._letting_go()

    def _start_watchdog(self, lease: _Lease) -> None:
        # The watchdog gets the token through the lease: the token is thread-local
        # and would be invisible from the watchdog's thread. It holds the lock only
        # weakly so that an abandoned lock object lets its lease expire.
        ttl_ms = self._ttl_ms()
        assert self.timeout and ttl_ms, "watchdog=True needs a timeout (checked in __init__)"
        interval = self.timeout / 3
        _scheduler.schedule(
            time.monotonic() + interval,
            lease,
            _WatchdogStart(weakref.ref(self), self.name, interval, ttl_ms),
        )

    def _stop_watchdog(self) -> None:
        lease = self._leases.lease
        if lease is None or not self.watchdog:
            return
        with lease.state_lock:
            lease.stop.set()
        thread = lease.thread
        if thread is not None and thread is not threading.current_thread():
            # At most one renewal is in flight; the watchdog cannot act after the stop
            # flag is set (see _watch), so a slow join is only a delay, not a risk.
            thread.join(timeout=1.0)


class _WatchdogStart:
    """What the scheduler needs to start a lease's watchdog thread once it is due."""

    __slots__ = ("lock_ref", "name", "interval", "ttl_ms")

    def __init__(
        self, lock_ref: weakref.ref[Watchdog], name: str, interval: float, ttl_ms: int
    ) -> None:
        self.lock_ref = lock_ref
        self.name = name
        self.interval = interval
        self.ttl_ms = ttl_ms

    def __call__(self, lease: _Lease, due: float) -> None:
        if self.lock_ref() is None:
            return  # abandoned: let the lease expire
        with lease.state_lock:
            if lease.stop.is_set():
                return  # released meanwhile
            lease.thread = threading.Thread(
                target=_watch,
                args=(self.lock_ref, lease, self.interval, self.ttl_ms, due),
                name=f"lock-watchdog:{self.name}",
                daemon=True,
            )
            lease.thread.start()


class _WatchdogScheduler:
    """One daemon thread per process that starts a lease's watchdog when its first
    renewal is due, unless the lease was released before.

    Scheduling costs a heap push under a lock; released leases are not removed, they are
    dropped when they come due. A wake-up is only needed when the new lease comes due
    before every pending one, which is rare under load (the pending ones are older).

    Each wake-up takes every lease coming due within `COALESCE` seconds, not only those due
    now: a process selling hundreds of units a second would otherwise wake this thread once
    per sale, each wake a context switch and a turn at the interpreter lock taken from the
    thread serving the sales. A watchdog started early waits for its lease's due time.
    """

    #: Seconds ahead whose due leases one wake-up takes: at most 1 / COALESCE wake-ups a second.
    COALESCE = 0.1

    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._pending: list[tuple[float, int, _Lease, _WatchdogStart]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, due: float, lease: _Lease, start: _WatchdogStart) -> None:
        with self._condition:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="lock-watchdog-scheduler", daemon=True
                )
                self._thread.start()
            wake = not self._pending or due < self._pending[0][0]
            heapq.heappush(self._pending, (due, next(self._order), lease, start))
            if wake:
                self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                while True:
                    now = time.monotonic()
                    if self._pending and self._pending[0][0] <= now:
                        break
                    self._condition.wait(self._pending[0][0] - now if self._pending else None)
                due = []
                horizon = now + self.COALESCE
                while self._pending and self._pending[0][0] <= horizon:
                    due.append(heapq.heappop(self._pending))
            for when, _, lease, start in due:
                if lease.stop.is_set():
                    continue
                try:
                    start(lease, when)
                except Exception:  # keep serving the other leases
                    logger.exception("could not start the watchdog of lock %r", start.name)


_scheduler = _WatchdogScheduler()


def _new_scheduler_after_fork() -> None:
    # The scheduler's thread does not survive a fork, and its lock may have been held by
    # it at the time: the child starts afresh (it holds none of the parent's leases).
    global _scheduler
    _scheduler = _WatchdogScheduler()


os.register_at_fork(after_in_child=_new_scheduler_after_fork)


def _watch(
    lock_ref: weakref.ref[Watchdog], lease: _Lease, interval: float, ttl_ms: int, first_at: float
) -> None:
    """Watchdog loop: renew the TTL at ``first_at`` and then every ``interval`` until
    stopped, or report the loss."""
    # Scheduled from the previous renewal's start, so a slow round trip does not
    # stretch the period and eat into the TTL margin.
    next_at = first_at
    while not lease.stop.wait(max(0.0, next_at - time.monotonic())):
        next_at = max(next_at + interval, time.monotonic())
        if not _renew(lock_ref, lease, ttl_ms):
            return


def _renew(lock_ref: weakref.ref[Watchdog], lease: _Lease, ttl_ms: int) -> bool:
    """One renewal; False when the watchdog must stop.

    A separate function so the strong reference to the lock dies with this frame and
    is not held while the watchdog sleeps.
    """
    lock = lock_ref()
    if lock is None:
        return False
    try:
        if lock._pexpire(lease.token, ttl_ms, True):
            _tell_listeners(lock, renewed=True)
            return True
    except RedisError:
        logger.warning("Watchdog could not renew lock %r", lock.name, exc_info=True)
    with lease.state_lock:
        if lease.stop.is_set():
            return False  # released meanwhile: the failure comes from our own release
        lease.lost = True
        lease.stop.set()
    logger.warning("Lock %r was lost while held", lock.name)
    _tell_listeners(lock, renewed=False)
    if lock.thread_local:
        # This thread serves this acquisition only: let code in on_lost see it through
        # the thread-local attributes (lost, owned()).
        lock._leases.lease = lease
        lock.local.token = lease.token
    if lock.on_lost is not None:
        try:
            lock.on_lost(lock)
        except Exception:
            logger.exception("on_lost callback of lock %r failed", lock.name)
    return False


def _tell_listeners(lock: Watchdog, *, renewed: bool) -> None:
    for listener in listeners:
        try:
            listener(lock, renewed)
        except Exception:
            logger.exception("watchdog listener %r failed", listener)
