"""Per-process circuit breakers: one in front of Redis, one in front of the Celery broker.

Closed: calls go through. The first connection error or timeout opens the breaker: callers skip
the dependency (and its timeout) at once. Every `probe_seconds` it tries again: with a `probe`,
the breaker runs it in a thread of its own (no request waits on a dependency that may hang),
whether calls come or not, and closes only if it succeeds; without one, the first caller after
the wait is the trial and reports back with `record_success` / `record_failure`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from django.conf import settings
from django.db import connections

from locking import Lock, LockError

from . import metrics
from .redis_client import REDIS_DOWN_ERRORS, get_redis_client, ping

logger = logging.getLogger(__name__)

#: How often an open breaker tries Redis again (seconds): a second of checkouts through the
#: fallback after Redis is back costs little, and a probe a second costs a dead Redis nothing.
PROBE_SECONDS = 1.0
#: How often a process tries publishing again while the broker is down (seconds): the order
#: rows are the outbox, which the sweeper publishes again, so trying seldom loses no order.
BROKER_PROBE_SECONDS = 5.0


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        *,
        metric: str,
        probe_seconds: Callable[[], float],
        probe: Callable[[], None] | None = None,
        probe_errors: tuple[type[BaseException], ...] = (),
        watch: bool = True,
    ) -> None:
        """watch: with a probe, probe every `probe_seconds` while open, callers or none (off:
        only a caller whose wait is over, or `probe_soon`, starts one)."""
        self.name = name
        #: Its `breaker` label in the metrics.
        self.metric = metric
        self._probe_seconds = probe_seconds
        self._probe = probe
        self._probe_errors = probe_errors
        self._watches = watch
        self._trial_lock = threading.Lock()
        self._retry_at: float | None = None
        self._prober: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self.opened_count = 0
        # A child forked while this process's probe ran must not inherit its lock held.
        os.register_at_fork(after_in_child=self._forget_trial)

    def _forget_trial(self) -> None:
        self._trial_lock = threading.Lock()
        self._prober = None
        self._watcher = None

    @property
    def is_open(self) -> bool:
        return self._retry_at is not None

    def record_failure(self, exc: BaseException) -> None:
        """The dependency failed: open (or keep open) and try again after the interval."""
        opening = self._retry_at is None
        self._retry_at = time.monotonic() + self._probe_seconds()
        if opening:
            self.opened_count += 1
            metrics.BREAKER_OPEN.labels(self.metric).set(1)
            logger.warning("%s unreachable (%s): breaker open", self.name, exc)
            self._watch()

    def _watch(self) -> None:
        """With a probe, keep probing every `probe_seconds` until the breaker closes, calls or
        none: a process that serves nothing more after an outage (the crowd gone, its share of
        the traffic sent elsewhere) still closes its breaker and repairs what the outage left
        wrong, rather than when its next request comes."""
        if not self._watches or self._probe is None:
            return
        if self._watcher is not None and self._watcher.is_alive():
            return

        def run() -> None:
            while self._retry_at is not None:
                time.sleep(self._probe_seconds())
                self.probe_soon()

        self._watcher = threading.Thread(
            target=run, name=f"{self.metric}-breaker-watch", daemon=True
        )
        self._watcher.start()

    def record_success(self) -> None:
        if self._retry_at is not None:
            metrics.BREAKER_OPEN.labels(self.metric).set(0)
            logger.warning("%s is back: breaker closed", self.name)
        self._retry_at = None

    def allow(self) -> bool:
        """Whether this call may use the dependency now. Never waits on it: when a probe is
        due, it starts in a thread and this call is told no, as while the wait runs."""
        retry_at = self._retry_at
        if retry_at is None:
            return True
        if time.monotonic() < retry_at:
            return False
        return self._start_probe(trial=True)

    def probe_soon(self) -> None:
        """Start the probe in its thread now, the wait not yet run out, unless one runs: for a
        caller that has seen the dependency answer (a health check), which it must not wait
        for (the probe rebuilds what the outage left wrong, which may take long)."""
        if self._retry_at is not None and self._probe is not None:
            self._start_probe(trial=False)

    def _start_probe(self, *, trial: bool) -> bool:
        """Start the probe's thread unless a probe runs; with no probe, let this caller be the
        trial when `trial`. Whether the caller may use the dependency."""
        if not self._trial_lock.acquire(blocking=False):
            return False
        if self._retry_at is None:
            self._trial_lock.release()
            return True
        # Until the trial reports, others keep skipping.
        self._retry_at = time.monotonic() + self._probe_seconds()
        if self._probe is None:
            # This caller is the trial.
            self._trial_lock.release()
            return trial
        try:
            prober = threading.Thread(
                target=self._run_probe, name=f"{self.metric}-breaker-probe", daemon=True
            )
            prober.start()
            self._prober = prober  # published started: `settle` may join it at once
        except BaseException:
            self._trial_lock.release()
            raise
        return False

    def settle(self, timeout: float) -> None:
        """Wait for a probe in flight to end (at most `timeout` seconds)."""
        prober = self._prober
        if prober is not None:
            prober.join(timeout)

    def _run_probe(self) -> None:
        """Body of the probe's thread: the probe, then its database connections closed."""
        try:
            self._probe_holding_the_trial()
        finally:
            connections.close_all()

    def _probe_holding_the_trial(self) -> None:
        assert self._probe is not None
        try:
            self._probe()
        except self._probe_errors as exc:
            self._retry_at = time.monotonic() + self._probe_seconds()
            logger.info("%s still unreachable (%s)", self.name, exc)
        except Exception:
            self._retry_at = time.monotonic() + self._probe_seconds()
            logger.exception("%s: the probe failed", self.name)
        else:
            self.record_success()
        finally:
            self._trial_lock.release()

    def reset(self) -> None:
        if self._retry_at is not None:
            metrics.BREAKER_OPEN.labels(self.metric).set(0)
        self._retry_at = None


