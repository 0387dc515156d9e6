"""The contract every pitfall scenario implements, and what a run of one reports."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import redis

Variant = Literal["naive", "fixed"]
VARIANTS: tuple[Variant, ...] = ("naive", "fixed")

#: The articles the shop was built from (`seeds/`, Chinese), by the short name scenarios use.
ARTICLES = {
    "timeout": "Redis锁如何优雅解决超时问题 (how a Redis lock should handle timeouts)",
    "best-practice": "Redis分布式锁深度解析与最佳实践 (Redis distributed locks in depth)",
    "setnx-expire": "Redis分布式锁SETNX与EXPIRE组合的缺陷与解决 (the SETNX + EXPIRE flaw)",
    "own-lock": (
        "分布式锁自己写,不用Redssion,结果翻车了 (a hand-written lock that failed in production)"
    ),
    "pitfalls": "Redis分布式锁的几个坑 (the pitfalls of Redis distributed locks)",
}


@dataclass
class Event:
    """One thing a client did or saw, `at` milliseconds from the run's start."""

    at: float
    client: str
    what: str  # "acquired", "released", "refused", "crashed", "expired", ...
    detail: str = ""


@dataclass
class Outcome:
    """What one variant's run measured: `damage` on the scenario's measure (a count, seconds or
    a cost, lower is better), the figures behind it, and the timeline."""

    damage: float
    details: dict[str, Any] = field(default_factory=dict)
    timeline: list[Event] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """The run's clock and timeline, shared by its clients (threads): who held the lock when,
    and the most clients that believed at once that they held it."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self.events: list[Event] = []
        self._holding: set[str] = set()
        self.most_holders = 0

    def now_ms(self) -> float:
        return round(1000 * (time.monotonic() - self._start), 1)

    def note(self, client: str, what: str, detail: str = "") -> None:
        with self._lock:
            self.events.append(Event(self.now_ms(), client, what, detail))

    def acquired(self, client: str, detail: str = "") -> None:
        with self._lock:
            self.events.append(Event(self.now_ms(), client, "acquired", detail))
            self._holding.add(client)
            self.most_holders = max(self.most_holders, len(self._holding))

    def released(self, client: str, detail: str = "") -> None:
        with self._lock:
            self.events.append(Event(self.now_ms(), client, "released", detail))
            self._holding.discard(client)

    def holding(self) -> set[str]:
        """The clients that believe, now, that they hold the lock."""
        with self._lock:
            return set(self._holding)

    def outcome(self, damage: float, **details: Any) -> Outcome:
        with self._lock:
            return Outcome(damage, details, sorted(self.events, key=lambda event: event.at))


class RedisHost(Protocol):
    """The Redis a run has to itself (`shop.processes.redis_server.RedisServer`)."""

    @property
    def port(self) -> int: ...

    def client(self, **overrides: Any) -> redis.Redis:
        """A new client with connections of its own."""
        ...

    def kill(self) -> None:
        """SIGKILL the server (a scenario that shows a failover kills its primary)."""
        ...


class Scenario(ABC):
    """One failure mode the articles warn about, reproduced on demand.

    Contract of `run`:
    - it runs one variant: `naive`, the way the articles warn about, or `fixed`, the way the
      shop does it (the shop's own code: `locking.Lock`, its scripts);
    - on `redis_host`, a Redis of the run's own (the lab starts one per variant and throws it
      away), never the shop's; a scenario that needs more servers (a replica, other masters)
      starts them itself and stops them before it returns;
    - it forces the interleaving that does the damage (pauses, injected delays, a killed
      process), so that the same variant gives the same verdict every time;
    - it returns an Outcome whose `damage` is the scenario's `measure`: for a `damage` scenario,
      greater than 0 when the damage happened; for a `cost` scenario, a cost (lower is better).

    A damage scenario passes when its naive run shows damage and its fixed run none; a cost
    scenario when the fixed run costs at most a third of the naive one.
    """

    name: ClassVar[str]
    #: `damage` or `cost`.
    kind: ClassVar[str] = "damage"
    #: What `damage` counts, in a reader's words ("holders at once beyond one").
    measure: ClassVar[str]
    #: Which article (a key of ARTICLES) and its warning, in one line.
    article: ClassVar[str]
    warning: ClassVar[str]
    #: What goes wrong, and what the fix changes, in one line.
    explanation: ClassVar[str]
    #: Whether it sells through the shop's strategies, in the database (the command runs it in
    #: the load-run sandbox, beside the shop's database).
    needs_database: ClassVar[bool] = False

    @abstractmethod
    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        """Run `variant` against `redis_host` (empty at the start)."""
