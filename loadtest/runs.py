"""Load runs: flood each strategy with Locust, audit it, record a SaleRun, write the report.

A batch measures, in one go and under the same settings: a baseline (the same Locust crowd
against /api/noop, the server's HTTP ceiling), then each strategy in turn. Every figure of a
strategy is stated next to the baseline measured alongside it, because this kind of machine
is noisy and only side-by-side figures mean something.

A strategy's run measures selling, then sells out:

1. the probe (unless the stock is fixed): a sale of more units than it can sell, flooded by
   the whole crowd for a few seconds; the rate at which its stock went down, once the crowd was
   in, sizes the real sale's stock to last the window and some headroom;
2. the sale: a trickle of early visitors, the opening, the crowd. Its **window** starts once the
   crowd is in (the first order, plus the time the crowd takes to spawn and settle) and lasts
   `window` seconds, or less if the stock ran out first, which the run records (`held`);
   units/s is the units accepted in it per second;
3. the drain: the crowd buys what is left until the shop answers sold out (or the cap), and the
   audit must find nothing left and nothing oversold. The order worker runs throughout, as in
   production: it pays and confirms orders while the next runs sell; the audit counts pending
   orders as accepted (payments do not fail here), so it need not wait for the worker.

Where the figures live, beside SaleRun's own fields: `goodput` is the window's units/s;
`audit` holds the sale's audit plus `window`, `lost_updates` (units accepted beyond what the
stock went down by) and `sold_out_answers`, and `missing`: each figure the run could not
measure and why (a Locust slow to start or stopped early writes its files late, in part or
not at all: they are read for what they hold, and a run never fails for want of its history);
`parameters` holds the settings, the sale's stock and, when it was sized, the `probe` that
sized it.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from django.conf import settings
from django.db.models import Sum
from django.utils import timezone

from inventory.exceptions import InvalidRequest
from inventory.models import LIVE_STATUSES, Item, Order
from inventory.orders import OPEN_STATUSES
from inventory.selectors import audit_sale
from inventory.services import start_sale
from inventory.strategies import oversells, strategy_names
from shop import queues
from shop.processes.children import die_with_parent
from shop.processes.servers import (
    GRANIAN_THREADS,
    GRANIAN_WORKERS,
    PROJECT_DIR,
    SERVER_KINDS,
    CeleryWorker,
    ShopServer,
)

from .bench.measure import percentile_ms, stat_fields
from .cpu import CpuMeter, per_unit
from .models import SaleRun
from .report.columns import BASELINE, summary_line
from .report.files import write_report

logger = logging.getLogger(__name__)

#: Seconds a sale's orders may take to settle after it sold out before the batch goes on.
SETTLE_TIMEOUT = 30.0

LOCUSTFILE = PROJECT_DIR / "loadtest" / "locustfile.py"
#: Locust exit code for a run whose audit found oversell (see the locustfile).
OVERSOLD_EXIT_CODE = 3
HTTP_TYPES = {"GET", "POST"}
#: Stats name of the checkouts answered sold out (see the locustfile).
SOLD_OUT_NAME = "checkout sold out"
#: Units of a probe sale: more than any strategy sells in a probe, so it never sells out.
PROBE_STOCK = 1_000_000
#: Beyond its spawning, the crowd's first half second (connections opening, the opening's
#: burst) is not yet its steady pace.
CROWD_SETTLE_SECONDS = 0.5
#: About how long Locust takes to start; a sale opens after this and the warm-up. Only a guess
#: to open the sale by: a Locust slower to start (a busy host, a cold bytecode cache) finds the
#: sale open, and its files are read only once and as far as it has written them.
LOCUST_START_SECONDS = 1.5
#: Seconds between two looks at a running Locust: the live line, and the run's figures so far.
PROGRESS_SECONDS = 2.0
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


@dataclass
class Batch:
    batch: str
    out: Path
    runs: list[SaleRun]
    files: dict[str, Path]


def sale_sku(strategy: str) -> str:
    """The item a load run of strategy sells (restarted by every run)."""
    return f"loadtest-{strategy}"


#: What `new_batch_id` makes (and `manage.py loadtest --batch` takes).
BATCH_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{4}")


def new_batch_id() -> str:
    return f"{timezone.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:4]}"


def run_batch(
    config: LoadRunSettings, *, progress: Progress = print_progress, batch: str | None = None
) -> Batch:
    """Run the baseline and every strategy; record, report and return the runs."""
    config.validate()
    batch = batch or new_batch_id()
    out = Path(config.out or settings.FLASHSALE_REPORTS_DIR / batch)
    out.mkdir(parents=True, exist_ok=True)
    end_orphaned_runs(progress)
    with _target(config, batch, out, progress) as (host, parts, queue):
        progress(f"batch {batch}: {host}, reports in {out}")
        runs = _run_batch(config, batch, host, parts, queue, out, progress)
    # Written once the processes started for the batch have stopped: a report on disk says
    # the batch is over.
    return Batch(batch=batch, out=out, runs=runs, files=write_report(runs, out))


#: The most rounds one load run makes.
MAX_ROUNDS = 10


def run_rounds(
    config: LoadRunSettings, rounds: int, *, progress: Progress = print_progress
) -> list[Batch]:
    """Run the batch `rounds` times over, on the same server: each round a batch of its own
    (the baseline, then every strategy), recorded and reported in a folder of its own
    (round-1, round-2, ... in the load run's folder). On a noisy machine the median of the
    rounds, and each round's own ratios, say more than one batch can.

    Each round starts one contender further on (round 2 with the first strategy, the baseline
    last), as the benchmark's rounds do: a machine that speeds up or slows down over the
    minutes a round lasts then favours no contender in every round by its place."""
    config.validate()
    if not 1 <= rounds <= MAX_ROUNDS:
        raise InvalidRequest(f"rounds: from 1 to {MAX_ROUNDS}")
    first = new_batch_id()
    out = Path(config.out or settings.FLASHSALE_REPORTS_DIR / first)
    out.mkdir(parents=True, exist_ok=True)
    measured: list[tuple[str, Path, list[SaleRun]]] = []
    end_orphaned_runs(progress)
    with _target(config, first, out, progress) as (host, parts, queue):
        for number in range(1, rounds + 1):
            batch = first if number == 1 else new_batch_id()
            folder = out / f"round-{number}"
            order = ", ".join(_running_order(config.strategies, number - 1))
            progress(
                f"round {number} of {rounds} ({order}), batch {batch}: {host}, reports in {folder}"
            )
            runs = _run_batch(config, batch, host, parts, queue, folder, progress, shift=number - 1)
            measured.append((batch, folder, runs))
    # Written once the processes started for the rounds have stopped, as run_batch does.
    return [
        Batch(batch=batch, out=folder, runs=runs, files=write_report(runs, folder))
        for batch, folder, runs in measured
    ]


def _run_batch(
    config: LoadRunSettings,
    batch: str,
    host: str,
    parts: dict[int, str],
    queue: str | None,
    out: Path,
    progress: Progress,
    *,
    shift: int = 0,
) -> list[SaleRun]:
    """The baseline, then every strategy, against the server at host (their Locust files in
    out; `queue`: the task queue of the worker started for them, if one was). With `shift`,
    they run from the shift-th of them on, the ones before it last (`run_rounds`); the runs
    come back in the first order all the same."""
    out.mkdir(parents=True, exist_ok=True)
    if config.cap_seconds < config.ramp_seconds + config.window:
        progress(
            f"note: a sale lasts at most {config.cap_seconds:g} s, too short for the "
            f"crowd's ramp and a {config.window:g} s window: every window will be short"
        )
    order = _running_order(config.strategies, shift)
    done: dict[str, SaleRun] = {}
    for name in order:
        done[name] = run = _run_one(config, batch, name, host, parts, queue, out, progress)
        if name == BASELINE:
            for earlier in order[: order.index(BASELINE)]:
                _measured_beside(done[earlier], run)
        elif BASELINE in done:
            _measured_beside(run, done[BASELINE])
    return [done[name] for name in (BASELINE, *config.strategies)]


def _running_order(strategies: list[str], shift: int) -> list[str]:
    """The baseline and `strategies`, from the shift-th of them on (the ones before it last)."""
    contenders = [BASELINE, *strategies]
    shift %= len(contenders)
    return contenders[shift:] + contenders[:shift]


def _measured_beside(run: SaleRun, baseline: SaleRun) -> None:
    run.baseline_requests_per_second = baseline.requests_per_second
    run.save(update_fields=["baseline_requests_per_second"])


@contextmanager
def _target(
    config: LoadRunSettings, batch: str, out: Path, progress: Progress
) -> Iterator[tuple[str, dict[int, str], str | None]]:
    """The server to flood, the processes started for it by part (`loadtest.cpu`) and the task
    queue of the worker started for it:
    `--host` (none), or a server and a Celery worker started for the batch.

    The worker started here consumes a task queue of the batch's own, deleted when the batch
    ends: orders it has not settled by then stay pending in the database (the outbox a sweeper
    publishes again), and no later worker inherits thousands of stale tasks.
    """
    if config.host:
        yield config.host.rstrip("/"), {}, None
        return
    queue = f"{settings.CELERY_TASK_DEFAULT_QUEUE}-loadtest-{batch}"
    env = {
        "FLASHSALE_UNSAFE_DELAY_MS": str(config.unsafe_delay_ms),
        "FLASHSALE_TASK_QUEUE": queue,
        **config.extra_env,
    }
    # The server's audit takes a bearer token: the locustfile sends the one it finds in its
    # environment, which Locust inherits from this process.
    os.environ.setdefault("FLASHSALE_API_TOKEN", secrets.token_urlsafe(32))
    env["FLASHSALE_API_TOKEN"] = os.environ["FLASHSALE_API_TOKEN"]
    # Its `/metrics` are open to this machine, as under `make serve`.
    env.setdefault("FLASHSALE_METRICS_LOOPBACK", "true")
    server = ShopServer(
        env=env,
        workers=config.server_workers,
        log_path=out / "server.log",
        preload=True,
        kind=config.server,
        threads=config.server_threads,
    )
    worker = CeleryWorker(env, log_path=out / "worker.log")
    with ExitStack() as stack:
        # Undone in reverse: the server first (no more orders), the worker, then its queue.
        stack.callback(_delete_queue, queue, config.strategies, timezone.now(), progress)
        stack.callback(worker.stop)
        threads = f" x {config.server_threads} threads" if config.server_threads > 1 else ""
        progress(
            f"starting {config.server} ({config.server_workers} workers{threads}) "
            "and a Celery worker"
        )
        stack.callback(server.stop)
        server.start()
        worker.start()
        yield server.url, {_pid(server): "server", _pid(worker): "worker"}, queue


def _pid(process: ShopServer | CeleryWorker) -> int:
    assert process.process is not None, "started"
    return process.process.pid


def _delete_queue(queue: str, strategies: list[str], since: datetime, progress: Progress) -> None:
    skus = [sale_sku(strategy) for strategy in strategies]
    pending = Order.objects.filter(
        item__sku__in=skus, status__in=OPEN_STATUSES, created_at__gte=since
    ).count()
    if pending:
        progress(f"{pending} orders of this batch left pending, for a sweeper to publish again")
    _drop_queue(queue)


def _drop_queue(queue: str) -> None:
    from kombu import Connection

    # Bound as Celery binds them (each to a direct exchange of its name), so that deleting
    # one removes its binding as well as its messages.
    with Connection(settings.CELERY_BROKER_URL) as connection:
        for declaration in queues.declarations(queue):
            bound = declaration(connection.default_channel)
            bound.declare()
            bound.delete()


def runner_record(pid: int, queue: str | None = None) -> dict[str, Any]:
    """Who records a run (`SaleRun.runner`): this host, process `pid` and when it started (a
    pid alone may be a later process's), and the task queue of the batch's worker."""
    return {"host": socket.gethostname(), "pid": pid, "since": _started(pid), "queue": queue}


def _started(pid: int) -> int | None:
    """When the process started, in clock ticks since boot; None when there is no such
    process (or no /proc)."""
    fields = stat_fields(pid)
    try:
        return None if fields is None else int(fields[19])
    except (IndexError, ValueError):
        return None


def _runner_gone(runner: dict[str, Any]) -> bool:
    """Whether the process that recorded a run is known to be gone (on a host without /proc,
    or for a run recorded without one, it is never known)."""
    if runner.get("host") != socket.gethostname() or not isinstance(runner.get("since"), int):
        return False
    pid = runner.get("pid")
    return not isinstance(pid, int) or _started(pid) != runner["since"]


def end_orphaned_runs(progress: Progress | None = None) -> list[SaleRun]:
    """End the runs left `running` by a load run process of this host that is gone (killed
    outright, SIGKILL or the OOM killer, with no chance to record it): each is marked failed,
    `interrupted`, and its batch's task queue deleted, as the process would have done. Runs
    recorded on another host are left alone (their process cannot be seen from here); the
    compare page lets a new batch start past them after an hour all the same."""
    ended = []
    for run in SaleRun.objects.filter(status=SaleRun.Status.RUNNING).order_by("pk"):
        runner = run.runner or {}
        if not _runner_gone(runner):
            continue
        run.status = SaleRun.Status.FAILED
        run.error = f"interrupted: its load run process ({runner.get('pid')}) is gone"
        run.finished_at = timezone.now()
        run.save(update_fields=["status", "error", "finished_at"])
        ended.append(run)
    for queue in sorted({run.runner.get("queue") for run in ended} - {None}):
        try:
            _drop_queue(queue)
        except Exception as exc:  # the broker away: the runs are ended all the same
            logger.warning("could not delete the task queue %s of an ended run: %s", queue, exc)
    if ended and progress is not None:
        batches = ", ".join(sorted({run.batch for run in ended}))
        progress(f"ended {len(ended)} run(s) left running by a load run that is gone: {batches}")
    return ended


def _run_one(
    config: LoadRunSettings,
    batch: str,
    strategy: str,
    host: str,
    parts: dict[int, str],
    queue: str | None,
    out: Path,
    progress: Progress,
) -> SaleRun:
    sku = "" if strategy == BASELINE else sale_sku(strategy)
    run = SaleRun.objects.create(
        batch=batch,
        strategy=strategy,
        sku=sku,
        parameters=config.parameters(),
        runner=runner_record(os.getpid(), queue),
    )
    prefix = out / strategy
    meter = CpuMeter(roots=dict(parts))
    try:
        if sku:
            exit_code = _sell(run, config, host, prefix, progress, meter)
        else:
            with _metering(meter):
                exit_code = _locust(
                    config, run, host, prefix, progress, config.baseline_seconds, meter=meter
                )
            _read_stats(run, prefix, config.qty, exit_code)
            _record_baseline_rate(run, prefix, config, meter)
        # 1: some requests failed, counted above; 3: oversold, which the audit shows.
        if exit_code not in (0, 1, OVERSOLD_EXIT_CODE):
            raise LoadRunError(f"Locust exited with {exit_code}; see {prefix}.log")
    except LoadRunError as error:
        run.status = SaleRun.Status.FAILED
        run.error = str(error)
        run.finished_at = timezone.now()
        run.save()
        progress(f"  {strategy}: FAILED ({run.error})")
        return run
    except (KeyboardInterrupt, SystemExit):
        # Ctrl-C, or SIGTERM (`manage.py loadtest` turns it into SystemExit): the run is over,
        # not running; the batch's processes are stopped on the way out.
        run.status = SaleRun.Status.FAILED
        run.error = "interrupted"
        run.finished_at = timezone.now()
        run.save()
        progress(f"  {strategy}: interrupted")
        raise
    run.status = SaleRun.Status.DONE
    run.finished_at = timezone.now()
    run.save()
    progress(f"  {strategy}: {summary_line(run)}")
    return run


def _sell(
    run: SaleRun,
    config: LoadRunSettings,
    host: str,
    prefix: Path,
    progress: Progress,
    meter: CpuMeter,
) -> int:
    """Probe (unless the stock is fixed), then sell out one sale of run.sku and audit it;
    return Locust's exit code for the sale.

    The sale's orders are then given `settle_timeout` seconds to settle (the worker has been
    paying them all along) and their settle lag is recorded. The audit does not depend on it:
    with payments that never fail, pending orders hold their units as firmly as confirmed ones.
    """
    stock = config.stock
    if stock is None:
        probe = _probe(run, config, host, prefix.with_name(f"{prefix.name}-probe"), progress)
        stock = probe["stock"]
        run.parameters = {**run.parameters, "stock": stock, "probe": probe}
        progress(
            f"  {run.strategy}: the probe sold {probe['units_per_second']:g} units/s, its stock "
            f"went down by {probe['stock_per_second']:g}/s: a sale of {stock} units"
        )
    run.initial_stock = stock
    sale = start_sale(
        sku=run.sku,
        stock=stock,
        strategy=run.strategy,
        opens_in=LOCUST_START_SECONDS + config.warmup_seconds,
    )
    until_open = (sale.opens_at - timezone.now()).total_seconds()
    with _metering(meter):
        exit_code = _locust(
            config,
            run,
            host,
            prefix,
            progress,
            until_open + config.cap_seconds,
            opens_at=sale.opens_at.timestamp(),
            until_sold_out=True,
            meter=meter,
        )
    _read_stats(run, prefix, config.qty, exit_code)
    if config.settle_timeout:
        _settle(run.sku, timeout=config.settle_timeout)
    _record_audit(run, sale.opens_at, config)
    _record_window_rate(run, prefix)
    window = run.audit["window"]
    if window.get("units"):
        cpu = meter.between(window["starts_at"], window["ends_at"])
        if cpu is not None:
            run.audit["cpu"] = {**cpu, "per_unit_ms": per_unit(cpu, window["units"])}
    _record_settling(run, sale.opens_at, waited=config.settle_timeout)
    return exit_code


def _probe(
    run: SaleRun, config: LoadRunSettings, host: str, prefix: Path, progress: Progress
) -> dict[str, Any]:
    """Flood a sale too big to sell out; return its pace and the stock it sizes.

    The pace is that of the stock going down, once the crowd is in: for `unsafe`, whose lost
    updates leave the stock higher than its orders say, that is slower than its orders come.
    """
    # It opens as the sale will, to a crowd already gathered, so that Locust's own start is
    # not part of what it measures.
    sale = start_sale(
        sku=run.sku, stock=PROBE_STOCK, strategy=run.strategy, opens_in=LOCUST_START_SECONDS
    )
    until_open = (sale.opens_at - timezone.now()).total_seconds()
    run_time = until_open + config.ramp_seconds + config.probe_seconds
    exit_code = _locust(
        config, run, host, prefix, progress, run_time, opens_at=sale.opens_at.timestamp()
    )
    orders = _live_orders(run.sku)
    if not orders:
        raise LoadRunError(
            f"the probe sold nothing (Locust exited with {exit_code}); {_tail(prefix)}"
        )
    measured_from = orders[0][0] + timedelta(seconds=config.ramp_seconds)
    seconds = (orders[-1][0] - measured_from).total_seconds()
    if seconds < 0.5:
        raise LoadRunError(
            f"the probe sold for {seconds + config.ramp_seconds:.1f} s only, too short to "
            f"measure; see {prefix}.log"
        )
    units_per_second = sum(qty for at, qty in orders if at >= measured_from) / seconds
    audit = audit_sale(run.sku)
    went_down = audit["initial_stock"] - units_left(audit)
    stock_per_second = units_per_second * went_down / max(audit["accepted_units"], 1)
    stock = math.ceil(stock_per_second * (config.ramp_seconds + config.headroom * config.window))
    return {
        "seconds": round(seconds, 2),
        "units_per_second": round(units_per_second, 1),
        "stock_per_second": round(stock_per_second, 1),
        "stock": max(stock, 1),
    }


def _current_sale_id(sku: str) -> int:
    return Item.objects.filter(sku=sku).values_list("current_sale_id", flat=True).get()


def _live_orders(sku: str) -> list[tuple[datetime, int]]:
    """(created_at, qty) of the live orders of sku's current sale, oldest first."""
    return list(
        Order.objects.filter(sale_id=_current_sale_id(sku), status__in=LIVE_STATUSES)
        .order_by("created_at")
        .values_list("created_at", "qty")
    )


def _locust(
    config: LoadRunSettings,
    run: SaleRun,
    host: str,
    prefix: Path,
    progress: Progress,
    run_time: float,
    *,
    opens_at: float | None = None,
    until_sold_out: bool = False,
    meter: CpuMeter | None = None,
) -> int:
    """Run Locust for at most run_time seconds; return its exit code.

    opens_at (Unix time): the crowd buys from then on (before, a tenth of it looks); without
    it the crowd buys at once (the baseline). until_sold_out: the run ends once sold out.
    """
    seconds = max(math.ceil(run_time), 1)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", host, "-u", str(config.users), "-r", str(config.spawn_rate),
        "-t", f"{seconds}s", "--stop-timeout", "5",
        "--csv", str(prefix), "--csv-full-history", "--only-summary",
        "--strategy", run.strategy, "--qty", str(config.qty),
    ]  # fmt: skip
    command += ["--baseline", "--sku", BASELINE] if run.strategy == BASELINE else ["--sku", run.sku]
    if opens_at is not None:
        command += ["--opens-at", f"{opens_at:.3f}"]
    else:
        command += ["--warmup-share", "0"]
    if until_sold_out:
        command.append("--until-sold-out")
    if oversells(run.strategy):  # its oversell is the point
        command.append("--allow-oversell")
    if config.workers > 1:
        command += ["--processes", str(config.workers)]
    label = run.strategy if until_sold_out or run.strategy == BASELINE else f"{run.strategy} probe"
    started = time.monotonic()
    history = Path(f"{prefix}_stats_history.csv")
    with open(f"{prefix}.log", "wb") as log:
        process = subprocess.Popen(
            command,
            cwd=PROJECT_DIR,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
            preexec_fn=die_with_parent,  # no crowd goes on flooding once the run is gone
        )
        if meter is not None:
            meter.track(process.pid, "locust")
        try:
            while not _exited(process, within=PROGRESS_SECONDS):
                elapsed = min(time.monotonic() - started, seconds)
                rate, failures = latest_rates(history)
                line = f"  {label}: {elapsed:4.0f} s of {seconds}"
                if until_sold_out:
                    line += f" at most, {_units_sold(run.sku)} of {run.initial_stock} units sold"
                progress(f"{line}, {rate:,.0f} req/s, {failures} failures", live=True)
                if until_sold_out or run.strategy == BASELINE:
                    # The compare page shows the run as it goes, and its units sold over time.
                    run.history = _history(history, config.qty)
                    run.requests_per_second, run.failures = rate, failures
                    run.save(
                        update_fields=[
                            "history",
                            "requests_per_second",
                            "failures",
                            "initial_stock",
                        ]
                    )
        except BaseException:
            process.terminate()
            process.wait()
            raise
    return process.returncode


