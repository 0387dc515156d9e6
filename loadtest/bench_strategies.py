"""Benchmark without HTTP: every strategy driven directly by buyer processes on one hot item.

    python -m loadtest.bench_strategies [--buyers 8] [--stock 2000] [--duration 10]
        [--strategies lock,segmented,lua,optimistic,unsafe] [--hold-ms 0] [--work-ms 5]
        [--rounds 1] [--peers redis-py,redis-py-5ms,python-redis-lock,python-redis-lock-renewal]
        [--ceiling-stock 50000] [--profile] [--json PATH]

Needs DATABASE_URL and REDIS_URL (or run it through `python -m shop.devservices --`).

For each contender a sale of --stock units starts, --buyers processes fork, wait at a barrier,
and buy one unit at a time through `inventory.services.place_order` until it answers sold out
(`Busy` is counted and retried). buys/s is units sold over the time from the barrier to the last
sale. Contenders, all in one run so that every figure has its baseline measured beside it:

- the strategies themselves;
- `lock` and `segmented` again with --work-ms of simulated work inside each critical section
  (a call to another service, say), where the lock rather than the CPU limits `lock`: the case
  that shards are for;
- peers: redis-py's `redis.lock.Lock` and python-redis-lock's `redis_lock.Lock` running the very
  code of the `lock` strategy (`LockStrategy.take`: its pre-check, the guarded sale statement,
  its release), with only the lock object swapped: the buyer processes set
  FLASHSALE_LOCK_FACTORY (the seam through which the strategies build their locks) to a
  factory of `loadtest/peer_locks.py`, so nothing but the lock differs. Same TTL and wait as
  ours (FLASHSALE_LOCK_TTL_MS / FLASHSALE_LOCK_WAIT_MS); redis-py with its default poll `sleep`
  of 0.1 s and with 0.005 s; python-redis-lock without and with `auto_renewal` (the
  counterpart of our watchdog, which `lock` runs with);
- ceilings: `EVALSHA` of the check-and-DECRBY script of `locking.StockCounter.take` in a loop
  (Redis alone, no database: what a counter in Redis sells if Redis is its only cost);
  `lua`'s take script over its stripe counters followed by the sale statement of
  `inventory.stock.sell` on the stripe it names (the least a `lua` checkout can do while
  committing its order row before it answers); and the hot row: the sale statement alone on
  the item row, no Redis, no lock, no service code (the most any design that writes one row
  per sale for every buyer can reach: the ceiling the strategies are held against).

After each contender the sale is audited (`inventory.selectors.audit_sale`). The run exits 1 if
any contender that should be safe (all but `unsafe`) oversold, is inconsistent or crashed, and 0
otherwise: the targets are measurements, printed as met or missed.

Beside buys/s each row shows where the CPU went, per unit sold: the buyer processes (Python,
Django, redis-py, psycopg), their PostgreSQL backends (read from /proc when PostgreSQL runs on
this machine) and the Redis server (INFO cpu, the whole server), plus how busy the host's CPUs
were while the contender ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import django

EVALSHA = "raw EVALSHA"
EVALSHA_SELL = "take + row sale (SQL)"
HOT_ROW = "hot row (SQL)"
#: `lua` with FLASHSALE_GROUP_COMMIT switched on or off (the other way than configured).
LUA_GROUPED = "lua, group commit"
LUA_UNGROUPED = "lua, commit per sale"
#: Row labels of the peers the lock targets name.
PYTHON_REDIS_LOCK = "python-redis-lock"
REDIS_PY_DEFAULT = "redis-py Lock sleep=0.1"


@dataclass(frozen=True)
class Peer:
    """Another project's Redis lock, run inside the `lock` strategy's code."""

    name: str
    label: str
    #: What FLASHSALE_LOCK_FACTORY names in the buyer processes (loadtest/peer_locks.py).
    factory: str


PEERS = {
    peer.name: peer
    for peer in [
        Peer("redis-py", REDIS_PY_DEFAULT, "loadtest.peer_locks.redis_py"),
        Peer("redis-py-5ms", "redis-py Lock sleep=0.005", "loadtest.peer_locks.redis_py_5ms"),
        Peer("python-redis-lock", PYTHON_REDIS_LOCK, "loadtest.peer_locks.python_redis_lock"),
        Peer(
            "python-redis-lock-renewal",
            "python-redis-lock renewal",
            "loadtest.peer_locks.python_redis_lock_renewal",
        ),
    ]
}

#: (what, versus what, target, measure) for the printed targets. "rate": buys/s of `what` over
#: buys/s of `versus`, to reach at least the target; "p99": `what`'s p99 time per sale over
#: `versus`'s, to stay at or under it. Each strategy is held against the others, the peers,
#: and the hot-row ceiling measured in the same run (so no ratio is met by slowing a rival).
TARGETS = [
    ("lua", HOT_ROW, 2.0, "rate"),
    ("lock", HOT_ROW, 0.35, "rate"),
    ("segmented", "lock", 1.5, "rate"),
    ("lock", PYTHON_REDIS_LOCK, 1.0, "rate"),
    ("lock", REDIS_PY_DEFAULT, 0.2, "p99"),
]
#: The target for `segmented` vs `lock` with --work-ms in the critical section.
WORK_TARGET = 5.0

#: (what, versus what): the bounds printed under the targets, for what the machine allows.
BOUNDS = [
    ("lua", EVALSHA_SELL),
    (EVALSHA_SELL, HOT_ROW),
]


def with_work(name: str, work_ms: int) -> str:
    """The row label of a strategy run with work_ms of simulated work in its critical section."""
    return f"{name} +{work_ms} ms work"


@dataclass
class Contender:
    name: str  # the row's label
    kind: str  # "strategy", "peer" or "ceiling"
    sku: str
    safe: bool = True
    peer: Peer | None = None
    strategy: str | None = None  # for kind "strategy": the strategy it runs
    hold_ms: int | None = None  # simulated work in the critical section; None: --hold-ms
    buyers: int | None = None  # buyer processes; None: --buyers
    #: Settings the buyer processes run with (a variant of a strategy).
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuyerReport:
    """What one buyer process saw."""

    sold: int = 0
    busy: int = 0
    started_at: float = 0.0
    last_sale_at: float | None = None
    capped: bool = False
    error: str | None = None
    cpu_seconds: float = 0.0
    backend_cpu_seconds: float | None = None
    #: With --profile: seconds spent per phase, summed over the process's checkouts.
    timings: dict[str, float] = field(default_factory=dict)
    #: Seconds each sale took, from the call to its return (refusals and busy answers aside).
    sale_seconds: list[float] = field(default_factory=list)


@dataclass
class Result:
    contender: str
    kind: str
    round: int
    buyers: int
    stock: int
    sold: int
    busy: int
    seconds: float
    buys_per_second: float
    capped: bool
    errors: list[str]
    accepted_units: int
    oversold: int
    remaining: int
    consistent: bool
    safe: bool
    client_cpu_ms_per_buy: float | None
    postgres_cpu_ms_per_buy: float | None
    redis_cpu_ms_per_buy: float | None
    host_cpu_busy: float | None
    #: Time one sale took, from the buyer's call to its return: median and 99th percentile.
    p50_ms: float | None = None
    p99_ms: float | None = None
    audit: dict[str, Any] = field(default_factory=dict)
    #: With --profile: milliseconds per unit sold spent in each phase, all buyers together.
    phases_ms_per_buy: dict[str, float] = field(default_factory=dict)

    @property
    def broken(self) -> bool:
        """A contender that must not oversell did, or left the database, shards and Redis
        disagreeing."""
        return self.safe and (self.oversold > 0 or not self.consistent)


# -- command line -------------------------------------------------------------------------


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return number


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.replace(",", " ").split() if name.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_strategies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--buyers", type=_positive, default=8, help="buyer processes (8)")
    parser.add_argument("--stock", type=_positive, default=2000, help="units per sale (2000)")
    parser.add_argument(
        "--duration", type=_positive_float, default=10.0, help="cap per contender, seconds (10)"
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=[],
        help="strategies to run, space- or comma-separated (default: every strategy)",
    )
    parser.add_argument(
        "--hold-ms",
        type=int,
        default=0,
        help="simulated work inside each critical section, ms (FLASHSALE_HOLD_DELAY_MS; 0)",
    )
    parser.add_argument(
        "--work-ms",
        type=int,
        default=5,
        help="also run lock and segmented with this much simulated work in each critical "
        "section (a call to another service, say): there the lock, not the CPU, limits `lock`, "
        "which is what shards are for (5; 0 skips them)",
    )
    parser.add_argument(
        "--work-buyers",
        type=_positive,
        default=10,
        help="buyer processes for the --work-ms rows: more buyers than shards, so that the "
        "shards, not the crowd, are what runs out (10)",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=list(PEERS),
        help=f"peer locks to run ({', '.join(PEERS)}); none with an empty list",
    )
    parser.add_argument(
        "--ceiling-stock",
        type=_positive,
        default=50000,
        help="units the raw EVALSHA ceiling sells: more than --stock, so that its far higher "
        "rate is measured over a long enough time (50000)",
    )
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=1,
        help="run every contender this many times, in rotating order; report medians (1)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also time, in the buyer processes, the phases that serialize checkouts (lock "
        "wait and hold, the item row's UPDATE and hold, commit, publish) and print them",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    args.strategies = [name for value in args.strategies for name in _names(value)]
    args.peers = [name for value in args.peers for name in _names(value)]
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        parser.error(f"unknown peers: {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    if args.hold_ms < 0:
        parser.error("--hold-ms must be 0 or more")
    if args.work_ms < 0:
        parser.error("--work-ms must be 0 or more")
    return args


# -- measurements of the host --------------------------------------------------------------


def _host_cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def _process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU of another process on this host (a PostgreSQL backend), or None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _redis_cpu_seconds() -> float | None:
    from inventory.redis_client import get_redis_client

    try:
        info = get_redis_client().info("cpu")
    except Exception:
        return None
    return float(info.get("used_cpu_user", 0)) + float(info.get("used_cpu_sys", 0))


# -- where the time goes (--profile) ----------------------------------------------------------


class _Probe:
    """Times, inside one buyer process, the phases that can serialize checkouts.

    - lock wait / lock held: from asking for the Redis lock (item lock, shard lock, or a peer's
      lock: whatever `inventory.strategies.plumbing.acquire_lock` is handed) to getting it, and
      from getting it to its release;
    - sale write: the one statement of `inventory.stock.sell` (guarded decrements, order row,
      commit), which waits for the item row while another sale holds it;
    - publish: handing the order to the order publisher after commit.

    Wrappers only: the strategies' code runs unchanged.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def install(self) -> None:
        from django.db import connection

        import inventory.services as services
        import inventory.strategies.lock as lock_strategy
        import inventory.strategies.segmented as segmented_strategy

        connection.ensure_connection()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(connection.execute_wrapper(self._execute))
        services.order_placed = self._timed(services.order_placed, "publish")
        acquire = self._timed_acquire(lock_strategy.acquire_lock)
        release = self._timed_release(lock_strategy.release_quietly)
        for module in (lock_strategy, segmented_strategy):
            setattr(module, "acquire_lock", acquire)  # noqa: B010 - the profile's wrappers
            setattr(module, "release_quietly", release)  # noqa: B010

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

    def _timed_release(self, release: Callable[[Any], None]) -> Callable[[Any], None]:
        def timed(lock: Any) -> None:
            try:
                release(lock)
            finally:
                acquired_at = getattr(lock, "bench_acquired_at", None)
                if acquired_at is not None:
                    self.add("lock held", time.perf_counter() - acquired_at)

        return timed


