"""The one place that builds the shop's Redis client (its keys: `inventory.keys`): a
`redis.Redis` for REDIS_URL, or a `redis.cluster.RedisCluster` when REDIS_CLUSTER_NODES names a
Redis Cluster."""

from __future__ import annotations

import os
import threading
from typing import Any

import redis
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

#: The errors that mean "Redis is unreachable": the only ones that trigger the database fallback.
#: On a cluster, a slot whose master died answers CLUSTERDOWN (or nobody serves it) until a
#: replica takes over: the same outage, for the keys of that slot.
REDIS_DOWN_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.SlotNotCoveredError,
)

_clients: dict[tuple[int, str, tuple[str, ...]], Any] = {}
_clients_lock = threading.Lock()


def get_redis_client() -> Any:
    """Return this process's Redis client: for settings.REDIS_URL, or a RedisCluster over
    settings.REDIS_CLUSTER_NODES when that is set.

    Connect and socket timeouts are short so a hung Redis cannot hang checkout, and nothing is
    retried by the client: a command that may have run must not run twice, and the fallback
    decides what happens when Redis is down. A cluster client still follows MOVED and ASK
    redirections (the command did not run) and, after a connection error, reads the cluster's
    layout again, so that the next command finds the replica that took over.
    """
    nodes = tuple(settings.REDIS_CLUSTER_NODES)
    key = (os.getpid(), settings.REDIS_URL, nodes)
    client = _clients.get(key)
    if client is None:
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                options: dict[str, Any] = {
                    "socket_timeout": settings.REDIS_SOCKET_TIMEOUT,
                    "socket_connect_timeout": settings.REDIS_CONNECT_TIMEOUT,
                    "retry": Retry(NoBackoff(), 0),
                }
                if nodes:
                    try:
                        client = ShopCluster(startup_nodes=cluster_nodes(nodes), **options)
                    except RedisClusterException as exc:
                        raise _as_outage(exc) from exc
                else:
                    client = redis.Redis.from_url(settings.REDIS_URL, **options)
                _clients[key] = client
    return client


_lock_clients: dict[tuple[int, tuple[str, ...]], list[redis.Redis]] = {}


def get_lock_clients() -> list[redis.Redis]:
    """This process's clients of the quorum lock's masters (settings.REDIS_LOCK_URLS), built as
    the shop's own client is: short timeouts, no retries."""
    urls = tuple(settings.REDIS_LOCK_URLS)
    key = (os.getpid(), urls)
    clients = _lock_clients.get(key)
    if clients is None:
        with _clients_lock:
            clients = _lock_clients.get(key)
            if clients is None:
                clients = [
                    redis.Redis.from_url(
                        url,
                        socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
                        socket_connect_timeout=settings.REDIS_CONNECT_TIMEOUT,
                        retry=Retry(NoBackoff(), 0),
                    )
                    for url in urls
                ]
                _lock_clients[key] = clients
    return clients


def cluster_nodes(nodes: tuple[str, ...] | list[str]) -> list[ClusterNode]:
    """ClusterNodes from "host:port" strings; ImproperlyConfigured names a malformed one."""
    parsed = []
    for node in nodes:
        host, _, port = node.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ImproperlyConfigured(
                f"REDIS_CLUSTER_NODES: {node!r} is not host:port (e.g. 10.0.0.5:6379)"
            )
        parsed.append(ClusterNode(host, int(port)))
    return parsed


def ping() -> None:
    """PING the shop's Redis: on a cluster, every master, since each serves a part of the
    keys. Raises the errors of REDIS_DOWN_ERRORS when one does not answer."""
    client = get_redis_client()
    if isinstance(client, RedisCluster):
        client.ping(target_nodes=RedisCluster.PRIMARIES)
    else:
        client.ping()


def is_cluster() -> bool:
    """Whether the shop's Redis is a Redis Cluster."""
    return bool(settings.REDIS_CLUSTER_NODES)


#: What redis-py's cluster client raises, as a plain RedisClusterException, when it cannot read
#: the cluster's layout: no node answers, or the nodes disagree mid-failover.
_OUTAGES = (
    "Redis Cluster cannot be connected",
    "startup_nodes could not agree",
    "All slots are not covered",
)


def _as_outage(exc: RedisClusterException) -> Exception:
    if any(str(exc).startswith(text) for text in _OUTAGES):
        return redis.exceptions.ConnectionError(str(exc))
    return exc


class ShopCluster(RedisCluster):
    """A RedisCluster whose "cannot read the cluster's layout" errors are connection errors,
    as a single Redis that cannot be reached raises: the breaker and the fallback take them."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            outage = _as_outage(exc)
            if outage is exc:
                raise
            raise outage from exc
