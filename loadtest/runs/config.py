"""What a batch of load runs is asked to do (`LoadRunSettings`, checked before anything runs;
`LoadRunRequest`, what the compare page sends its worker), where it tells how it goes
(`Progress`), and the error of a run that could not be measured.
See docs/load-runs.md#options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, Required, TypedDict

from inventory.exceptions import InvalidRequest
from inventory.strategies import strategy_names
from shop.processes.servers import GRANIAN_THREADS, GRANIAN_WORKERS, SERVER_KINDS

#: Seconds a sale's orders may take to settle after it sold out before the batch goes on.
SETTLE_TIMEOUT = 30.0
#: Beyond its spawning, the crowd's first half second (connections opening, the opening's
#: burst) is not yet its steady pace.
CROWD_SETTLE_SECONDS = 0.5
#: Without --duration, a sale is cut off after this many times the time a sized stock lasts
#: at the probe's pace (the crowd's ramp and `headroom` windows): a sale may be this much
#: slower than its probe and still sell out.
CAP_FACTOR = 2


class Progress(Protocol):
    """Where a batch tells how it goes: a line at a time; `live` lines say how the run under way
    is going now, each superseding the one before (a terminal shows them in place)."""

    def __call__(self, line: str, *, live: bool = False) -> None: ...


def print_progress(line: str, *, live: bool = False) -> None:
    print(line)


class LoadRunError(Exception):
    """A run that could not be measured; its message says why and where to look."""


class LoadRunRequest(TypedDict, total=False):
    """The load run the compare page's form asks for, sent to `run_load_batch_task` through the
    broker (JSON): `LoadRunSettings`' fields of the same names; a field left out (a blank in
    the form) keeps its default."""

    strategies: Required[list[str]]
    stock: int
    users: int
    spawn_rate: float
    window: float
    duration: int


@dataclass
class LoadRunSettings:
    strategies: list[str]
    #: Units per sale; None: sized by a probe so that the sale sells through the window.
    stock: int | None = None
    users: int = 40
    spawn_rate: float = 100.0
    #: Seconds each sale must still be selling once the crowd is in: what units/s measures.
    window: float = 10.0
    #: At most this many seconds of sale from the opening; None: see CAP_FACTOR.
    duration: int | None = None
    host: str | None = None
    out: Path | None = None
    workers: int = 1
    qty: int = 1
    server_workers: int = GRANIAN_WORKERS
    #: How long to wait, after each sale, for the worker to settle its orders (None: no wait).
    settle_timeout: float | None = SETTLE_TIMEOUT
    warmup: float | None = None
    #: A sized stock lasts window x headroom at the probe's pace: room for a faster sale.
    headroom: float = 1.5
    unsafe_delay_ms: int = 5
    #: The server started here (`shop.processes.servers.SERVER_KINDS`), and its threads per
    #: worker where it has threads.
    server: str = "granian"
    server_threads: int = GRANIAN_THREADS
    extra_env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise InvalidRequest saying what is wrong; nothing has run yet."""
        unknown = sorted(set(self.strategies) - set(strategy_names()))
        if not self.strategies:
            raise InvalidRequest("name at least one strategy")
        if unknown:
            raise InvalidRequest(
                f"unknown strategies: {', '.join(unknown)}; "
                f"choose from {', '.join(strategy_names())}"
            )
        if len(set(self.strategies)) != len(self.strategies):
            raise InvalidRequest("a strategy is named twice")
        checks = [
            (self.stock is None or 1 <= self.stock <= 10**7, "stock: from 1 to 10000000"),
            (1 <= self.users <= 10_000, "users: from 1 to 10000"),
            (0 < self.spawn_rate <= 10_000, "spawn rate: above 0, at most 10000"),
            (1 <= self.window <= 600, "window: from 1 to 600 seconds"),
            (
                self.duration is None or 3 <= self.duration <= 3600,
                "duration: from 3 to 3600 seconds",
            ),
            (1 <= self.workers <= 64, "workers: from 1 to 64"),
            (1 <= self.qty <= 100, "qty: from 1 to 100"),
            (1 <= self.server_workers <= 64, "server workers: from 1 to 64"),
            (self.server in SERVER_KINDS, f"server: one of {', '.join(SERVER_KINDS)}"),
            (1 <= self.server_threads <= 64, "server threads: from 1 to 64"),
            (self.warmup is None or 0 <= self.warmup <= 60, "warmup: from 0 to 60 seconds"),
            (1 <= self.headroom <= 10, "headroom: from 1 to 10"),
            (0 <= self.unsafe_delay_ms <= 10_000, "unsafe delay: from 0 to 10000 ms"),
            (
                self.settle_timeout is None or 0 <= self.settle_timeout <= 3600,
                "settle timeout: from 0 to 3600 seconds",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)
        if self.host is not None and not self.host.startswith(("http://", "https://")):
            raise InvalidRequest("host: a URL such as http://127.0.0.1:8000")

    def command_line(self) -> list[str]:
        """The `manage.py loadtest` arguments that run these settings."""
        if self.extra_env:
            raise ValueError("extra_env has no command-line form")
        arguments = ["--strategies", ",".join(self.strategies)]
        for setting in fields(self):
            value = getattr(self, setting.name)
            if setting.name in ("strategies", "extra_env") or value in (None, setting.default):
                continue
            option = setting.name.replace("_", "-")
            if isinstance(value, bool):
                arguments.append(f"--{option}" if value else f"--no-{option}")
                continue
            arguments += [f"--{option}", str(value)]
        return arguments

    @property
    def warmup_seconds(self) -> float:
        """The trickle of early visitors before the sale opens and the crowd buys."""
        return self.warmup if self.warmup is not None else 1.0

    @property
    def ramp_seconds(self) -> float:
        """From the crowd's first order until it is all in and at its pace."""
        return self.users / self.spawn_rate + CROWD_SETTLE_SECONDS

    @property
    def probe_seconds(self) -> float:
        """How long a probe measures, once its crowd is in."""
        return min(3.0, max(1.5, self.window / 2))

    @property
    def cap_seconds(self) -> int:
        """The longest a sale lasts from its opening, sold out or not."""
        if self.duration is not None:
            return self.duration
        return math.ceil(CAP_FACTOR * (self.ramp_seconds + self.headroom * self.window))

    @property
    def baseline_seconds(self) -> float:
        """How long the baseline floods /api/noop, the crowd's ramp included."""
        return self.ramp_seconds + min(self.window, 5.0, self.cap_seconds)

    def parameters(self) -> dict[str, Any]:
        """The settings as a SaleRun records them."""
        return {
            "stock": self.stock,
            "stock_sizing": "fixed" if self.stock is not None else "probe",
            "users": self.users,
            "spawn_rate": self.spawn_rate,
            "window": self.window,
            "duration": self.cap_seconds,
            "headroom": self.headroom if self.stock is None else None,
            "qty": self.qty,
            "workers": self.workers,
            "host": self.host or f"local {self.server}",
            "server_workers": None if self.host else self.server_workers,
            "server": None if self.host else self.server,
            "server_threads": None if self.host else self.server_threads,
            "warmup": self.warmup_seconds,
            "strategies": self.strategies,
        }