#: How the statement of `inventory.stock.sell` starts (and no other statement of a checkout).
_SALE_WRITE = "WITH "

#: The --profile columns: (phase, heading).
PROFILE_PHASES = [
    ("lock wait", "lock wait"),
    ("lock held", "lock held"),
    ("sale write", "sale write"),
    ("publish", "publish"),
]


# -- buyer processes ------------------------------------------------------------------------


def _backend_pid() -> int | None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def _buy_through_place_order(sku: str, label: str, worker: int) -> Callable[[], bool]:
    """One checkout of one unit through the service; True when sold, False when sold out."""
    from inventory.exceptions import SoldOut
    from inventory.services import place_order

    serial = iter(range(10**9))

    def buy() -> bool:
        try:
            place_order(sku=sku, qty=1, buyer=f"{label}-{worker}-{next(serial)}")
        except SoldOut:
            return False
        return True

    return buy


def _sell_directly(sku: str, label: str, worker: int, served_by: str) -> Callable[[], bool]:
    """One sale statement of `inventory.stock.sell` (guarded UPDATE of the item row, order
    INSERT, commit), called directly: no service, no Redis, no lock."""
    from inventory.models import Item
    from inventory.stock import sell, simulate_work

    item = Item.objects.get(sku=sku)
    serial = iter(range(10**9))

    def buy() -> bool:
        simulate_work()
        sold = sell(item=item, qty=1, buyer=f"{label}-{worker}-{next(serial)}", served_by=served_by)
        return sold is not None

    return buy


