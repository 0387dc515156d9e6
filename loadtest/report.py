"""The comparison of a batch of load runs: a table for the terminal, CSV, JSON and HTML.

The headline is units/s over each sale's measured window (see loadtest.runs); the table says
beside it how long the window really lasted, and a note under it says so again for a window
cut short by the stock running out: a short window is shown, never hidden.

The HTML report is one self-contained file: its charts are inline SVG drawn here, so it opens
offline and from a CI artifact store alike. The admin's compare page draws the same charts.
"""

from __future__ import annotations

import csv
import html
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
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
#: One color per contender, the same in every chart.
COLORS = {
    BASELINE: "#555555",
    "lock": "#0a58ca",
    "segmented": "#198754",
    "lua": "#9a6700",
    "optimistic": "#6f42c1",
    "unsafe": "#b02a37",
}


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


def color(name: str) -> str:
    return COLORS.get(name, "#0f7c8c")


def window_of(run: SaleRun) -> dict[str, Any]:
    """The run's measured window (see loadtest.runs.measure_window); empty for a baseline."""
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


#: The strategy the others' units/s are held against (one lock per item, no shards).
REFERENCE = "lock"


def goodput_ratios(run: SaleRun, runs: Sequence[SaleRun]) -> dict[str, float | None]:
    """run's units/s as a multiple of the units/s of the `lock` run of its batch (among runs),
    and of its baseline's requests/s; None where a figure is missing (a baseline run, a run
    that failed, a batch without `lock` or without a baseline)."""
    ratios: dict[str, float | None] = {"goodput_to_lock": None, "goodput_to_baseline": None}
    if run.strategy == BASELINE or not run.goodput:
        return ratios
    reference = next(
        (other for other in runs if other.batch == run.batch and other.strategy == REFERENCE),
        None,
    )
    if reference is not None and reference.goodput:
        ratios["goodput_to_lock"] = run.goodput / reference.goodput
    if run.baseline_requests_per_second:
        ratios["goodput_to_baseline"] = run.goodput / run.baseline_requests_per_second
    return ratios


def comparisons(runs: Sequence[SaleRun]) -> list[str]:
    """One line per batch among runs: each strategy's units/s as a multiple of `lock`'s and of
    the baseline's requests/s, measured side by side in that batch (the ratios the strategies
    are judged by). The batch is named only when runs come from several."""
    batches = list(dict.fromkeys(run.batch for run in runs))
    lines = []
    for batch in batches:
        members = [run for run in runs if run.batch == batch]
        sales = [run for run in members if run.strategy != BASELINE and run.goodput]
        ratios = {run.strategy: goodput_ratios(run, members) for run in sales}
        to_lock = [
            f"{strategy} {ratio['goodput_to_lock']:.2f}x"
            for strategy, ratio in ratios.items()
            if strategy != REFERENCE and ratio["goodput_to_lock"] is not None
        ]
        to_baseline = [
            f"{strategy} {ratio['goodput_to_baseline']:.2f}x"
            for strategy, ratio in ratios.items()
            if ratio["goodput_to_baseline"] is not None
        ]
        parts = []
        if to_lock:
            reference = next(run for run in sales if run.strategy == REFERENCE)
            parts.append(
                f"units/s against {REFERENCE}'s {reference.goodput:.0f}: " + ", ".join(to_lock)
            )
        if to_baseline:
            baseline = next(
                run.baseline_requests_per_second
                for run in sales
                if run.baseline_requests_per_second
            )
            parts.append(
                f"against the baseline's {baseline:.0f} requests/s: " + ", ".join(to_baseline)
            )
        if parts:
            lines.append(("" if len(batches) == 1 else f"{batch}: ") + "; ".join(parts))
    return lines


