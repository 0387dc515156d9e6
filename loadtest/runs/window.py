"""A sale's measured window, and the rates and CPU measured over it.

The window starts once the crowd is in (the first order plus the crowd's ramp) and lasts
`window` seconds, or less if the stock ran out first (`held` says which); units/s is the units
accepted in it per second. A run's requests/s and CPU are measured over the same span (the
baseline's: from once its crowd is in to its end), requests read off the running counts of
Locust's history. See docs/load-runs.md#the-window.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from loadtest.cpu import CpuMeter, per_unit
from loadtest.models import SaleRun

from .config import LoadRunSettings
from .locust_driver import http_totals
from .recording import note_missing


def record_window(
    run: SaleRun, orders: list[tuple[datetime, int]], config: LoadRunSettings
) -> None:
    """Record the sale's measured window (from its live orders, oldest first) and its units/s;
    after `recording.record_audit`, which says whether it sold out."""
    window = measure_window(orders, config, sold_out=run.audit["sold_out"])
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


def record_baseline_rate(
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
        note_missing(
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


def record_window_rate(run: SaleRun, prefix: Path) -> None:
    """A sale's HTTP requests/s over its measured window, the span of its units/s."""
    window = run.audit["window"]
    if window.get("units"):
        totals = http_totals(Path(f"{prefix}_stats_history.csv"))
        rate = requests_between(totals, window["starts_at"], window["ends_at"])
        if rate is None:
            note_missing(
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


def record_window_cpu(run: SaleRun, meter: CpuMeter) -> None:
    """The CPU the sale cost per unit over its window, by part of the system."""
    window = run.audit["window"]
    if window.get("units"):
        cpu = meter.between(window["starts_at"], window["ends_at"])
        if cpu is not None:
            run.audit["cpu"] = {**cpu, "per_unit_ms": per_unit(cpu, window["units"])}