def _buy_from_hot_row(sku: str, label: str, worker: int) -> Callable[[], bool]:
    """The hot-row ceiling: the sale statement alone."""
    return _sell_directly(sku, label, worker, "optimistic")


def _buy_by_evalsha_and_sell(sku: str, label: str, worker: int) -> Callable[[], bool]:
    """The durable floor of `lua`: its take script (one EVALSHA over the sale's stripe
    counters), then the sale statement on the stripe it names, and nothing else."""
    from inventory import keys
    from inventory.models import Item
    from inventory.stock import sell
    from inventory.strategies import plumbing

    item = Item.objects.get(sku=sku)
    counter = plumbing.counter()
    counters, cursor = keys.rows(item), keys.turn(item)
    serial = iter(range(10**9))

    def buy() -> bool:
        plan = counter.take_spread(cursor, counters, 1)
        if plan is None:
            raise RuntimeError(f"the stripe counters of {sku} are missing")
        if not plan:
            return False
        buyer = f"{label}-{worker}-{next(serial)}"
        return sell(item=item, qty=1, buyer=buyer, served_by="lua", shard_units=plan) is not None

    return buy


def _buy_by_evalsha(key: str) -> Callable[[], bool]:
    """The Redis ceiling: the check-and-DECRBY script of StockCounter.take, nothing else."""
    from inventory.redis_client import get_redis_client
    from locking import scripts

    client = get_redis_client()
    sha = client.script_load(scripts.STOCK_TAKE)

    def buy() -> bool:
        left = int(client.evalsha(sha, 1, key, 1))
        if left == -2:
            raise RuntimeError(f"counter {key} is missing")
        return left >= 0

    return buy


