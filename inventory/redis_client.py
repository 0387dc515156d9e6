"""The one place that builds the shop's Redis client (its keys: `inventory.keys`)."""

from __future__ import annotations

import os
import threading

import redis
from django.conf import settings
from redis.backoff import NoBackoff
from redis.retry import Retry

#: The errors that mean "Redis is unreachable": the only ones that trigger the database fallback.
REDIS_DOWN_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)

_clients: dict[tuple[int, str], redis.Redis] = {}
_clients_lock = threading.Lock()


def get_redis_client() -> redis.Redis:
    """Return this process's Redis client for settings.REDIS_URL.

    Connect and socket timeouts are short so a hung Redis cannot hang checkout, and nothing is
    retried by the client: a command that may have run must not run twice, and the fallback
    decides what happens when Redis is down.
    """
    key = (os.getpid(), settings.REDIS_URL)
    client = _clients.get(key)
    if client is None:
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                client = redis.Redis.from_url(
                    settings.REDIS_URL,
                    socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
                    socket_connect_timeout=settings.REDIS_CONNECT_TIMEOUT,
                    retry=Retry(NoBackoff(), 0),
                )
                _clients[key] = client
    return client