@contextmanager
def _metering(meter: CpuMeter) -> Iterator[CpuMeter]:
    meter.start()
    try:
        yield meter
    finally:
        meter.stop()


def _record_baseline_rate(
    run: SaleRun, prefix: Path, config: LoadRunSettings, meter: CpuMeter
) -> None:
    """The baseline's requests/s and CPU per request from once the crowd is in to the end of
    its run, as a strategy's units/s are measured once its crowd is in (the requests counted
    from Locust's history). Locust's figure for the whole run, the ramp included, stays in
    `audit.http`."""
    totals = http_totals(Path(f"{prefix}_stats_history.csv"))
    start_at = totals[0][0] + math.ceil(config.ramp_seconds) if totals else 0
    steady = [(at, count) for at, count in totals if at >= start_at]
    if len(steady) < 2:
        _missing(
            run,
            "req/s once the crowd was in: Locust's history does not reach past the crowd's "
            "ramp, so req/s is Locust's figure for the whole run",
        )
        return
    (start, first), (end, last) = steady[0], steady[-1]
    _measured_between(run, start, end, (last - first) / (end - start))
    cpu = meter.between(start, end)
    if cpu is not None and last > first:
        requests = last - first
        cpu = {**cpu, "requests": requests, "per_request_ms": per_unit(cpu, requests)}
        run.audit = {**run.audit, "cpu": cpu}


