"""Lock waiters and connections: a crowd of lock waiters in one process, with and without the
process's wake hub (`locking.wakes`). No database, no Django.

    python -m loadtest.bench_waiters [--waiters 1000] [--pool 8] [--rounds 3] [--json PATH]

Needs REDIS_URL. Each round, for each way of waiting (`MODES`): a holder takes one lock,
--waiters threads queue for it, the holder lets go, and each waiter, handed the lock, lets it go
at once, so the lock passes down the whole queue. It counts this process's connections to Redis
while they wait (`CLIENT LIST`), times each hand-over (from one release sent to the next
acquire returning) and the process's CPU per hand-over. Invariant held: the wake hub hands the
lock down the whole queue in the order the waiters queued, or the run exits 1.
See docs/benchmarks.md#lock-waiters-and-connections.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import redis

from locking import Lock, WakeHubLock
from locking.wakes import hub_for

#: The ways of waiting. `own wakes`: each waiter blocks in BLPOP on a wake key of its own, on a
#: connection of its own (a pool big enough for all). `own wakes, bounded pool`: the same with a
#: BlockingConnectionPool of --pool connections and a 1 s wait for one, what a deployment that
#: caps its connections gets. `wake hub`: the waiters wait through the hub (one list, one
#: connection of its own) and run their short scripts on a pool of --pool connections.
MODES = ["own wakes", "own wakes, bounded pool", "wake hub"]
TTL_SECONDS = 5.0
WAIT_SECONDS = 120.0


@dataclass
class Row:
    mode: str
    waiters: int
    connections: int = 0
    handovers: int = 0
    seconds: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    cpu_ms_per_handover: float = 0.0
    in_queue_order: bool = False
    failures: list[str] = field(default_factory=list)


def _client(url: str, mode: str, waiters: int, pool_size: int, name: str) -> redis.Redis:
    if mode == "own wakes":
        # (redis-py's pools stop at 100 connections unless told otherwise)
        return redis.Redis.from_url(url, client_name=name, max_connections=waiters + 10)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=pool_size, timeout=1.0, client_name=name
    )
    return redis.Redis(connection_pool=pool)


def _connections(admin: redis.Redis, name: str) -> int:
    return sum(1 for entry in admin.client_list() if entry.get("name") == name)


def run_round(url: str, mode: str, waiters: int, pool_size: int, prefix: str) -> Row:
    row = Row(mode=mode, waiters=waiters)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(url)
    client = _client(url, mode, waiters, pool_size, name)
    hub_prefix = f"{prefix}:wakes" if mode == "wake hub" else None
    lock_name = f"{name}:lock"
    holder = Lock(client, lock_name, timeout=TTL_SECONDS)
    assert holder.acquire(blocking=False), "the round's lock is free"
    tokens = [uuid.uuid4().hex.encode() for _ in range(waiters)]
    # (token, acquired at, release sent at): the release script hands the lock on, so a
    # hand-over is timed from the moment its release is sent
    granted: list[tuple[bytes, float, float]] = []
    record = threading.Lock()

    def wait(token: bytes) -> None:
        lock = (
            Lock(client, lock_name, timeout=TTL_SECONDS)
            if hub_prefix is None
            else WakeHubLock(client, lock_name, timeout=TTL_SECONDS, hub_prefix=hub_prefix)
        )
        try:
            if not lock.acquire(blocking_timeout=WAIT_SECONDS, token=token):
                with record:
                    row.failures.append("timed out")
                return
            acquired = time.perf_counter()
            releasing = time.perf_counter()
            lock.release()
            with record:
                granted.append((token, acquired, releasing))
        except redis.RedisError as exc:
            with record:
                row.failures.append(type(exc).__name__)

    threads = [threading.Thread(target=wait, args=(token,), daemon=True) for token in tokens]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while admin.llen(f"{lock_name}:queue") + len(row.failures) < waiters:
        if time.monotonic() > deadline:
            row.failures.append("not all queued within 60 s")
            break
        time.sleep(0.01)
    time.sleep(0.2)
    row.connections = _connections(admin, name)
    queued = admin.lrange(f"{lock_name}:queue", 0, -1)
    cpu = time.process_time()
    started = time.perf_counter()
    try:
        holder.release()
    except redis.RedisError as exc:  # a bounded pool the waiters have drained
        row.failures.append(f"holder: {type(exc).__name__}")
    for thread in threads:
        thread.join(WAIT_SECONDS + 10)
    row.seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    granted.sort(key=lambda grant: grant[1])
    previous_release = started
    gaps = []
    for _, acquired, releasing in granted:
        gaps.append((acquired - previous_release) * 1000)
        previous_release = releasing
    row.handovers = len(granted)
    if gaps:
        gaps.sort()
        row.p50_ms = statistics.median(gaps)
        row.p99_ms = gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))]
        row.max_ms = gaps[-1]
        row.cpu_ms_per_handover = cpu * 1000 / len(gaps)
    row.in_queue_order = [token for token, _, _ in granted] == queued and len(queued) == waiters
    if hub_prefix is not None:
        hub_for(client, hub_prefix).close()
    client.close()
    admin.close()
    return row


def median_row(rows: list[Row]) -> Row:
    merged = Row(mode=rows[0].mode, waiters=rows[0].waiters)
    for name in ("connections", "handovers", "seconds", "p50_ms", "p99_ms", "max_ms"):
        setattr(merged, name, statistics.median(getattr(row, name) for row in rows))
    merged.cpu_ms_per_handover = statistics.median(row.cpu_ms_per_handover for row in rows)
    merged.in_queue_order = all(row.in_queue_order for row in rows)
    merged.failures = [failure for row in rows for failure in row.failures]
    return merged


def print_rows(rows: list[Row], baseline: str = "own wakes") -> None:
    header = (
        f"{'mode':<26} {'waiters':>7} {'conns':>6} {'handed':>7} {'seconds':>8} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'cpu ms':>7} {'in order':>8} {'failed':>6}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.mode:<26} {row.waiters:>7} {row.connections:>6.0f} {row.handovers:>7.0f} "
            f"{row.seconds:>8.2f} {row.p50_ms:>7.3f} {row.p99_ms:>7.2f} {row.max_ms:>7.1f} "
            f"{row.cpu_ms_per_handover:>7.3f} {'yes' if row.in_queue_order else 'NO':>8} "
            f"{len(row.failures):>6}"
        )
    by_mode = {row.mode: row for row in rows}
    base, hub = by_mode.get(baseline), by_mode.get("wake hub")
    if base and hub and base.p99_ms and base.connections:
        print(
            f"\nwake hub vs {baseline}: connections {hub.connections / base.connections:.3f}x, "
            f"hand-over p99 {hub.p99_ms / base.p99_ms:.2f}x, "
            f"CPU per hand-over {hub.cpu_ms_per_handover / base.cpu_ms_per_handover:.2f}x"
        )
    print(
        "(conns: this process's connections to Redis while every waiter waits; handed: "
        "hand-overs that happened; p50/p99/max: from one holder sending its release to the "
        "next one's acquire returning; cpu ms: this process's CPU per hand-over; in order: "
        "the lock went down the queue in the order the waiters queued; failed: waiters that "
        "timed out or raised)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_waiters",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--waiters", type=int, default=1000, help="waiting threads (1000)")
    parser.add_argument("--pool", type=int, default=8, help="connections of the bounded pools (8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode; medians (3)")
    parser.add_argument("--prefix", default="bench-waiters", help="Redis key prefix")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.waiters < 1 or args.pool < 1 or args.rounds < 1:
        parser.error("--waiters, --pool and --rounds must be >= 1")
    url = os.environ.get("REDIS_URL")
    if not url:
        parser.error("REDIS_URL is not set (or run it through `python -m shop.devservices --`)")
    print(f"{args.waiters} waiters in one process, pools of {args.pool}, {os.cpu_count()} CPUs")
    results: dict[str, list[Row]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        # each round starts from another mode, so no mode always runs on a cold server
        for mode in MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]:
            row = run_round(url, mode, args.waiters, args.pool, args.prefix)
            results[mode].append(row)
            print(
                f"  round {round_ + 1}: {mode:<26} {row.connections} connections, "
                f"p99 {row.p99_ms:.2f} ms, {len(row.failures)} failed",
                flush=True,
            )
    rows = [median_row(results[mode]) for mode in MODES]
    print()
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(row) for row in rows], handle, indent=2)
    # The hub must hand the lock down the whole queue, in order; the bounded pool without it
    # may fail (what the hub is for), which is reported, not an error of the run.
    hub = next(row for row in rows if row.mode == "wake hub")
    return 0 if hub.in_queue_order and not hub.failures else 1


if __name__ == "__main__":
    sys.exit(main())
