"""Per-process circuit breakers: one in front of Redis, one in front of the Celery broker.

Closed: calls go through. The first connection error or timeout opens the breaker: callers skip
the dependency (and its timeout) at once. Every `probe_seconds` one caller gets to try again:
with a `probe`, the breaker runs it itself and closes only if it succeeds; without one, the
caller's own call is the trial and it reports back with `record_success` / `record_failure`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django.conf import settings

from . import metrics
from .redis_client import REDIS_DOWN_ERRORS, ping

logger = logging.getLogger(__name__)


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        *,
        metric: str,
        probe_seconds: Callable[[], float],
        probe: Callable[[], None] | None = None,
        probe_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.name = name
        #: Its `breaker` label in the metrics.
        self.metric = metric
        self._probe_seconds = probe_seconds
        self._probe = probe
        self._probe_errors = probe_errors
        self._trial_lock = threading.Lock()
        self._retry_at: float | None = None
        self.opened_count = 0

    @property
    def is_open(self) -> bool:
        return self._retry_at is not None

    @property
    def trial_due(self) -> bool:
        """Whether it is open and its wait is over: the next `allow()` tries the dependency."""
        retry_at = self._retry_at
        return retry_at is not None and time.monotonic() >= retry_at

    def record_failure(self, exc: BaseException) -> None:
        """The dependency failed: open (or keep open) and try again after the interval."""
        if self._retry_at is None:
            self.opened_count += 1
            metrics.BREAKER_OPEN.labels(self.metric).set(1)
            logger.warning("%s unreachable (%s): breaker open", self.name, exc)
        self._retry_at = time.monotonic() + self._probe_seconds()

    def record_success(self) -> None:
        if self._retry_at is not None:
            metrics.BREAKER_OPEN.labels(self.metric).set(0)
            logger.warning("%s is back: breaker closed", self.name)
        self._retry_at = None

    def allow(self) -> bool:
        """Whether this call may use the dependency now."""
        retry_at = self._retry_at
        if retry_at is None:
            return True
        if time.monotonic() < retry_at or not self._trial_lock.acquire(blocking=False):
            return False
        try:
            if self._retry_at is None:
                return True
            if self._probe is None:
                # This caller is the trial; until it reports, others keep skipping.
                self._retry_at = time.monotonic() + self._probe_seconds()
                return True
            self._probe()
        except self._probe_errors as exc:
            self._retry_at = time.monotonic() + self._probe_seconds()
            logger.info("%s still unreachable (%s)", self.name, exc)
            return False
        finally:
            self._trial_lock.release()
        self.record_success()
        return True

    def reset(self) -> None:
        if self._retry_at is not None:
            metrics.BREAKER_OPEN.labels(self.metric).set(0)
        self._retry_at = None


#: What a recovered Redis needs before checkouts use it again, in order (each may raise a
#: Redis error: the breaker then stays open). Registered by `InventoryConfig.ready()`:
#: releasing the locks a failure left in doubt, rebuilding the counters from the database.
redis_recovery: list[Callable[[], None]] = []


def _probe_redis() -> None:
    ping()
    for step in redis_recovery:
        step()


#: This process's breaker in front of Redis: closes only once Redis answers and is rebuilt.
breaker = CircuitBreaker(
    "Redis",
    metric="redis",
    probe_seconds=lambda: settings.FLASHSALE_BREAKER_PROBE_SECONDS,
    probe=_probe_redis,
    probe_errors=REDIS_DOWN_ERRORS,
)

#: This process's breaker in front of the Celery broker; the next publish is the trial.
broker_breaker = CircuitBreaker(
    "Celery broker", metric="broker", probe_seconds=lambda: settings.FLASHSALE_BROKER_PROBE_SECONDS
)