def _record_window_rate(run: SaleRun, prefix: Path) -> None:
    """A sale's HTTP requests/s over its measured window, the span of its units/s."""
    window = run.audit["window"]
    if window.get("units"):
        totals = http_totals(Path(f"{prefix}_stats_history.csv"))
        rate = requests_between(totals, window["starts_at"], window["ends_at"])
        if rate is None:
            _missing(
                run,
                "req/s over the window: Locust's history does not cover it, so req/s is "
                "Locust's figure for the whole run",
            )
            return
        _measured_between(run, window["starts_at"], window["ends_at"], rate)


def _measured_between(run: SaleRun, start: float, end: float, rate: float) -> None:
    """Record `rate` as the run's requests/s, Locust's whole-run figure beside it."""
    run.audit = {
        **run.audit,
        "http": {
            "from": start,
            "to": end,
            "requests_per_second": round(rate, 1),
            "whole_run_requests_per_second": run.requests_per_second,
        },
    }
    run.requests_per_second = round(rate, 1)


def _exited(process: subprocess.Popen[bytes], *, within: float) -> bool:
    try:
        process.wait(timeout=within)
    except subprocess.TimeoutExpired:
        return False
    return True


def _units_sold(sku: str) -> int:
    live = Order.objects.filter(sale_id=_current_sale_id(sku), status__in=LIVE_STATUSES)
    return live.aggregate(units=Sum("qty"))["units"] or 0


