"""Load runs: flood each strategy with Locust, audit it, record a SaleRun, write the report.

A batch measures, in one go and under the same settings: a baseline (the same Locust crowd
against /api/noop, the server's HTTP ceiling), then each strategy in turn. Every figure of a
strategy is stated next to the baseline measured alongside it, because this kind of machine
is noisy and only side-by-side figures mean something.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db.models import Max
from django.utils import timezone

from inventory.exceptions import InvalidRequest
from inventory.models import Order, SaleRun
from inventory.orders import OPEN_STATUSES
from inventory.selectors import audit_sale
from inventory.services import start_sale
from inventory.strategies import strategy_names

from .server import PROJECT_DIR, CeleryWorker, ShopServer

LOCUSTFILE = PROJECT_DIR / "loadtest" / "locustfile.py"
BASELINE = "baseline"
#: Locust exit code for a run whose audit found oversell (see the locustfile).
OVERSOLD_EXIT_CODE = 3
HTTP_TYPES = {"GET", "POST"}

Progress = Callable[[str], None]


@dataclass
class LoadRunSettings:
    strategies: list[str]
    stock: int = 300
    users: int = 40
    spawn_rate: float = 100.0
    duration: int = 15
    host: str | None = None
    out: Path | None = None
    workers: int = 1
    qty: int = 1
    server_workers: int = 8
    settle_timeout: float | None = None
    warmup: float | None = None
    unsafe_delay_ms: int = 5
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
            (1 <= self.stock <= 10**7, "stock: from 1 to 10000000"),
            (1 <= self.users <= 10_000, "users: from 1 to 10000"),
            (0 < self.spawn_rate <= 10_000, "spawn rate: above 0, at most 10000"),
            (3 <= self.duration <= 3600, "duration: from 3 to 3600 seconds"),
            (1 <= self.workers <= 64, "workers: from 1 to 64"),
            (1 <= self.qty <= 100, "qty: from 1 to 100"),
            (1 <= self.server_workers <= 64, "server workers: from 1 to 64"),
            (0 <= self.unsafe_delay_ms <= 10_000, "unsafe delay: from 0 to 10000 ms"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)
        if self.host is not None and not self.host.startswith(("http://", "https://")):
            raise InvalidRequest("host: a URL such as http://127.0.0.1:8000")

    @property
    def warmup_seconds(self) -> float:
        """The trickle before the crowd; the sale opens when the crowd arrives."""
        return self.warmup if self.warmup is not None else round(self.duration * 0.1, 1)


@dataclass
class Batch:
    batch: str
    out: Path
    runs: list[SaleRun]
    files: dict[str, Path]


def new_batch_id() -> str:
    return f"{timezone.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:4]}"


def run_batch(
    config: LoadRunSettings, *, progress: Progress = print, batch: str | None = None
) -> Batch:
    """Run the baseline and every strategy; record, report and return the runs."""
    from .report import write_report

    config.validate()
    batch = batch or new_batch_id()
    out = Path(config.out or settings.FLASHSALE_REPORTS_DIR / batch)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[SaleRun] = []
    with _target(config, out, progress) as (host, settles):
        progress(f"batch {batch}: {host}, reports in {out}")
        baseline = _run_one(config, batch, BASELINE, host, out, progress, settles=False)
        runs.append(baseline)
        for strategy in config.strategies:
            run = _run_one(config, batch, strategy, host, out, progress, settles=settles)
            run.baseline_requests_per_second = baseline.requests_per_second
            run.save(update_fields=["baseline_requests_per_second"])
            runs.append(run)
    files = write_report(runs, out)
    return Batch(batch=batch, out=out, runs=runs, files=files)


@contextmanager
def _target(config: LoadRunSettings, out: Path, progress: Progress) -> Iterator[tuple[str, bool]]:
    """The server to flood: `--host`, or a gunicorn and a Celery worker started for the run."""
    if config.host:
        yield config.host.rstrip("/"), bool(config.settle_timeout)
        return
    env = {"FLASHSALE_UNSAFE_DELAY_MS": str(config.unsafe_delay_ms), **config.extra_env}
    with ExitStack() as stack:
        progress(f"starting gunicorn ({config.server_workers} workers) and a Celery worker")
        server = ShopServer(
            env=env, workers=config.server_workers, log_path=out / "server.log"
        ).start()
        stack.callback(server.stop)
        worker = CeleryWorker(
            {**env, "FLASHSALE_PAYMENT_LATENCY_MS": "1"},
            concurrency=2,
            log_path=out / "worker.log",
        )
        stack.callback(worker.stop)
        worker.start()
        yield server.url, True


def _run_one(
    config: LoadRunSettings,
    batch: str,
    strategy: str,
    host: str,
    out: Path,
    progress: Progress,
    *,
    settles: bool,
) -> SaleRun:
    sku = "" if strategy == BASELINE else f"loadtest-{strategy}"
    parameters = {
        "stock": config.stock,
        "users": config.users,
        "spawn_rate": config.spawn_rate,
        "duration": config.duration,
        "qty": config.qty,
        "workers": config.workers,
        "host": config.host or "local gunicorn",
        "server_workers": None if config.host else config.server_workers,
        "warmup": config.warmup_seconds,
        "strategies": config.strategies,
    }
    run = SaleRun.objects.create(batch=batch, strategy=strategy, sku=sku, parameters=parameters)
    if sku:
        start_sale(sku=sku, stock=config.stock, strategy=strategy, opens_in=config.warmup_seconds)
        run.initial_stock = config.stock
    opened_at = timezone.now() + timedelta(seconds=config.warmup_seconds)
    prefix = out / strategy
    exit_code = _locust(config, strategy, sku, host, prefix, progress)
    try:
        _read_stats(run, prefix, config.qty)
    except (OSError, KeyError, ValueError) as exc:
        run.status = SaleRun.Status.FAILED
        log_tail = Path(f"{prefix}.log").read_text(errors="replace").strip().splitlines()[-3:]
        run.error = (
            f"Locust exited with {exit_code} and left no readable stats ({exc}); "
            f"its log ends: {' | '.join(log_tail)}"
        )
        run.finished_at = timezone.now()
        run.save()
        progress(f"  {strategy}: FAILED ({run.error})")
        return run
    if sku:
        if settles:
            _settle(sku, timeout=config.settle_timeout or 60.0)
        _record_audit(run, sku, opened_at)
    run.status = SaleRun.Status.DONE
    if exit_code not in (0, 1, OVERSOLD_EXIT_CODE):  # 1: some requests failed, counted above
        run.status = SaleRun.Status.FAILED
        run.error = f"Locust exited with {exit_code}; see {prefix}.log"
    run.finished_at = timezone.now()
    run.save()
    progress(f"  {strategy}: {summary_line(run)}")
    return run


def _locust(
    config: LoadRunSettings, strategy: str, sku: str, host: str, prefix: Path, progress: Progress
) -> int:
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", host, "-u", str(config.users), "-r", str(config.spawn_rate),
        "-t", f"{config.duration}s", "--stop-timeout", "5",
        "--csv", str(prefix), "--csv-full-history", "--only-summary",
        "--strategy", strategy, "--qty", str(config.qty),
        "--warmup-share", f"{config.warmup_seconds / config.duration:.3f}",
    ]  # fmt: skip
    command += ["--baseline", "--sku", BASELINE] if strategy == BASELINE else ["--sku", sku]
    if strategy == "unsafe":
        command.append("--allow-oversell")
    if config.workers > 1:
        command += ["--processes", str(config.workers)]
    started = time.monotonic()
    with open(f"{prefix}.log", "wb") as log:
        process = subprocess.Popen(
            command, cwd=PROJECT_DIR, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
        try:
            while process.poll() is None:
                time.sleep(2)
                elapsed = time.monotonic() - started
                progress(f"  {strategy}: {min(elapsed, config.duration):4.0f}/{config.duration} s")
        except BaseException:
            process.terminate()
            process.wait()
            raise
    return process.returncode


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _number(value: str | None) -> float | None:
    if value in (None, "", "N/A"):
        return None
    return float(value)


def _read_stats(run: SaleRun, prefix: Path, qty: int) -> None:
    """Requests, failures, throughput and latency of the HTTP requests; lock waits; history."""
    stats = _rows(Path(f"{prefix}_stats.csv"))
    http = [row for row in stats if row["Type"] in HTTP_TYPES]
    run.requests = sum(int(row["Request Count"]) for row in http)
    run.failures = sum(int(row["Failure Count"]) for row in http)
    run.requests_per_second = sum(float(row["Requests/s"]) for row in http)
    checkout = next(row for row in http if row["Name"] == "checkout")
    run.p50_ms = _number(checkout["50%"])
    run.p95_ms = _number(checkout["95%"])
    run.p99_ms = _number(checkout["99%"])
    lock_wait = [row for row in stats if row["Type"] == "LOCK"]
    run.lock_wait_p99_ms = _number(lock_wait[0]["99%"]) if lock_wait else None
    run.history = _history(Path(f"{prefix}_stats_history.csv"), qty)


def _history(path: Path, qty: int) -> list[dict[str, float]]:
    """One sample a second: users, HTTP requests/s, checkout p95, units sold so far."""
    samples: dict[int, dict[str, float]] = {}
    for row in _rows(path):
        second = int(row["Timestamp"])
        sample = samples.setdefault(
            second, {"users": 0, "requests_per_second": 0.0, "p95_ms": 0.0, "units_sold": 0}
        )
        sample["users"] = int(row["User Count"] or 0)
        if row["Type"] in HTTP_TYPES:
            sample["requests_per_second"] += float(row["Requests/s"] or 0)
            if row["Name"] == "checkout":
                sample["p95_ms"] = _number(row["95%"]) or 0.0
        elif row["Type"] == "UNITS":
            sample["units_sold"] = int(row["Total Request Count"] or 0)
    if not samples:
        return []
    first = min(samples)
    history = []
    units = 0
    for second in sorted(samples):
        units = max(units, samples[second]["units_sold"])
        history.append(
            {
                "t": second - first,
                "users": samples[second]["users"],
                "requests_per_second": round(samples[second]["requests_per_second"], 1),
                "p95_ms": samples[second]["p95_ms"],
                "units_sold": units,
            }
        )
    return history


def _settle(sku: str, *, timeout: float) -> bool:
    """Wait until every order of the sale is final (a worker paid or failed it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Order.objects.filter(item__sku=sku, status__in=OPEN_STATUSES).exists():
            return True
        time.sleep(0.25)
    return False


def _record_audit(run: SaleRun, sku: str, opened_at) -> None:
    audit = audit_sale(sku)
    run.audit = audit
    run.accepted_units = audit["accepted_units"]
    run.oversold = audit["oversold"]
    run.remaining = audit["remaining"]
    run.fallback_activations = audit["fallback_orders"]
    last_sale = Order.objects.filter(item__sku=sku).aggregate(last=Max("created_at"))["last"]
    if audit["remaining"] == 0 and last_sale is not None:
        run.sold_out_after_seconds = max((last_sale - opened_at).total_seconds(), 0.001)
        run.goodput = audit["accepted_units"] / run.sold_out_after_seconds
    else:
        selling = max(run.parameters["duration"] - run.parameters["warmup"], 1)
        run.goodput = audit["accepted_units"] / selling


def summary_line(run: SaleRun) -> str:
    parts = [f"{run.requests_per_second or 0:.0f} req/s", f"p99 {run.p99_ms or 0:.0f} ms"]
    if run.strategy != BASELINE:
        parts += [
            f"accepted {run.accepted_units}",
            f"oversold {run.oversold}",
            f"remaining {run.remaining}",
        ]
    if run.failures:
        parts.append(f"{run.failures} failed requests")
    return ", ".join(parts)


def run_as_dict(run: SaleRun) -> dict:
    """A SaleRun as plain data, for the JSON report and the admin."""
    data = {}
    for model_field in run._meta.concrete_fields:
        value = getattr(run, model_field.attname)
        data[model_field.name] = value.isoformat() if hasattr(value, "isoformat") else value
    data["ratio_to_baseline"] = run.ratio_to_baseline
    return data