def round_figures(rounds: Sequence[Sequence[SaleRun]]) -> dict[str, Any]:
    """The figures of several rounds of one load run, each round a batch of its own (the
    baseline and every strategy, in turn): per contender its median units/s (the baseline's:
    requests/s) and CPU per unit, and the ratios the strategies are judged by, each the ratio
    of two medians beside the ratio of every round. A run that failed counts in no median, and
    leaves its round's ratios out (None)."""

    def rate(run: SaleRun) -> float | None:
        if run.status != SaleRun.Status.DONE:
            return None
        return run.requests_per_second if run.strategy == BASELINE else run.goodput

    def cpu_all(run: SaleRun) -> float | None:
        cpu = run.audit.get("cpu") or {}
        costs = cpu.get("per_unit_ms") or cpu.get("per_request_ms") or {}
        return costs.get("all") if run.status == SaleRun.Status.DONE else None

    def median(values: list[float | None]) -> float | None:
        present = [value for value in values if value is not None]
        return statistics.median(present) if present else None

    names = list(dict.fromkeys(run.strategy for runs in rounds for run in runs))
    rates: dict[str, list[float | None]] = {}
    contenders: dict[str, dict[str, Any]] = {}
    for name in names:
        members = [next((run for run in runs if run.strategy == name), None) for runs in rounds]
        rates[name] = [None if run is None else rate(run) for run in members]
        contenders[name] = {
            "median": median(rates[name]),
            "rounds": rates[name],
            "cpu_ms_per_unit": median([None if run is None else cpu_all(run) for run in members]),
        }

    def against(reference: str, names: list[str]) -> dict[str, dict[str, Any]]:
        if reference not in rates:
            return {}
        ratios = {}
        for name in names:
            by_round = [
                mine / theirs if mine and theirs else None
                for mine, theirs in zip(rates[name], rates[reference], strict=True)
            ]
            mine, theirs = contenders[name]["median"], contenders[reference]["median"]
            ratios[name] = {
                "ratio": mine / theirs if mine and theirs else None,
                "rounds": by_round,
            }
        return ratios

    sales = [name for name in names if name != BASELINE]
    return {
        "batches": [runs[0].batch if runs else None for runs in rounds],
        "contenders": contenders,
        "against_lock": against(REFERENCE, [name for name in sales if name != REFERENCE]),
        "against_baseline": against(BASELINE, sales),
    }


def rounds_summary(figures: dict[str, Any]) -> list[str]:
    """round_figures as lines of text: the medians, then the ratios, each round's beside."""

    def number(value: float | None, form: str = "{:.0f}") -> str:
        return "-" if value is None else form.format(value)

    count = len(figures["batches"])
    contenders = figures["contenders"]
    rows = [
        [
            name,
            number(figure["median"]),
            ", ".join(number(value) for value in figure["rounds"]),
            number(figure["cpu_ms_per_unit"], "{:.2f}"),
        ]
        for name, figure in contenders.items()
    ]
    lines = [f"medians of {count} rounds, each round a batch of its own:"]
    lines += _fixed_width(["contender", "units/s", "rounds", "cpu ms per unit"], rows)
    for reference, label in ((REFERENCE, "units/s"), (BASELINE, "requests/s")):
        ratios = figures["against_lock" if reference == REFERENCE else "against_baseline"]
        shown = [
            f"{name} {number(ratio['ratio'], '{:.2f}x')} (rounds: "
            + ", ".join(number(value, "{:.2f}x") for value in ratio["rounds"])
            + ")"
            for name, ratio in ratios.items()
            if ratio["ratio"] is not None
        ]
        if shown:
            median = contenders[reference]["median"]
            lines.append(
                f"units/s against {'the baseline' if reference == BASELINE else reference}'s "
                f"median {median:.0f} {label}: " + ", ".join(shown)
            )
    lines.append(
        "units/s (the baseline: requests/s) is the median of the rounds; each ratio is the "
        "ratio of two medians, every round's own ratio beside it; cpu: the host's busy CPU "
        "per unit sold (the baseline: per request), median of the rounds."
    )
    return lines


def table(runs: Sequence[SaleRun]) -> str:
    """The comparison as fixed-width text, the ratios between the strategies under it."""
    rows = [[cell(run, key) for key, _ in COLUMNS] for run in runs]
    lines = _fixed_width([label for _, label in COLUMNS], rows)
    lines += comparisons(runs)
    lines += [f"* {note}" for note in notes(runs)]
    return "\n".join(lines)