def _tail(prefix: Path, lines: int = 3) -> str:
    try:
        text = Path(f"{prefix}.log").read_text(errors="replace")
    except OSError:
        return f"{prefix}.log is missing"
    last = [" ".join(line.split())[:120] for line in text.strip().splitlines()[-lines:]]
    return f"{prefix}.log ends: " + " | ".join(last)


def _rows(path: Path) -> list[dict[str, str]]:
    """The whole rows of a CSV file Locust writes as it runs: none before it has made the file or
    flushed its header, and never the line it is still writing (a row cut short would read as a
    second with no requests, or a count a digit short)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    complete = text[: text.rfind("\n") + 1]
    return [
        row
        for row in csv.DictReader(io.StringIO(complete, newline=""))
        if None not in row and None not in row.values()  # fields missing, or one too many
    ]


def _missing(run: SaleRun, figure: str) -> None:
    """Say in the run's audit that a figure could not be measured, and why (the notes under the
    comparison show it)."""
    run.audit = {**run.audit, "missing": [*run.audit.get("missing", []), figure]}


def _number(value: str | None) -> float | None:
    if value in (None, "", "N/A"):
        return None
    return float(value)


def _read_stats(run: SaleRun, prefix: Path, qty: int, exit_code: int) -> None:
    """Requests, failures, throughput and latency of the HTTP requests; lock waits; history.

    Checkout latency is that of the checkouts answered while the sale sold (its sold-out
    answers apart). Raises LoadRunError when Locust left no stats; a history it did not write
    leaves the run without one, and the run says so.
    """
    path = Path(f"{prefix}_stats.csv")
    stats = _rows(path)
    if not stats:
        raise LoadRunError(
            f"Locust exited with {exit_code} and left no stats in {path.name}; {_tail(prefix)}"
        )
    try:
        http = [row for row in stats if row["Type"] in HTTP_TYPES]
        run.requests = sum(int(row["Request Count"]) for row in http)
        run.failures = sum(int(row["Failure Count"]) for row in http)
        run.requests_per_second = sum(float(row["Requests/s"]) for row in http)
        checkout = next((row for row in http if row["Name"] == "checkout"), {})
        run.p50_ms = _number(checkout.get("50%"))
        run.p95_ms = _number(checkout.get("95%"))
        run.p99_ms = _number(checkout.get("99%"))
        lock_wait = [row for row in stats if row["Type"] == "LOCK"]
        run.lock_wait_p99_ms = _number(lock_wait[0]["99%"]) if lock_wait else None
        if run.sku:
            sold_out = [row for row in http if row["Name"] == SOLD_OUT_NAME]
            run.audit = {
                **run.audit,
                "sold_out_answers": sum(int(r["Request Count"]) for r in sold_out),
            }
        history = Path(f"{prefix}_stats_history.csv")
        run.history = _history(history, qty)
    except (KeyError, ValueError) as exc:
        raise LoadRunError(
            f"Locust exited with {exit_code} and left no readable stats ({exc}); {_tail(prefix)}"
        ) from exc
    if not run.history:
        _missing(run, f"history: Locust wrote none to {history.name}, so no chart over time")


def _http_counts(rows: list[dict[str, str]]) -> list[tuple[int, int, int]]:
    """(Unix second, HTTP requests so far, failures so far) at each of the rows of a run's
    Locust history, oldest first: every HTTP entry summed (the locustfile's UNITS and LOCK
    entries are not requests). Empty before Locust wrote any."""
    entries: dict[int, dict[tuple[str, str], tuple[int, int]]] = {}
    for row in rows:
        if row["Type"] in HTTP_TYPES:
            # An entry written twice in one second (a last row as Locust stops) counts once.
            entries.setdefault(int(row["Timestamp"]), {})[(row["Type"], row["Name"])] = (
                int(row["Total Request Count"] or 0),
                int(row["Total Failure Count"] or 0),
            )
    return [
        (second, sum(r for r, _ in counts.values()), sum(f for _, f in counts.values()))
        for second, counts in sorted(entries.items())
    ]


def http_totals(path: Path) -> list[tuple[int, int]]:
    """(Unix second, HTTP requests so far) at each row of a run's Locust history."""
    return [(second, requests) for second, requests, _ in _http_counts(_rows(path))]


