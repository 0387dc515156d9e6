"""A per-process circuit breaker in front of Redis.

Closed: the Redis strategies run. The first connection error or timeout opens it: checkouts go
straight to the database fallback without paying the Redis timeout again. Every
FLASHSALE_BREAKER_PROBE_SECONDS one request probes Redis (PING); when it answers, every item's
Redis state is rebuilt from the database and only then is the breaker closed.
"""

from __future__ import annotations

import logging
import threading
import time

from django.conf import settings

from .redis_client import REDIS_DOWN_ERRORS, get_redis_client

logger = logging.getLogger(__name__)


class RedisBreaker:
    def __init__(self) -> None:
        self._probe_lock = threading.Lock()
        self._retry_at: float | None = None
        self.opened_count = 0

    @property
    def is_open(self) -> bool:
        return self._retry_at is not None

    def record_failure(self, exc: BaseException) -> None:
        """Redis failed: open (or keep open) and probe again after the interval."""
        if self._retry_at is None:
            self.opened_count += 1
            logger.warning("Redis unreachable (%s): checkout falls back to the database", exc)
        self._retry_at = time.monotonic() + settings.FLASHSALE_BREAKER_PROBE_SECONDS

    def allow(self) -> bool:
        """Whether this checkout may use Redis; probes and recovers when it is time to."""
        retry_at = self._retry_at
        if retry_at is None:
            return True
        if time.monotonic() < retry_at or not self._probe_lock.acquire(blocking=False):
            return False
        try:
            if self._retry_at is None:
                return True
            get_redis_client().ping()
            rebuild_redis_state()
        except REDIS_DOWN_ERRORS as exc:
            self._retry_at = time.monotonic() + settings.FLASHSALE_BREAKER_PROBE_SECONDS
            logger.info("Redis still unreachable (%s)", exc)
            return False
        finally:
            self._probe_lock.release()
        self._retry_at = None
        logger.warning("Redis is back: counters rebuilt from the database, Redis path resumed")
        return True

    def reset(self) -> None:
        self._retry_at = None


def rebuild_redis_state() -> None:
    """Set every item's Redis counters and shards from the database."""
    from .models import Item
    from .strategies import get_strategy

    for item in Item.objects.all():
        get_strategy(item.strategy).sync_redis(item=item)


#: This process's breaker.
breaker = RedisBreaker()