def _buyer(
    contender: Contender,
    worker: int,
    duration: float,
    profile: bool,
    barrier: Any,
    reports: Any,
) -> None:
    """Body of one buyer process: connect, wait for the others, buy until sold out or capped."""
    from inventory.exceptions import Busy

    report = BuyerReport()
    backend_pid = None
    probe = _Probe() if profile else None
    try:
        from inventory.redis_client import get_redis_client

        get_redis_client().ping()
        from django.conf import settings

        for name, value in contender.settings.items():
            setattr(settings, name, value)
        if contender.hold_ms is not None:
            settings.FLASHSALE_HOLD_DELAY_MS = contender.hold_ms
        if contender.peer is not None:
            # The seam the strategies build their locks through: nothing else differs.
            settings.FLASHSALE_LOCK_FACTORY = contender.peer.factory
        if contender.name == EVALSHA:
            buy = _buy_by_evalsha(contender.sku)
        else:
            backend_pid = _backend_pid()
            if contender.name == HOT_ROW:
                buy = _buy_from_hot_row(contender.sku, contender.sku, worker)
            elif contender.name == EVALSHA_SELL:
                buy = _buy_by_evalsha_and_sell(contender.sku, contender.sku, worker)
            else:
                buy = _buy_through_place_order(contender.sku, contender.sku, worker)
            if probe is not None:
                probe.install()
    except BaseException:
        barrier.abort()
        report.error = traceback.format_exc(limit=4)
        reports.put((worker, asdict(report)))
        return

    backend_cpu = _process_cpu_seconds(backend_pid) if backend_pid else None
    cpu = time.process_time()
    try:
        barrier.wait(120)
        report.started_at = time.monotonic()
        deadline = report.started_at + duration
        while True:
            if time.monotonic() >= deadline:
                report.capped = True
                break
            called = time.perf_counter()
            try:
                if not buy():
                    break
            except Busy:
                report.busy += 1
                continue
            report.sale_seconds.append(time.perf_counter() - called)
            report.sold += 1
            report.last_sale_at = time.monotonic()
    except BaseException:
        report.error = traceback.format_exc(limit=6)
    report.cpu_seconds = time.process_time() - cpu
    if probe is not None:
        report.timings = probe.seconds
    if backend_cpu is not None and backend_pid is not None:
        after = _process_cpu_seconds(backend_pid)
        report.backend_cpu_seconds = None if after is None else after - backend_cpu
    reports.put((worker, asdict(report)))


# -- one contender ---------------------------------------------------------------------------


def _prepare(contender: Contender, stock: int, ceiling_stock: int) -> None:
    from inventory.redis_client import get_redis_client
    from inventory.services import start_sale

    if contender.name == EVALSHA:
        get_redis_client().set(contender.sku, ceiling_stock)
    elif contender.name == HOT_ROW:
        start_sale(sku=contender.sku, stock=stock, strategy="optimistic", name="Bench hot row")
    elif contender.name == EVALSHA_SELL:
        start_sale(sku=contender.sku, stock=stock, strategy="lua", name="Bench take + row sale")
    else:
        strategy = contender.strategy if contender.kind == "strategy" else "lock"
        start_sale(sku=contender.sku, stock=stock, strategy=strategy, name=f"Bench {strategy}")