def requests_between(totals: list[tuple[int, int]], start: float, end: float) -> float | None:
    """HTTP requests per second from `start` to `end` (Unix times), read off `http_totals`:
    the running count at each end, taken between the rows around it as if the requests of
    that second came evenly. None when the span is empty or outside the history.

    Locust's own `Requests/s` will not do: its whole-run figure counts the crowd's ramp and
    the drain, and each history row's is an average of the seconds before the last two,
    which lags a rate that moves.
    """
    if len(totals) < 2 or end <= start or start < totals[0][0] or end > totals[-1][0]:
        return None

    def count_at(moment: float) -> float:
        for (before, low), (after, high) in zip(totals, totals[1:], strict=False):
            if before <= moment <= after:
                return low + (high - low) * (moment - before) / (after - before)
        return float(totals[-1][1])

    return (count_at(end) - count_at(start)) / (end - start)


def latest_rates(path: Path) -> tuple[float, int]:
    """HTTP requests/s over the latest second of a run's Locust history, and its failures so
    far (0, 0 before Locust wrote any)."""
    counts = _http_counts(_rows(path))
    if not counts:
        return 0.0, 0
    rate = 0.0
    if len(counts) > 1:
        (before, earlier, _), (after, latest, _) = counts[-2:]
        rate = (latest - earlier) / (after - before)
    return rate, counts[-1][2]


