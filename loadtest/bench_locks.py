"""The lock alone: our lock and the peer locks, with no database and no Django.

    python -m loadtest.bench_locks [--buyers 8] [--duration 3] [--hold-ms 0.5]
        [--outside-ms 0 0.3 1] [--locks ours,redis-py,redis-py-5ms,python-redis-lock]

Needs REDIS_URL. --buyers processes loop, for --duration seconds a row: --outside-ms of CPU work
of their own (what a checkout does outside the lock), acquire, --hold-ms inside (about one sale
statement), release. Invariant held: each holder also reads a counter and writes it back plus
one, so a lock that ever let two holders in loses an update; the run counts them and exits 1 if
any was lost. What it shows: a lock that hands itself to the next waiter (ours) keeps the
critical section busy while the releaser works outside it, at one wake-up a hand-over; one whose
waiters poll lets the releaser take it again at once. See docs/benchmarks.md#the-lock-alone and
docs/decisions/0004-lock-hands-itself-to-the-longest-waiter.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from locking import Lock

LOCKS = ["ours", "redis-py", "redis-py-5ms", "python-redis-lock"]
TTL_SECONDS = 5.0
WAIT_SECONDS = 5.0


@dataclass
class Row:
    outside_ms: float
    lock: str
    acquisitions: int = 0
    per_second: float = 0.0
    wait_p50_ms: float = 0.0
    wait_p99_ms: float = 0.0
    wait_max_ms: float = 0.0
    #: Acquisitions of the busiest process over the mean: 1.0 is even, --buyers is one taking all.
    busiest_share: float = 0.0
    lost_updates: int = 0
    timeouts: int = 0
    errors: list[str] = field(default_factory=list)


def make_lock(kind: str, client: redis.Redis, name: str) -> Any:
    """A lock object with acquire()/release(), as each library is used out of the box."""
    if kind == "ours":
        return Lock(client, name, timeout=TTL_SECONDS, blocking_timeout=WAIT_SECONDS, watchdog=True)
    if kind in ("redis-py", "redis-py-5ms"):
        sleep = 0.1 if kind == "redis-py" else 0.005
        return client.lock(name, timeout=TTL_SECONDS, sleep=sleep, blocking_timeout=WAIT_SECONDS)
    if kind == "python-redis-lock":
        import redis_lock

        return _PythonRedisLock(redis_lock.Lock(client, name, expire=int(TTL_SECONDS)))
    raise ValueError(f"unknown lock {kind!r}; choose from {', '.join(LOCKS)}")


class _PythonRedisLock:
    """python-redis-lock with redis-py's acquire signature (its timeout is whole seconds)."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def acquire(self) -> bool:
        return self._lock.acquire(blocking=True, timeout=int(WAIT_SECONDS))

    def release(self) -> None:
        self._lock.release()


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def _buyer(
    url: str,
    kind: str,
    name: str,
    args: argparse.Namespace,
    outside_ms: float,
    start: Any,
    out: Any,
) -> None:
    waits: list[float] = []
    timeouts = 0
    error = None
    try:
        client = redis.Redis.from_url(url)
        counter = f"{name}:counter"
        start.wait()
        deadline = time.monotonic() + args.duration
        while time.monotonic() < deadline:
            _spin(outside_ms)
            lock = make_lock(kind, client, name)
            asked = time.perf_counter()
            if not lock.acquire():
                timeouts += 1
                continue
            waits.append(time.perf_counter() - asked)
            try:
                seen = int(client.get(counter) or 0)
                time.sleep(args.hold_ms / 1000)
                client.set(counter, seen + 1)
            finally:
                lock.release()
    except Exception as exc:  # reported in the row, and fails the run
        error = f"{type(exc).__name__}: {exc}"
    out.put((waits, timeouts, error))


