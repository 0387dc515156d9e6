"""What one run measures: the contenders (strategies, peers, ceilings), the targets and
bounds they are held to, and what each buyer and each round reports."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

EVALSHA = "raw EVALSHA"
EVALSHA_SELL = "take + row sale (SQL)"
HOT_ROW = "hot row (SQL)"
#: `lua` and `segmented` with their buyers as the threads of a few processes: the checkouts in
#: flight in one process are written together (a process of one buyer writes batches of one).
LUA_BATCHED = "lua, batched"
SEGMENTED_BATCHED = "segmented, batched"
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
#: buys/s of `versus`, to reach at least the target; "fewest": `what`'s fewest share (the
#: fewest units a buyer got, over an even share) to reach at least the target, `versus`'s
#: printed beside it. Each strategy is held against the others, the peers, and the hot-row
#: ceiling measured in the same run (so no ratio is met by slowing a rival).
TARGETS = [
    (LUA_BATCHED, HOT_ROW, 2.0, "rate"),
    ("lock", HOT_ROW, 0.35, "rate"),
    ("segmented", "lock", 1.5, "rate"),
    ("lock", PYTHON_REDIS_LOCK, 1.0, "rate"),
    ("lock", REDIS_PY_DEFAULT, 0.8, "fewest"),
]
#: The target for `segmented` vs `lock` with --work-ms in the critical section.
WORK_TARGET = 5.0

#: (what, versus what): the bounds printed under the targets, for what the machine allows.
BOUNDS = [
    (LUA_BATCHED, "lua"),
    (SEGMENTED_BATCHED, "segmented"),
    ("lua", HOT_ROW),
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
    buyers: int | None = None  # buyers in all; None: --buyers
    #: Buyers per process: 1, a process each (a batch of one per checkout); more, threads of
    #: one process, whose checkouts in flight at once are written together.
    threads: int = 1
    #: Settings the buyer processes run with (a variant of a strategy).
    settings: dict[str, Any] = field(default_factory=dict)
    #: For a row of --crowds: the row it repeats with another crowd.
    of: str | None = None

    @property
    def batched(self) -> bool:
        return self.threads > 1

    @property
    def way(self) -> str:
        """The row whose way its buyers buy: its own, or the one it repeats (--crowds)."""
        return self.of or self.name


def at_crowd(name: str, buyers: int) -> str:
    """The label of `name`'s row repeated with a crowd of `buyers` (--crowds)."""
    return f"{name}, {buyers} buyers"


def warm_sku(contender: Contender) -> str:
    """The sale a contender's buyers warm up on (connections, prepared statements, caches)
    before the measured one starts."""
    return f"{contender.sku}-warm"


@dataclass
class BuyerReport:
    """What one buyer process saw: its threads' figures summed (each thread is a buyer)."""

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
    #: Seconds each sale took, from the first call for its unit to the sale (the busy answers
    #: and retries between them included).
    sale_seconds: list[float] = field(default_factory=list)
    #: Units each of its threads sold: one per buyer.
    thread_sold: list[int] = field(default_factory=list)


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
    #: Bytes the PostgreSQL server wrote to its write-ahead log per unit sold (each commit's
    #: rows, index entries and the pages first changed since the last checkpoint, written whole).
    wal_bytes_per_buy: float | None = None
    #: Time one sale took, from the buyer's first call for its unit to the sale: median and
    #: 99th percentile.
    p50_ms: float | None = None
    p99_ms: float | None = None
    #: ... its 99.9th percentile and the longest: the tail a p99 leaves out when under 1% of
    #: the sales hold most of the buyers' waiting (a lock whose waiters sleep).
    p999_ms: float | None = None
    longest_ms: float | None = None
    #: The fewest units any one buyer sold, over an even share (sold / buyers): 1.0 when every
    #: buyer got its turn alike, 0 when one never did. A p99 over the sales made hides the
    #: buyer that made none.
    fewest_share: float | None = None
    #: For a batched contender: the sale's orders per commit (`batch_statement.sell_batch`
    #: stamps the orders of one batch with one `created_at`).
    units_per_commit: float | None = None
    audit: dict[str, Any] = field(default_factory=dict)
    #: With --profile: milliseconds per unit sold spent in each phase, all buyers together.
    phases_ms_per_buy: dict[str, float] = field(default_factory=dict)
    #: What else the round showed (units per commit), printed under its line.
    notes: list[str] = field(default_factory=list)

    @property
    def broken(self) -> bool:
        """A contender that must not oversell did, or left the database, shards and Redis
        disagreeing."""
        return self.safe and (self.oversold > 0 or not self.consistent)


# -- the whole run ---------------------------------------------------------------------------


def contenders_for(args: argparse.Namespace) -> list[Contender]:
    """The run's contenders, in their order: the strategies, a process per buyer; `lua` and
    `segmented` batched (buyers as threads of --batch-threads a process, whose checkouts in
    flight are written together); `lock` and `segmented` with --work-ms of simulated work in
    each critical section (where the lock, not the CPU, limits `lock`: the case for shards);
    the peer locks, each run inside `lock`'s own code with only the lock swapped
    (`loadtest.peer_locks`); the ceilings: the raw EVALSHA of the stock take (Redis alone),
    `lua`'s take then the sale statement on the stripe it names, and the hot row (the sale
    statement alone on the item row: the most any design that has every buyer write one row
    gets)."""
    from inventory.strategies import oversells

    contenders = [
        Contender(
            name,
            "strategy",
            f"bench-{name}",
            safe=not oversells(name),
            strategy=name,
            # A process per buyer: one script and one commit per sale; batched has a row of
            # its own.
        )
        for name in args.strategies
    ]
    contenders += [
        Contender(
            label,
            "strategy",
            f"bench-{name}-batched",
            strategy=name,
            threads=args.batch_threads,
        )
        for name, label in (("lua", LUA_BATCHED), ("segmented", SEGMENTED_BATCHED))
        if name in args.strategies
    ]
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
    return contenders + _crowds(args)


def batch_processes(args: argparse.Namespace) -> int:
    """The buyer processes of the batched rows: --buyers in processes of --batch-threads."""
    return math.ceil(args.buyers / args.batch_threads)


def _crowds(args: argparse.Namespace) -> list[Contender]:
    """`lua, batched` and the hot row again for each crowd of --crowds: the batched row as
    many processes as at --buyers, the crowd spread over their threads; the hot row a process
    a buyer (docs/decisions/0033-the-ratio-is-a-function-of-the-crowd.md)."""
    processes = batch_processes(args)
    rows = []
    for crowd in args.crowds:
        if "lua" in args.strategies:
            rows.append(
                Contender(
                    at_crowd(LUA_BATCHED, crowd),
                    "strategy",
                    f"bench-lua-batched-{crowd}",
                    strategy="lua",
                    buyers=crowd,
                    threads=math.ceil(crowd / processes),
                    of=LUA_BATCHED,
                )
            )
        rows.append(
            Contender(
                at_crowd(HOT_ROW, crowd),
                "ceiling",
                f"bench-ceiling-hot-row-{crowd}",
                buyers=crowd,
                of=HOT_ROW,
            )
        )
    return rows