def _history(path: Path, qty: int) -> list[dict[str, float]]:
    """One sample a second: users, HTTP requests/s (over the second before the sample),
    checkout p95, units sold so far; none before Locust wrote any."""
    rows = _rows(path)
    samples: dict[int, dict[str, float]] = {}
    for row in rows:
        second = int(row["Timestamp"])
        sample = samples.setdefault(second, {"users": 0, "p95_ms": 0.0, "units_sold": 0})
        sample["users"] = int(row["User Count"] or 0)
        if row["Type"] in HTTP_TYPES and row["Name"] == "checkout":
            sample["p95_ms"] = _number(row["95%"]) or 0.0
        elif row["Type"] == "UNITS":
            sample["units_sold"] = int(row["Total Request Count"] or 0)
    if not samples:
        return []
    first = min(samples)
    history = []
    units: float = 0
    requests = {second: count for second, count, _ in _http_counts(rows)}
    previous: tuple[int, int] | None = None
    for second in sorted(samples):
        units = max(units, samples[second]["units_sold"])
        rate = 0.0
        if second in requests:
            if previous:
                rate = (requests[second] - previous[1]) / (second - previous[0])
            previous = (second, requests[second])
        history.append(
            {
                "t": second - first,
                "users": samples[second]["users"],
                "requests_per_second": round(rate, 1),
                "p95_ms": samples[second]["p95_ms"],
                "units_sold": units,
            }
        )
    return history


