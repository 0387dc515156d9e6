"""What each column of the comparison shows, and the notes under it.

The headline is units/s over each sale's measured window (`loadtest.runs.window`); the table
says beside it how long the window really lasted, and a note under it says so again for a
window cut short by the stock running out: a short window is shown, never hidden.
See docs/load-runs.md#the-comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadtest.cpu import PARTS
from loadtest.models import SaleRun

#: The run that floods a no-op endpoint: the HTTP ceiling the strategies are compared with.
BASELINE = "baseline"
COLUMNS = [
    ("strategy", "strategy"),
    ("goodput", "units/s"),
    ("window_seconds", "window s"),
    ("p99_ms", "p99 ms"),
    ("sold_out_after_seconds", "sold out s"),
    ("initial_stock", "stock"),
    ("accepted_units", "accepted"),
    ("oversold", "oversold"),
    ("lost_updates", "lost updates"),
    ("remaining", "remaining"),
    ("requests_per_second", "req/s"),
    ("ratio_to_baseline", "x HTTP"),
    ("failures", "failed"),
    ("fallback_activations", "fallback"),
    ("lock_wait_p99_ms", "lock p99 ms"),
    ("settle_p50_ms", "settle p50 ms"),
    ("settle_p99_ms", "settle p99 ms"),
]
#: Figures a run keeps in its audit JSON rather than in a field of its own.
AUDIT_FIGURES = {"lost_updates"}


#: What the columns mean, for the HTML report and the admin page (HTML).
LEGEND = (
    "<em>units/s</em>: units accepted per second over the measured window, which starts once "
    "the crowd is in and lasts <em>window s</em> (<em>short</em>: the stock ran out first); "
    "<em>p99 ms</em>: checkout latency while the sale sold; <em>sold out s</em>: from the "
    "opening to the last unit; <em>oversold</em>: accepted beyond the stock; <em>lost "
    "updates</em>: units accepted beyond what the stock went down by; <em>remaining</em>: "
    "stock not sold; <em>req/s</em>: HTTP requests per second over the same window (the "
    "baseline's: from once its crowd is in to its end); <em>x HTTP</em>: that as a share of "
    "the baseline measured in the same batch against a no-op endpoint; <em>settle p50/p99 "
    "ms</em>: from an order's 201 to its final status (paid and confirmed, or failed), the "
    "worker running throughout."
)


def window_of(run: SaleRun) -> dict[str, Any]:
    """The run's measured window (see `loadtest.runs.window`); empty for a baseline."""
    return run.audit.get("window") or {}


def figure(run: SaleRun, key: str) -> Any:
    """The value behind a column: a field, a property, or a figure of the run's audit."""
    if key == "strategy":
        return run.strategy
    if key in AUDIT_FIGURES:
        return run.audit.get(key)
    if key == "window_seconds":
        return window_of(run).get("seconds")
    return getattr(run, key)


def cell(run: SaleRun, key: str) -> str:
    value = figure(run, key)
    if value is None:
        return "-"
    if key == "ratio_to_baseline":
        return f"{value:.2f}"
    if key == "window_seconds":
        return f"{value:.1f}" + ("" if window_of(run).get("held") else " short")
    if isinstance(value, float):
        return f"{value:.1f}" if value < 100 else f"{value:.0f}"
    return str(value)


def notes(runs: Sequence[SaleRun]) -> list[str]:
    """One line per run whose figures need a word: a window cut short, a sale not sold out,
    stock stranded, a figure that could not be measured, a run that failed."""
    lines = []
    for run in runs:
        window = window_of(run)
        if run.status == SaleRun.Status.FAILED:
            lines.append(f"{run.strategy}: the run failed: {run.error}")
            continue
        lines += [
            f"{run.strategy}: not measured: {missing}" for missing in run.audit.get("missing", [])
        ]
        if window and not window.get("held"):
            ended = {"sold out": "the stock ran out", "cap": "the sale was cut off"}
            lines.append(
                f"{run.strategy}: its window lasted {window['seconds']:.1f} s, not "
                f"{window['target_seconds']:g} s "
                f"({ended.get(window.get('ended_by') or '', 'it ended')}): "
                "its units/s covers only that"
            )
        settle = run.audit.get("settle") or {}
        if settle.get("unsettled"):
            lines.append(
                f"{run.strategy}: {settle['unsettled']} of {settle['orders']} orders were not "
                f"settled {settle.get('waited_seconds') or 0:g} s after the sale: its settle "
                "lag covers the settled ones only"
            )
        if run.strategy != BASELINE and not run.audit.get("sold_out", True):
            lines.append(
                f"{run.strategy}: {run.audit.get('db_stock')} units were left "
                + (
                    "while buyers were told sold out: stranded stock"
                    if stranded(run)
                    else "when the run was cut off"
                )
            )
    return lines


def stranded(run: SaleRun) -> bool:
    """Buyers of a sale were told sold out while the database still held units for it."""
    return bool(run.audit.get("sold_out_answers")) and not run.audit.get("sold_out", True)


def summary_line(run: SaleRun) -> str:
    """One line of a run's figures, for the progress of a batch."""
    parts = [f"{run.requests_per_second or 0:.0f} req/s", f"p99 {run.p99_ms or 0:.0f} ms"]
    if run.strategy != BASELINE:
        window = window_of(run)
        parts = [
            f"{run.goodput or 0:.0f} units/s over {window.get('seconds', 0):.1f} s"
            + ("" if window.get("held") else f" (short of {window.get('target_seconds')} s)"),
            *parts,
            f"accepted {run.accepted_units} of {run.initial_stock}",
            f"oversold {run.oversold}",
            f"lost updates {run.audit.get('lost_updates')}",
            f"remaining {run.remaining}",
        ]
        if run.settle_p99_ms is not None:
            parts.append(f"settled in {run.settle_p50_ms:.0f}/{run.settle_p99_ms:.0f} ms (p50/p99)")
    if run.failures:
        parts.append(f"{run.failures} failed requests")
    return ", ".join(parts)


#: The CPU table's columns: the parts of `loadtest.cpu`, all of them, and how busy the host was.
CPU_HEADER = ["cpu ms per unit", *PARTS, "all", "host busy"]
CPU_LEGEND = (
    "CPU per unit sold over the window, in ms (the baseline: per request once the crowd is in), "
    "by part of the system on this host: server (the web server), worker "
    "(Celery), locust (the crowd), postgres and redis (every such process here), other (the "
    "rest of the host's busy CPU); all: the host's busy CPU; host busy: its share of the "
    "host's CPUs. A rate on a busy host is set by what a unit costs in all."
)


def cpu_cells(run: SaleRun) -> list[str] | None:
    """The run's row of the CPU table, or None when it was not measured."""
    cpu = run.audit.get("cpu") or {}
    costs = cpu.get("per_unit_ms") or cpu.get("per_request_ms")
    if not costs:
        return None
    cells = ["-" if costs.get(part) is None else f"{costs[part]:.2f}" for part in [*PARTS, "all"]]
    busy = cpu.get("host_busy")
    return [*cells, "-" if busy is None else f"{busy:.0%}"]


def cpu_rows(runs: Sequence[SaleRun]) -> list[list[str]]:
    """The CPU table's rows (under CPU_HEADER): the runs that measured it."""
    return [[run.strategy, *cells] for run in runs if (cells := cpu_cells(run)) is not None]