def _fixed_width(header: list[str], rows: list[list[str]]) -> list[str]:
    """A header, a rule and the rows, each column as wide as its widest cell: the first left
    aligned, the others right aligned."""
    everything = [header, *rows]
    widths = [max(len(row[index]) for row in everything) for index in range(len(header))]
    lines = [
        "  ".join(
            value.ljust(width) if index == 0 else value.rjust(width)
            for index, (value, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in everything
    ]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th scope='col'>{html.escape(label)}</th>" for label in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(value)}</td>" for value in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


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


def cpu_table(runs: Sequence[SaleRun]) -> str:
    """Where each run's CPU went, per unit sold, as fixed-width text ("" if none was measured)."""
    rows = cpu_rows(runs)
    if not rows:
        return ""
    return "\n".join([*_fixed_width(CPU_HEADER, rows), CPU_LEGEND])


def cpu_rows(runs: Sequence[SaleRun]) -> list[list[str]]:
    """The CPU table's rows (under CPU_HEADER): the runs that measured it."""
    return [[run.strategy, *cells] for run in runs if (cells := cpu_cells(run)) is not None]


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


def run_as_dict(run: SaleRun) -> dict:
    """A SaleRun as plain data, for the JSON report and the admin."""
    data = {}
    for model_field in run._meta.concrete_fields:
        value = getattr(run, model_field.attname)
        data[model_field.name] = value.isoformat() if hasattr(value, "isoformat") else value
    data["ratio_to_baseline"] = run.ratio_to_baseline
    data["window_seconds"] = figure(run, "window_seconds")
    data["window_held"] = window_of(run).get("held")
    data["lost_updates"] = figure(run, "lost_updates")
    return data


def write_report(runs: Sequence[SaleRun], out: Path) -> dict[str, Path]:
    """Write runs.csv, runs.json and report.html into out; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": out / "runs.csv", "json": out / "runs.json", "html": out / "report.html"}
    records = [{**run_as_dict(run), **goodput_ratios(run, runs)} for run in runs]
    flat_keys = [key for key in records[0] if key not in {"history", "audit", "parameters"}]
    with open(files["csv"], "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*flat_keys, "parameters"])
        writer.writeheader()
        for record in records:
            writer.writerow(
                {
                    **{key: record[key] for key in flat_keys},
                    "parameters": json.dumps(record["parameters"]),
                }
            )
    files["json"].write_text(json.dumps({"runs": records}, indent=2))
    files["html"].write_text(render_html(runs))
    return files


def charts(labelled: Sequence[tuple[str, SaleRun]]) -> list[str]:
    """The charts of runs, each shown under its label; the headline first."""
    sales = [(label, run) for label, run in labelled if run.strategy != BASELINE]
    baselines = [run.requests_per_second for _, run in labelled if run.strategy == BASELINE]
    reference = ("HTTP ceiling", baselines[0]) if len(baselines) == 1 else None
    return [
        bar_chart("Units/s over the window", [(label, run.goodput or 0) for label, run in sales]),
        bar_chart(
            "Throughput (requests/s)",
            [(label, run.requests_per_second or 0) for label, run in labelled],
            reference=reference,
        ),
        bar_chart("Checkout p99 (ms)", [(label, run.p99_ms or 0) for label, run in labelled]),
        bar_chart("Oversold units", [(label, run.oversold or 0) for label, run in sales]),
        line_chart(
            "Units sold over time (s)",
            [(label, [(s["t"], s["units_sold"]) for s in run.history]) for label, run in sales],
        ),
        line_chart(
            "Orders pending, from the opening (s)",
            [(label, pending_series(run)) for label, run in sales],
        ),
    ]


def pending_series(run: SaleRun) -> list[tuple[float, float]]:
    """(seconds from the opening, orders pending) of a run, one point a second."""
    return [(second, count) for second, count in (run.audit.get("settle") or {}).get("pending", [])]


def render_html(runs: Sequence[SaleRun]) -> str:
    first = runs[0]
    title = f"flashsale load runs {first.batch}"
    parameters = ", ".join(
        f"{key} {', '.join(value) if isinstance(value, list) else value}"
        for key, value in first.parameters.items()
        if key != "probe" and value is not None
    )
    comparison = _html_table(
        [label for _, label in COLUMNS], [[cell(run, key) for key, _ in COLUMNS] for run in runs]
    )
    ratios = "".join(f"<p>{html.escape(line)}</p>" for line in comparisons(runs))
    remarks = "".join(f"<li>{html.escape(note)}</li>" for note in notes(runs))
    rows = cpu_rows(runs)
    cpu = f"{_html_table(CPU_HEADER, rows)}<p>{html.escape(CPU_LEGEND)}</p>" if rows else ""
    figures = charts([(run.strategy, run) for run in runs])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem; color: #1d1d1f; }}
table {{ border-collapse: collapse; margin: 1rem 0; }}
th, td {{ border-bottom: 1px solid #ccc; padding: .3rem .6rem; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 1.5rem; }}
figure {{ margin: 0; }} figcaption {{ font-weight: 600; margin-bottom: .3rem; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(parameters)}.</p>
<p>{LEGEND}</p>
{comparison}
{ratios}
<ul>{remarks}</ul>
{cpu}
<div class="charts">{"".join(figures)}</div>
</body></html>
"""


def _scale(top: float) -> float:
    return top if top > 0 else 1.0


#: Room above the tallest bar for the value written over it (a 10 px figure and its gap).
LABEL_ROOM = 18


def bar_chart(
    title: str,
    values: Sequence[tuple[str, float]],
    reference: tuple[str, float | None] | None = None,
) -> str:
    width, height, left, bottom = 420, 220, 40, 40
    top = _scale(max([v for _, v in values] + [reference[1] or 0 if reference else 0]))
    tallest = height - bottom - LABEL_ROOM  # the value over the tallest bar stays inside
    slot = (width - left) / max(len(values), 1)
    bars = []
    for index, (label, value) in enumerate(values):
        bar_height = tallest * value / top
        x = left + index * slot + slot * 0.15
        y = height - bottom - bar_height
        fill = color(label)
        bars.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{slot * 0.7:.1f}" height="{bar_height:.1f}" '
            f'fill="{fill}"><title>{html.escape(label)}: {value:.1f}</title></rect>'
            f'<text x="{x + slot * 0.35:.1f}" y="{y - 3:.1f}" font-size="10" '
            f'text-anchor="middle">{value:.0f}</text>'
            f'<text x="{x + slot * 0.35:.1f}" y="{height - bottom + 14}" font-size="10" '
            f'text-anchor="middle">{html.escape(label)}</text>'
        )
    if reference and reference[1]:
        y = height - bottom - tallest * reference[1] / top
        bars.append(
            f'<line x1="{left}" x2="{width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#333" '
            f'stroke-dasharray="4 3"/><text x="{width}" y="{y - 3:.1f}" font-size="10" '
            f'text-anchor="end">{html.escape(reference[0])}</text>'
        )
    axis = (
        f'<line x1="{left}" x2="{width}" y1="{height - bottom}" y2="{height - bottom}" '
        'stroke="#333"/>'
    )
    return _figure(title, width, height, axis + "".join(bars))


def line_chart(title: str, series: Sequence[tuple[str, Sequence[tuple[float, float]]]]) -> str:
    width, height, left, bottom = 420, 220, 40, 40
    points = [point for _, line in series for point in line]
    max_x = _scale(max((x for x, _ in points), default=0))
    max_y = _scale(max((y for _, y in points), default=0))
    shapes = []
    for index, (label, line) in enumerate(series):
        stroke = color(label)
        coords = " ".join(
            f"{left + (width - left - 10) * x / max_x:.1f},"
            f"{height - bottom - (height - bottom - 10) * y / max_y:.1f}"
            for x, y in line
        )
        if coords:
            shapes.append(
                f'<polyline points="{coords}" fill="none" stroke="{stroke}" stroke-width="2">'
                f"<title>{html.escape(label)}</title></polyline>"
            )
        shapes.append(
            f'<text x="{left + 5 + index * 70}" y="{height - 8}" font-size="10" '
            f'fill="{stroke}">{html.escape(label)}</text>'
        )
    axes = (
        f'<line x1="{left}" x2="{width}" y1="{height - bottom}" y2="{height - bottom}" '
        f'stroke="#333"/><line x1="{left}" x2="{left}" y1="10" y2="{height - bottom}" '
        f'stroke="#333"/><text x="{left - 4}" y="16" font-size="10" text-anchor="end">'
        f'{max_y:.0f}</text><text x="{width - 10}" y="{height - bottom + 14}" font-size="10" '
        f'text-anchor="end">{max_x:.0f} s</text>'
    )
    return _figure(title, width, height, axes + "".join(shapes))


def _figure(title: str, width: int, height: int, content: str) -> str:
    return (
        f"<figure><figcaption>{html.escape(title)}</figcaption>"
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{html.escape(title)}" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}">{content}</svg>'
        "</figure>"
    )