#: What a recovered Redis needs before checkouts use it again, in order (each may raise a
#: Redis error: the breaker then stays open). Registered by `InventoryConfig.ready()`:
#: releasing the locks a failure left in doubt, rebuilding the counters from the database.
redis_recovery: list[Callable[[], None]] = []

#: Locks this process may hold without knowing it: a SET NX or a release that timed out may
#: still run on the server (a paused Redis runs it when it wakes). Released on recovery, so
#: waiters need not sit out the lock's TTL.
_unsettled: set[tuple[str, bytes]] = set()
_unsettled_lock = threading.Lock()


def remember_unsettled(locks: Iterable[tuple[str, bytes]]) -> None:
    """Locks (name, token) a Redis failure left in doubt: released on recovery if ours."""
    with _unsettled_lock:
        _unsettled.update(locks)


def release_unsettled_locks() -> None:
    """Release, if still ours, every lock a Redis failure left in doubt (on recovery)."""
    with _unsettled_lock:
        pending = list(_unsettled)
    client = get_redis_client()
    for name, token in pending:
        lock = Lock(client, name)
        lock.local.token = token
        try:
            lock.release()
        except LockError:
            pass  # never taken, or expired already
        with _unsettled_lock:
            _unsettled.discard((name, token))


def _probe_redis() -> None:
    ping()
    for step in redis_recovery:
        step()


#: This process's breaker in front of Redis: closes only once Redis answers and is rebuilt.
breaker = CircuitBreaker(
    "Redis",
    metric="redis",
    probe_seconds=lambda: getattr(settings, "FLASHSALE_BREAKER_PROBE_SECONDS", PROBE_SECONDS),
    probe=_probe_redis,
    probe_errors=REDIS_DOWN_ERRORS,
)

#: This process's breaker in front of the Celery broker; the next publish is the trial.
broker_breaker = CircuitBreaker(
    "Celery broker",
    metric="broker",
    probe_seconds=lambda: getattr(settings, "FLASHSALE_BROKER_PROBE_SECONDS", BROKER_PROBE_SECONDS),
)