def run_row(url: str, kind: str, outside_ms: float, args: argparse.Namespace) -> Row:
    name = f"{args.prefix}:{uuid.uuid4().hex[:8]}:{kind}"
    client = redis.Redis.from_url(url)
    context = multiprocessing.get_context("fork")
    start, out = context.Barrier(args.buyers + 1), context.Queue()
    buyers = [
        context.Process(target=_buyer, args=(url, kind, name, args, outside_ms, start, out))
        for _ in range(args.buyers)
    ]
    for process in buyers:
        process.start()
    start.wait()
    began = time.monotonic()
    reports = [out.get(timeout=args.duration + WAIT_SECONDS + 30) for _ in buyers]
    elapsed = time.monotonic() - began
    for process in buyers:
        process.join()
    waits = sorted(w for report in reports for w in report[0])
    row = Row(outside_ms=outside_ms, lock=kind)
    row.acquisitions = len(waits)
    row.per_second = len(waits) / elapsed
    row.timeouts = sum(report[1] for report in reports)
    row.errors = [report[2] for report in reports if report[2]]
    if waits:
        row.wait_p50_ms = 1000 * statistics.median(waits)
        row.wait_p99_ms = 1000 * waits[min(len(waits) - 1, int(len(waits) * 0.99))]
        row.wait_max_ms = 1000 * waits[-1]
        row.busiest_share = max(len(report[0]) for report in reports) / (len(waits) / len(reports))
    row.lost_updates = row.acquisitions - int(client.get(f"{name}:counter") or 0)
    client.delete(f"{name}:counter")
    return row


def print_rows(rows: list[Row]) -> None:
    header = (
        f"{'outside ms':>10}  {'lock':<18} {'acq/s':>7} {'vs peer':>8} "
        f"{'p50 wait ms':>12} {'p99 wait ms':>12} {'max wait ms':>12} {'busiest':>8} "
        f"{'lost':>5} {'timeouts':>8}"
    )
    print(header)
    print("-" * len(header))
    for outside in sorted({row.outside_ms for row in rows}):
        group = [row for row in rows if row.outside_ms == outside]
        peers = [row.per_second for row in group if row.lock != "ours"]
        best = max(peers, default=0.0)
        for row in group:
            ratio = f"{row.per_second / best:.2f}x" if row.lock == "ours" and best else ""
            print(
                f"{outside:>10g}  {row.lock:<18} {row.per_second:>7.0f} {ratio:>8} "
                f"{row.wait_p50_ms:>12.2f} {row.wait_p99_ms:>12.1f} {row.wait_max_ms:>12.1f} "
                f"{row.busiest_share:>7.1f}x {row.lost_updates:>5} {row.timeouts:>8}"
            )
    print(
        "\nvs peer: ours over the fastest peer lock at the same outside work. busiest: "
        "acquisitions of the busiest process over the mean (1.0x: even; the number of "
        "processes: one took them all). lost: updates a second holder overwrote (must be 0)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_locks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--buyers", type=int, default=8, help="processes (8)")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per row (3)")
    parser.add_argument(
        "--hold-ms", type=float, default=0.5, help="wait inside the critical section (0.5)"
    )
    parser.add_argument(
        "--outside-ms",
        type=float,
        nargs="+",
        default=[0.0, 0.3, 1.0],
        help="CPU work per round outside the lock, one row group each (0 0.3 1)",
    )
    parser.add_argument("--locks", default=",".join(LOCKS), help=f"({','.join(LOCKS)})")
    parser.add_argument("--prefix", default="bench-locks", help="Redis key prefix (bench-locks)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    locks = [name.strip() for name in args.locks.split(",") if name.strip()]
    unknown = sorted(set(locks) - set(LOCKS))
    if unknown:
        parser.error(f"unknown lock(s) {', '.join(unknown)}; choose from {', '.join(LOCKS)}")
    if args.buyers < 1 or args.duration <= 0 or args.hold_ms < 0:
        parser.error("--buyers must be >= 1, --duration > 0 and --hold-ms >= 0")
    if any(ms < 0 for ms in args.outside_ms):
        parser.error("--outside-ms must be >= 0")
    url = os.environ.get("REDIS_URL")
    if not url:
        parser.error("REDIS_URL is not set (or run it through `python -m shop.devservices --`)")
    print(
        f"{args.buyers} processes, {args.duration:g} s per row, {args.hold_ms:g} ms held, "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    rows = []
    for outside in args.outside_ms:
        for kind in locks:
            row = run_row(url, kind, outside, args)
            print(f"  outside {outside:g} ms: {kind:<18} {row.per_second:7.0f} acq/s", flush=True)
            rows.append(row)
    print()
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(row) for row in rows], handle, indent=2)
    failed = [row for row in rows if row.lost_updates or row.errors]
    for row in failed:
        print(f"FAILED {row.lock} (outside {row.outside_ms:g} ms): {row}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
