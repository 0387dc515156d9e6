"""Other projects' Redis locks, built the way FLASHSALE_LOCK_FACTORY builds ours.

The strategy benchmark names one of these in FLASHSALE_LOCK_FACTORY, so `lock` runs its own
code (its pre-check, the guarded sale statement, its release) with a peer's lock and nothing
else changed. Each factory takes (client, name, *, timeout, blocking_timeout, watchdog), as
`locking.Lock` does, and returns an object with what the strategies use: acquire(token=...,
blocking=..., blocking_timeout=...), release(), owned(), `local.token`, `name` and `lost`.
TTL and wait are ours (the settings'); `watchdog` is ours alone: a peer renews as it does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import redis.lock
import redis_lock
from redis.exceptions import LockNotOwnedError


class RedisPyLock(redis.lock.Lock):
    """redis-py's own `Lock`: its waiters sleep `sleep` seconds between polls."""

    lost = False  # nothing watches a redis-py lock: no renewal to fail


def _redis_py(client: Any, name: str, *, timeout: float, blocking_timeout: float, sleep: float):
    return RedisPyLock(
        client, name, timeout=timeout, sleep=sleep, blocking=True, blocking_timeout=blocking_timeout
    )


def redis_py(client: Any, name: str, *, timeout: float, blocking_timeout: float, **_: Any):
    """redis-py's Lock with its default poll interval, 0.1 s."""
    return _redis_py(client, name, timeout=timeout, blocking_timeout=blocking_timeout, sleep=0.1)


def redis_py_5ms(client: Any, name: str, *, timeout: float, blocking_timeout: float, **_: Any):
    """redis-py's Lock polling every 5 ms."""
    return _redis_py(client, name, timeout=timeout, blocking_timeout=blocking_timeout, sleep=0.005)


class PythonRedisLock:
    """python-redis-lock's `Lock` (waiters woken through a list) behind the strategies' calls."""

    lost = False  # its renewal thread reports nothing

    def __init__(
        self, client: Any, name: str, *, timeout: float, blocking_timeout: float, renew: bool
    ) -> None:
        self.name = name
        self.local = SimpleNamespace(token=None)
        self._wait = blocking_timeout
        # Its expiry and wait are whole seconds; ours are 5 s by default.
        self._lock = redis_lock.Lock(
            client, name, expire=max(1, round(timeout)), auto_renewal=renew
        )

    def acquire(
        self,
        token: bytes | None = None,
        blocking: bool = True,
        blocking_timeout: float | None = None,
    ) -> bool:
        wait = self._wait if blocking_timeout is None else blocking_timeout
        acquired = self._lock.acquire(
            blocking=blocking, timeout=max(1, round(wait)) if blocking else None
        )
        if acquired:
            self.local.token = self._lock.id
        return acquired

    def release(self) -> None:
        self.local.token = None
        try:
            self._lock.release()
        except redis_lock.NotAcquired as exc:
            raise LockNotOwnedError(str(exc), lock_name=self.name) from None

    def owned(self) -> bool:
        return self._lock.get_owner_id() == self._lock.id


def python_redis_lock(client: Any, name: str, *, timeout: float, blocking_timeout: float, **_: Any):
    """python-redis-lock without renewal."""
    return PythonRedisLock(
        client, name, timeout=timeout, blocking_timeout=blocking_timeout, renew=False
    )


def python_redis_lock_renewal(
    client: Any, name: str, *, timeout: float, blocking_timeout: float, **_: Any
):
    """python-redis-lock with `auto_renewal`, the counterpart of our watchdog."""
    return PythonRedisLock(
        client, name, timeout=timeout, blocking_timeout=blocking_timeout, renew=True
    )