def _audit(contender: Contender, stock: int, sold: int) -> dict[str, Any]:
    if contender.name == EVALSHA:
        from inventory.redis_client import get_redis_client

        client = get_redis_client()
        raw = client.get(contender.sku)
        client.delete(contender.sku)
        left = None if raw is None else int(raw)
        return {
            "initial_stock": stock,
            "accepted_units": sold,
            "oversold": max(0, sold - stock),
            "remaining": left,
            "consistent": left is not None and left == stock - sold and left >= 0,
        }
    from inventory.selectors import audit_sale

    return audit_sale(contender.sku)


def run_contender(contender: Contender, args: argparse.Namespace, round_: int) -> Result:
    from django.db import connections

    stock = args.ceiling_stock if contender.name == EVALSHA else args.stock
    _prepare(contender, args.stock, args.ceiling_stock)
    # Children open their own connections: a connection shared across fork is corrupted.
    connections.close_all()

    context = multiprocessing.get_context("fork")
    buyer_count = contender.buyers or args.buyers
    barrier = context.Barrier(buyer_count + 1)
    reports = context.Queue()
    processes = [
        context.Process(
            target=_buyer,
            args=(contender, worker, args.duration, args.profile, barrier, reports),
            name=f"buyer-{contender.sku}-{worker}",
        )
        for worker in range(buyer_count)
    ]
    for process in processes:
        process.start()

    gathered: dict[int, dict[str, Any]] = {}
    host_before = redis_before = None
    started_at = time.monotonic()
    try:
        barrier.wait(120)
        started_at = time.monotonic()
        host_before = _host_cpu_times()
        redis_before = _redis_cpu_seconds()
    except threading.BrokenBarrierError:
        pass  # a buyer failed to start: its report says why
    wait_limit = args.duration + 2 * _lock_wait_seconds() + 60
    try:
        while len(gathered) < buyer_count:
            worker, report = reports.get(
                timeout=max(1.0, started_at + wait_limit - time.monotonic())
            )
            gathered[worker] = report
    except queue.Empty:
        pass  # the missing buyers are reported below
    host_after = _host_cpu_times()
    redis_after = _redis_cpu_seconds()
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()

    buyers = [BuyerReport(**gathered[worker]) for worker in sorted(gathered)]
    errors = [report.error for report in buyers if report.error]
    missing = buyer_count - len(buyers)
    if missing:
        errors.append(f"{missing} buyer process(es) reported nothing")
    sold = sum(report.sold for report in buyers)
    start = min([started_at, *(report.started_at for report in buyers if report.started_at)])
    ends = [report.last_sale_at for report in buyers if report.last_sale_at]
    seconds = (max(ends) - start) if ends else 0.0
    audit = _audit(contender, stock, sold)

    def per_buy(total: float | None) -> float | None:
        return None if total is None or not sold else 1000 * total / sold

    backend = [report.backend_cpu_seconds for report in buyers]
    host_busy = None
    if host_before and host_after and host_after[1] > host_before[1]:
        host_busy = (host_after[0] - host_before[0]) / (host_after[1] - host_before[1])
    redis_cpu = None
    if redis_before is not None and redis_after is not None:
        redis_cpu = redis_after - redis_before
    durations = sorted(seconds for report in buyers for seconds in report.sale_seconds)
    phases: dict[str, float] = {}
    for report in buyers:
        for phase, phase_seconds in report.timings.items():
            phases[phase] = phases.get(phase, 0.0) + phase_seconds
    return Result(
        contender=contender.name,
        kind=contender.kind,
        round=round_,
        buyers=buyer_count,
        stock=stock,
        sold=sold,
        busy=sum(report.busy for report in buyers),
        seconds=seconds,
        buys_per_second=sold / seconds if seconds > 0 else 0.0,
        capped=any(report.capped for report in buyers),
        errors=errors,
        accepted_units=audit["accepted_units"],
        oversold=audit["oversold"],
        remaining=audit["remaining"],
        consistent=bool(audit["consistent"]),
        safe=contender.safe,
        client_cpu_ms_per_buy=per_buy(sum(report.cpu_seconds for report in buyers)),
        postgres_cpu_ms_per_buy=None
        if contender.name == EVALSHA or None in backend or not backend
        else per_buy(sum(seconds or 0.0 for seconds in backend)),
        redis_cpu_ms_per_buy=per_buy(redis_cpu),
        host_cpu_busy=host_busy,
        p50_ms=_percentile_ms(durations, 0.50),
        p99_ms=_percentile_ms(durations, 0.99),
        audit={key: value for key, value in audit.items() if key != "orders_by_status"},
        phases_ms_per_buy={phase: 1000 * total / sold for phase, total in phases.items()}
        if sold
        else {},
    )