def _settle(sku: str, *, timeout: float) -> bool:
    """Wait until every order of sku's current sale is final (a worker paid or failed it)."""
    open_orders = Order.objects.filter(sale_id=_current_sale_id(sku), status__in=OPEN_STATUSES)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not open_orders.exists():
            return True
        time.sleep(0.25)
    return False


def _record_settling(run: SaleRun, opened_at: datetime, *, waited: float | None) -> None:
    """The settle lag of the sale's orders (from the 201 to a final status: p50, p99), the
    orders not settled when it was measured, and how many were pending, second by second."""
    orders = list(
        Order.objects.filter(sale_id=_current_sale_id(run.sku)).values_list(
            "created_at", "updated_at", "status"
        )
    )
    settle = settle_figures(orders, opened_at)
    settle["waited_seconds"] = waited
    run.audit["settle"] = settle
    run.settle_p50_ms = settle["p50_ms"]
    run.settle_p99_ms = settle["p99_ms"]


def settle_figures(
    orders: list[tuple[datetime, datetime, str]], opened_at: datetime
) -> dict[str, Any]:
    """From (created_at, updated_at, status) of a sale's orders: the settle lag of the final
    ones (an order's updated_at is the time of its last change, the one that made it final),
    how many are still open, and the most orders pending in each second from the opening."""
    lags = sorted(
        (updated - created).total_seconds()
        for created, updated, status in orders
        if status not in OPEN_STATUSES
    )

    def percentile(share: float) -> float | None:
        value = percentile_ms(lags, share)
        return None if value is None else round(value, 1)

    # +1 at each order's creation, -1 when it became final; the most pending in each second.
    changes = [((created - opened_at).total_seconds(), 1) for created, _, _ in orders]
    changes += [
        ((updated - opened_at).total_seconds(), -1)
        for _, updated, status in orders
        if status not in OPEN_STATUSES
    ]
    changes.sort()
    pending: list[list[float]] = []
    if changes:
        level, index = 0, 0
        first = max(0, math.floor(changes[0][0]))
        last = max(first, math.floor(changes[-1][0]))
        for second in range(first, last + 1):
            peak = level  # pending as the second begins
            while index < len(changes) and changes[index][0] < second + 1:
                level += changes[index][1]
                peak = max(peak, level)
                index += 1
            pending.append([second, peak])
        pending.append([last + 1, level])
    return {
        "orders": len(orders),
        "settled": len(lags),
        "unsettled": len(orders) - len(lags),
        "p50_ms": percentile(0.5),
        "p99_ms": percentile(0.99),
        "pending": pending,
    }


