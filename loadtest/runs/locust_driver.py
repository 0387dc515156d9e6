"""The Locust driver: runs the locustfile for one run, shows how it goes, reads its files.

A Locust slow to start or stopped early writes its files late, in part or not at all: they are
read for what they hold (whole rows only); a history it did not write leaves the run without
one, and the run says so (`recording.note_missing`) rather than fail.
See docs/load-runs.md#one-batch.
"""

from __future__ import annotations

import csv
import io
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from inventory.strategies import oversells
from loadtest.cpu import CpuMeter
from loadtest.models import SaleRun
from loadtest.report.columns import BASELINE
from shop.processes.children import die_with_parent
from shop.processes.servers import PROJECT_DIR

from .config import LoadRunError, LoadRunSettings, Progress
from .recording import note_missing, units_sold

LOCUSTFILE = PROJECT_DIR / "loadtest" / "locustfile.py"
#: Locust exit code for a run whose audit found oversell (see the locustfile).
OVERSOLD_EXIT_CODE = 3
HTTP_TYPES = {"GET", "POST"}
#: Stats name of the checkouts answered sold out (see the locustfile).
SOLD_OUT_NAME = "checkout sold out"
#: Seconds between two looks at a running Locust: the live line, and the run's figures so far.
PROGRESS_SECONDS = 2.0


def run_locust(
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
                    line += f" at most, {units_sold(run.sku)} of {run.initial_stock} units sold"
                progress(f"{line}, {rate:,.0f} req/s, {failures} failures", live=True)
                if until_sold_out or run.strategy == BASELINE:
                    # The compare page shows the run as it goes, and its units sold over time.
                    run.history = read_history(history, config.qty)
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


def _exited(process: subprocess.Popen[bytes], *, within: float) -> bool:
    try:
        process.wait(timeout=within)
    except subprocess.TimeoutExpired:
        return False
    return True


def log_tail(prefix: Path, lines: int = 3) -> str:
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


def _number(value: str | None) -> float | None:
    if value in (None, "", "N/A"):
        return None
    return float(value)


def read_stats(run: SaleRun, prefix: Path, qty: int, exit_code: int) -> None:
    """Requests, failures, throughput and latency of the HTTP requests; lock waits; history.

    Checkout latency is that of the checkouts answered while the sale sold (its sold-out
    answers apart). Raises LoadRunError when Locust left no stats; a history it did not write
    leaves the run without one, and the run says so.
    """
    path = Path(f"{prefix}_stats.csv")
    stats = _rows(path)
    if not stats:
        raise LoadRunError(
            f"Locust exited with {exit_code} and left no stats in {path.name}; {log_tail(prefix)}"
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
        run.history = read_history(history, qty)
    except (KeyError, ValueError) as exc:
        raise LoadRunError(
            f"Locust exited with {exit_code} and left no readable stats ({exc}); {log_tail(prefix)}"
        ) from exc
    if not run.history:
        note_missing(run, f"history: Locust wrote none to {history.name}, so no chart over time")


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


def read_history(path: Path, qty: int) -> list[dict[str, float]]:
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