def _percentile_ms(ordered: list[float], share: float) -> float | None:
    """The share-th quantile of ordered durations (nearest rank), in milliseconds."""
    if not ordered:
        return None
    return 1000 * ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def _lock_wait_seconds() -> float:
    from django.conf import settings

    return settings.FLASHSALE_LOCK_WAIT_MS / 1000


# -- the whole run ---------------------------------------------------------------------------


def _group_commit() -> bool:
    from django.conf import settings

    return settings.FLASHSALE_GROUP_COMMIT


def contenders_for(args: argparse.Namespace) -> list[Contender]:
    from inventory.strategies import oversells

    contenders = [
        Contender(name, "strategy", f"bench-{name}", safe=not oversells(name), strategy=name)
        for name in args.strategies
    ]
    if "lua" in args.strategies:
        # lua with its group commit switched the other way: what sharing commits buys.
        grouped = not _group_commit()
        contenders.append(
            Contender(
                LUA_GROUPED if grouped else LUA_UNGROUPED,
                "strategy",
                "bench-lua-variant",
                strategy="lua",
                settings={"FLASHSALE_GROUP_COMMIT": grouped},
            )
        )
    if args.work_ms:
        contenders += [
            Contender(
                with_work(name, args.work_ms),
                "strategy",
                f"bench-{name}-work",
                strategy=name,
                hold_ms=args.work_ms,
                buyers=args.work_buyers,
            )
            for name in ("lock", "segmented")
            if name in args.strategies
        ]
    contenders += [
        Contender(PEERS[name].label, "peer", f"bench-peer-{name}", peer=PEERS[name])
        for name in args.peers
    ]
    contenders.append(Contender(EVALSHA, "ceiling", ""))
    contenders.append(Contender(EVALSHA_SELL, "ceiling", "bench-ceiling-evalsha-sale"))
    contenders.append(Contender(HOT_ROW, "ceiling", "bench-ceiling-hot-row"))
    return contenders


