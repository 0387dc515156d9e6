"""Measurements of the host and, with --profile, of where a buyer's time goes."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

# -- measurements of the host --------------------------------------------------------------


def host_cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the process's name (the state first), or None when
    there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU of another process on this host (a PostgreSQL backend), or None."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu_seconds() -> float | None:
    """User + system CPU of the Redis server; of every node, summed, on a cluster."""
    from inventory.redis_client import get_redis_client, is_cluster

    client = get_redis_client()
    try:
        if is_cluster():
            nodes = client.info("cpu", target_nodes=client.ALL_NODES).values()
        else:
            nodes = [client.info("cpu")]
    except Exception:
        return None
    return sum(
        float(info.get("used_cpu_user", 0)) + float(info.get("used_cpu_sys", 0)) for info in nodes
    )


def wal_position() -> int | None:
    """How many bytes the PostgreSQL server has written to its write-ahead log so far (every
    database of the server, anything writing to it counted), or None where it cannot say (a
    standby, an error)."""
    from django.db import DatabaseError, connection

    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
            return int(cursor.fetchone()[0])
    except DatabaseError:
        return None


# -- where the time goes (--profile) ----------------------------------------------------------


class Probe:
    """Times, inside one buyer process, the phases that can serialize checkouts.

    - lock wait / lock held: from asking for the Redis lock (item lock, shard lock, or a peer's
      lock: whatever `inventory.strategies.locks.acquire_lock` is handed) to getting it, and
      from getting it to its release;
    - sale write: the one statement of `inventory.sale_statement.sell` (guarded decrements,
      order row, commit), which waits for the item row while another sale holds it;
    - publish: handing the order to the order publisher after commit.

    Wrappers only: the strategies' code runs unchanged. `install` once per process, then
    `watch_connection` in each buyer thread (Django's connections are the thread's own).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._adding = threading.Lock()
        self._watching: list[contextlib.ExitStack] = []

    def add(self, phase: str, seconds: float) -> None:
        with self._adding:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def install(self) -> None:
        import inventory.services as services
        import inventory.strategies.lock as lock_strategy
        import inventory.strategies.segmented as segmented_strategy

        services.order_placed = self._timed(services.order_placed, "publish")
        acquire = self._timed_acquire(lock_strategy.acquire_lock)
        release = self._timed_release(lock_strategy.release_quietly)
        for module in (lock_strategy, segmented_strategy):
            setattr(module, "acquire_lock", acquire)  # noqa: B010 - the profile's wrappers
            setattr(module, "release_quietly", release)  # noqa: B010

    def watch_connection(self) -> None:
        """Time the sale statements sent on the calling thread's connection."""
        from django.db import connection

        connection.ensure_connection()
        stack = contextlib.ExitStack()
        stack.enter_context(connection.execute_wrapper(self._execute))
        self._watching.append(stack)

    def _execute(self, execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        """Django's execute_wrapper hook: args are params, many, context."""
        started = time.perf_counter()
        try:
            return execute(sql, *args)
        finally:
            if sql.startswith(_SALE_WRITE):
                self.add("sale write", time.perf_counter() - started)

    def _timed(self, function: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - started)

        return timed

    def _timed_acquire(self, acquire: Callable[..., bool]) -> Callable[..., bool]:
        def timed(lock: Any, **options: Any) -> bool:
            started = time.perf_counter()
            acquired = False
            try:
                acquired = acquire(lock, **options)
                return acquired
            finally:
                ended = time.perf_counter()
                self.add("lock wait", ended - started)
                if acquired:
                    lock.bench_acquired_at = ended

        return timed

    def _timed_release(self, release: Callable[..., None]) -> Callable[..., None]:
        def timed(lock: Any, **options: Any) -> None:
            try:
                release(lock, **options)
            finally:
                acquired_at = getattr(lock, "bench_acquired_at", None)
                if acquired_at is not None:
                    self.add("lock held", time.perf_counter() - acquired_at)

        return timed


#: How the sale statement (`inventory.sale_statement`) starts, and no other of a checkout's.
_SALE_WRITE = "WITH "

#: The --profile columns: (phase, heading).
PROFILE_PHASES = [
    ("lock wait", "lock wait"),
    ("lock held", "lock held"),
    ("sale write", "sale write"),
    ("publish", "publish"),
]


def percentile_ms(ordered: list[float], share: float) -> float | None:
    """The share-th quantile of ordered durations (nearest rank), in milliseconds."""
    if not ordered:
        return None
    return 1000 * ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def lock_wait_allowed_seconds() -> float:
    from django.conf import settings

    return settings.FLASHSALE_LOCK_WAIT_MS / 1000
