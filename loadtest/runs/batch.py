"""A batch of load runs: a baseline, then each strategy, against one server, side by side.

The baseline floods /api/noop with the same Locust crowd: the server's HTTP ceiling. Every
figure of a strategy is stated next to the baseline measured alongside it, because only
side-by-side figures mean something on a noisy machine. A strategy's run:
1. the probe (unless the stock is fixed) floods a sale too big to sell out, and sizes the real
   sale's stock to last the window and some headroom at the pace it measured;
2. the sale: early visitors, the opening, the crowd; its window is measured (`window`);
3. the drain: the crowd buys what is left until sold out (or the cap), and the audit must find
   nothing left and nothing oversold. The order worker runs throughout, as in production: the
   audit counts pending orders as accepted, so it need not wait for the worker.
See docs/load-runs.md#one-batch.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils import timezone

from inventory.exceptions import InvalidRequest
from inventory.models import Order
from inventory.orders import OPEN_STATUSES
from inventory.selectors import audit_sale
from inventory.services import start_sale
from loadtest import sandbox
from loadtest.cpu import CpuMeter
from loadtest.models import SaleRun
from loadtest.report.columns import BASELINE, summary_line
from loadtest.report.files import write_report
from shop.processes.servers import CeleryWorker, ShopServer

from .config import LoadRunError, LoadRunSettings, Progress, print_progress
from .locust_driver import OVERSOLD_EXIT_CODE, log_tail, read_stats, run_locust
from .recording import (
    drop_queue,
    end_orphaned_runs,
    live_orders,
    record_audit,
    record_settling,
    runner_record,
    units_left,
    wait_until_settled,
)
from .window import record_baseline_rate, record_window, record_window_cpu, record_window_rate

#: Units of a probe sale: more than any strategy sells in a probe, so it never sells out.
PROBE_STOCK = 1_000_000
#: About how long Locust takes to start; a sale opens after this and the warm-up. Only a guess
#: to open the sale by: a Locust slower to start (a busy host, a cold bytecode cache) finds the
#: sale open, and its files are read only once and as far as it has written them.
LOCUST_START_SECONDS = 1.5


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
        "DJANGO_SETTINGS_MODULE": sandbox.SETTINGS_MODULE,  # the lab's: it reads the delay
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
    drop_queue(queue)


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
                exit_code = run_locust(
                    config, run, host, prefix, progress, config.baseline_seconds, meter=meter
                )
            read_stats(run, prefix, config.qty, exit_code)
            record_baseline_rate(run, prefix, config, meter)
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
        exit_code = run_locust(
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
    read_stats(run, prefix, config.qty, exit_code)
    if config.settle_timeout:
        wait_until_settled(run.sku, timeout=config.settle_timeout)
    orders = record_audit(run, sale.opens_at)
    record_window(run, orders, config)
    record_window_rate(run, prefix)
    record_window_cpu(run, meter)
    record_settling(run, sale.opens_at, waited=config.settle_timeout)
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
    exit_code = run_locust(
        config, run, host, prefix, progress, run_time, opens_at=sale.opens_at.timestamp()
    )
    orders = live_orders(run.sku)
    if not orders:
        raise LoadRunError(
            f"the probe sold nothing (Locust exited with {exit_code}); {log_tail(prefix)}"
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


@contextmanager
def _metering(meter: CpuMeter) -> Iterator[CpuMeter]:
    meter.start()
    try:
        yield meter
    finally:
        meter.stop()