def _median_row(results: list[Result]) -> Result:
    """The round with the median rate (the lower one of the two middle rounds)."""
    ranked = sorted(results, key=lambda result: result.buys_per_second)
    return ranked[(len(ranked) - 1) // 2]


def ratios(rows: dict[str, Result], work_ms: int = 0) -> list[dict[str, Any]]:
    """The targets (with `segmented` vs `lock` also under --work-ms), then the bounds."""
    pairs: list[tuple[str, str, float | None, str]] = list(TARGETS)
    if work_ms:
        pairs.insert(
            3, (with_work("segmented", work_ms), with_work("lock", work_ms), WORK_TARGET, "rate")
        )
    pairs += [(name, versus, None, "rate") for name, versus in BOUNDS]
    pairs += [
        ("lua", variant, None, "rate")
        for variant in (LUA_GROUPED, LUA_UNGROUPED)
        if variant in rows
    ]
    checks = []
    for name, versus, target, measure in pairs:
        row, versus_row = rows.get(name), rows.get(versus)
        check: dict[str, Any] = {
            "what": name,
            "versus": versus,
            "target": target,
            "measure": measure,
        }
        if measure == "p99":
            if row is not None and versus_row is not None and row.p99_ms and versus_row.p99_ms:
                check["ratio"] = row.p99_ms / versus_row.p99_ms
                check["met"] = check["ratio"] <= target
        elif row is not None and versus_row is not None and versus_row.buys_per_second:
            check["ratio"] = row.buys_per_second / versus_row.buys_per_second
            if target is not None:
                check["met"] = check["ratio"] >= target
        checks.append(check)
    return checks


def _format(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Result], rounds: int) -> None:
    label = "median of " + str(rounds) + " rounds" if rounds > 1 else "one round"
    print(f"\nresults ({label}; cpu in ms per unit sold):")
    header = (
        f"{'contender':<27} {'buys/s':>7} {'sold':>6} {'busy':>5} {'oversold':>8} "
        f"{'remaining':>9} {'consistent':>10} {'cpu py':>7} {'cpu pg':>7} {'cpu redis':>9} "
        f"{'host cpu':>8} {'p50 ms':>7} {'p99 ms':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        note = " (capped)" if row.capped else ""
        note += " ERRORS" if row.errors else ""
        print(
            f"{row.contender:<27} {row.buys_per_second:>7.0f} {row.sold:>6} {row.busy:>5} "
            f"{row.oversold:>8} {_format(row.remaining, 'd'):>9} "
            f"{'yes' if row.consistent else 'NO':>10} "
            f"{_format(row.client_cpu_ms_per_buy, '.2f'):>7} "
            f"{_format(row.postgres_cpu_ms_per_buy, '.2f'):>7} "
            f"{_format(row.redis_cpu_ms_per_buy, '.3f'):>9} "
            f"{_format(None if row.host_cpu_busy is None else 100 * row.host_cpu_busy, '.0f'):>7}%"
            f" {_format(row.p50_ms, '.2f'):>7} {_format(row.p99_ms, '.1f'):>7}{note}"
        )


def print_profile(rows: list[Result]) -> None:
    """Where the time goes, per unit sold, in milliseconds of buyer time (all buyers together:
    a phase that serializes checkouts cannot take more than 1000 / buys/s of it)."""
    print(
        "\nwhere the time goes (--profile), ms per unit sold summed over the buyers; "
        "'serial' = 1000 / buys/s, the time one unit takes when units are sold one at a time:"
    )
    header = f"{'contender':<27} {'serial':>7} {'checkout':>8}" + "".join(
        f" {heading:>9}" for _, heading in PROFILE_PHASES
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if not row.phases_ms_per_buy:
            continue
        serial = 1000 / row.buys_per_second if row.buys_per_second else None
        checkout = 1000 * row.buyers * row.seconds / row.sold if row.sold else None
        cells = "".join(
            f" {_format(row.phases_ms_per_buy.get(phase), '.2f'):>9}" for phase, _ in PROFILE_PHASES
        )
        print(
            f"{row.contender:<27} {_format(serial, '.2f'):>7} {_format(checkout, '.2f'):>8}{cells}"
        )
    print(
        "checkout: buyer time per unit sold (buyers x seconds / units). A phase close to 'serial' "
        "is where checkouts queue: the lock held, or the sale write (the item row is locked "
        "from its UPDATE to the commit that ends the statement)."
    )


def print_ratios(checks: list[dict[str, Any]]) -> None:
    print("\ntargets (buys/s ratios, and p99 time per sale where marked):")
    bounds = False
    for check in checks:
        if check["target"] is None and not bounds:
            bounds = True
            print(
                "bounds (what this machine allows: lua against its least possible work, a take "
                "plus the sale statement on a stock row; that against the hot row, the sale "
                "statement alone on the item row):"
            )
        if "ratio" not in check:
            print(f"  {check['what']} vs {check['versus']}: not measured in this run")
            continue
        what = check["what"] + (" p99" if check["measure"] == "p99" else "")
        line = f"  {what:<24} vs {check['versus']:<27} {check['ratio']:>6.2f}x"
        if check["target"] is not None:
            verdict = "met" if check["met"] else "MISSED"
            sign = "<=" if check["measure"] == "p99" else ">="
            line += f"  (target {sign} {check['target']:.2f}x): {verdict}"
        print(line)


def _check_database() -> str | None:
    """Apply missing migrations; a message when the database cannot be used."""
    from django.core.management import call_command
    from django.db import DEFAULT_DB_ALIAS, OperationalError, connections
    from django.db.migrations.executor import MigrationExecutor

    try:
        connection = connections[DEFAULT_DB_ALIAS]
        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except OperationalError as exc:
        return f"cannot reach the database named by DATABASE_URL: {exc}"
    if plan:
        print(f"applying {len(plan)} migration(s) to the benchmark database")
        call_command("migrate", verbosity=0, interactive=False)
    return None


def _delete_task_queue(queue: str) -> None:
    """Drop the private queue the checkouts published their order tasks to."""
    from shop.celery import app

    try:
        with app.connection_for_write() as connection:
            # Declared first: a channel deletes only the bindings it knows of.
            bound = app.amqp.queues[queue](connection.default_channel)
            bound.declare()
            bound.delete()
    except Exception as exc:  # the broker may be down; the checkouts then published nothing
        print(f"note: could not delete the task queue {queue} ({exc})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.exceptions import ImproperlyConfigured

    try:
        django.setup()
    except ImproperlyConfigured as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from django.conf import settings

    from inventory.strategies import strategy_names

    args.strategies = args.strategies or strategy_names()
    unknown = sorted(set(args.strategies) - set(strategy_names()))
    if unknown:
        print(f"error: unknown strategies: {', '.join(unknown)}", file=sys.stderr)
        return 2
    from loadtest import sandbox

    if not sandbox.active():
        # Its items and orders stay out of the shop's database: start again in the sandbox.
        try:
            sandbox.enter(
                ["-m", "loadtest.bench_strategies", *(sys.argv[1:] if argv is None else argv)]
            )
        except sandbox.SandboxError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    problem = _check_database()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    # Import in the parent what the buyers use, so that every fork starts warm.
    import redis.lock  # noqa: F401
    import redis_lock  # noqa: F401

    import inventory.services  # noqa: F401
    import inventory.strategies.lock  # noqa: F401
    from inventory.keys import key as redis_key
    from shop.celery import app

    settings.FLASHSALE_HOLD_DELAY_MS = args.hold_ms
    # Order tasks go to a queue of this run's own, dropped at the end: no worker of the shop
    # picks up orders of a benchmark, and nothing piles up in the shop's queue.
    queue = redis_key("bench", os.getpid(), "orders")
    app.conf.task_default_queue = queue

    contenders = contenders_for(args)
    for contender in contenders:
        if contender.name == EVALSHA:
            contender.sku = redis_key("bench", "ceiling", "evalsha", os.getpid())
    print(
        f"{len(contenders)} contenders, {args.rounds} round(s): {args.buyers} buyer processes, "
        f"{args.stock} units each (raw EVALSHA: {args.ceiling_stock}), cap {args.duration:g} s, "
        f"hold {args.hold_ms} ms, lock TTL {settings.FLASHSALE_LOCK_TTL_MS} ms, "
        f"{os.cpu_count()} CPUs"
    )
    results: dict[str, list[Result]] = {contender.name: [] for contender in contenders}
    try:
        for round_ in range(args.rounds):
            shift = round_ % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                print(f"  round {round_ + 1}: {contender.name:<27}", end=" ", flush=True)
                result = run_contender(contender, args, round_)
                results[contender.name].append(result)
                print(
                    f"{result.buys_per_second:>7.0f} buys/s in {result.seconds:.2f} s"
                    + (" ERRORS" if result.errors else ""),
                    flush=True,
                )
                for error in result.errors:
                    print(f"    {error.rstrip()}", file=sys.stderr)
    finally:
        _delete_task_queue(queue)

    rows = [_median_row(results[contender.name]) for contender in contenders]
    print_table(rows, args.rounds)
    if args.profile:
        print_profile(rows)
    by_name = {row.contender: row for row in rows}
    checks = ratios(by_name, args.work_ms)
    print_ratios(checks)
    print(
        "\nbuys/s: units sold / seconds from the start barrier to the last sale. cpu py: the "
        "buyer processes; cpu pg: their PostgreSQL backends; cpu redis: the whole Redis server; "
        "host cpu: all CPUs of this machine, anything else running included. p50/p99 ms: how "
        "long one sale took a buyer (a lock that lets its waiters sleep can sell fast and still "
        "keep some buyers waiting long)."
    )

    broken = sorted(
        {result.contender for runs in results.values() for result in runs if result.broken}
    )
    crashed = sorted(
        {result.contender for runs in results.values() for result in runs if result.errors}
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "parameters": {
                        "buyers": args.buyers,
                        "stock": args.stock,
                        "duration": args.duration,
                        "hold_ms": args.hold_ms,
                        "work_ms": args.work_ms,
                        "rounds": args.rounds,
                        "ceiling_stock": args.ceiling_stock,
                        "profile": args.profile,
                        "lock_ttl_ms": settings.FLASHSALE_LOCK_TTL_MS,
                        "lock_wait_ms": settings.FLASHSALE_LOCK_WAIT_MS,
                        "cpus": os.cpu_count(),
                    },
                    "results": [asdict(result) for runs in results.values() for result in runs],
                    "medians": {row.contender: row.buys_per_second for row in rows},
                    "targets": checks,
                    "broken": broken,
                    "crashed": crashed,
                },
                indent=2,
            )
            + "\n"
        )
    if broken:
        print(f"INVARIANT BROKEN by: {', '.join(broken)}", file=sys.stderr)
    if crashed:
        print(f"buyer processes failed in: {', '.join(crashed)}", file=sys.stderr)
    return 1 if broken or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