def units_left(audit: dict[str, Any]) -> int:
    """Units the database still holds for sale, per an audit."""
    if audit.get("db_stock") is not None:
        return audit["db_stock"]
    return audit["remaining"]


def _record_audit(run: SaleRun, opened_at: datetime, config: LoadRunSettings) -> None:
    """Audit the sale; record the window, the time it took to sell out and the lost updates."""
    audit = audit_sale(run.sku)
    left = units_left(audit)
    run.audit = {
        **audit,
        **run.audit,
        "lost_updates": audit["accepted_units"] - (audit["initial_stock"] - left),
        "sold_out": left == 0,
    }
    run.accepted_units = audit["accepted_units"]
    run.oversold = audit["oversold"]
    run.remaining = audit["remaining"]
    run.fallback_activations = audit["fallback_orders"]
    orders = _live_orders(run.sku)
    if left == 0 and orders:
        run.sold_out_after_seconds = max((orders[-1][0] - opened_at).total_seconds(), 0.001)
    window = measure_window(orders, config, sold_out=left == 0)
    run.audit["window"] = window
    run.goodput = window["units_per_second"]


def measure_window(
    orders: list[tuple[datetime, int]], config: LoadRunSettings, *, sold_out: bool
) -> dict[str, Any]:
    """The measured window of a sale, from its live orders (created_at, qty), oldest first.

    It starts once the crowd is in (the first order plus the crowd's ramp) and ends `window`
    seconds later, or at the last order if that came sooner: when the stock ran out, or when
    the sale was cut off. `held` says whether it lasted the whole window. A sale over before
    its crowd was in (no order between the crowd being in and the last one: at most that
    last straggler) is measured from its first order to its last.
    """
    target = config.window
    if not orders:
        return {"target_seconds": target, "seconds": 0.0, "units": 0,
                "units_per_second": None, "held": False}  # fmt: skip
    first, last = orders[0][0], orders[-1][0]

    def units_between(start: datetime, end: datetime) -> int:
        return sum(qty for at, qty in orders if start <= at < end)

    start = first + timedelta(seconds=config.ramp_seconds)
    end = min(start + timedelta(seconds=target), last)
    units = units_between(start, end)
    if end <= start or not units:  # sold out (or cut off) before the crowd was in
        start, end = first, last
        units = units_between(start, end)
    seconds = (end - start).total_seconds()
    return {
        "target_seconds": target,
        "seconds": round(seconds, 2),
        "units": units,
        "units_per_second": round(units / seconds, 1) if seconds > 0 else None,
        "held": seconds >= target,
        "starts_at": start.timestamp(),
        "ends_at": end.timestamp(),
        "starts_after_first_order": round((start - first).total_seconds(), 2),
        "ended_by": "window" if seconds >= target else ("sold out" if sold_out else "cap"),
    }
