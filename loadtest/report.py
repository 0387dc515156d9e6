"""The comparison of a batch of load runs: a table for the terminal, CSV, JSON and HTML.

The HTML report is one self-contained file: its charts are inline SVG drawn here, so it opens
offline and from a CI artifact store alike.
"""

from __future__ import annotations

import csv
import html
import json
from collections.abc import Sequence
from pathlib import Path

from inventory.models import SaleRun

COLUMNS = [
    ("strategy", "strategy"),
    ("requests_per_second", "req/s"),
    ("ratio_to_baseline", "x HTTP"),
    ("goodput", "units/s"),
    ("p50_ms", "p50 ms"),
    ("p95_ms", "p95 ms"),
    ("p99_ms", "p99 ms"),
    ("failures", "failed"),
    ("accepted_units", "accepted"),
    ("oversold", "oversold"),
    ("remaining", "remaining"),
    ("sold_out_after_seconds", "sold out s"),
    ("fallback_activations", "fallback"),
    ("lock_wait_p99_ms", "lock p99 ms"),
]
#: One color per contender, the same in every chart.
COLORS = {
    "baseline": "#555555",
    "lock": "#0a58ca",
    "segmented": "#198754",
    "lua": "#9a6700",
    "optimistic": "#6f42c1",
    "unsafe": "#b02a37",
}


def color(name: str) -> str:
    return COLORS.get(name, "#0f7c8c")


def cell(run: SaleRun, key: str) -> str:
    value = run.strategy if key == "strategy" else getattr(run, key)
    if value is None:
        return "-"
    if key == "ratio_to_baseline":
        return f"{value:.2f}"
    if isinstance(value, float):
        return f"{value:.1f}" if value < 100 else f"{value:.0f}"
    return str(value)


def table(runs: Sequence[SaleRun]) -> str:
    """The comparison as fixed-width text."""
    rows = [[label for _, label in COLUMNS]] + [
        [cell(run, key) for key, _ in COLUMNS] for run in runs
    ]
    widths = [max(len(row[index]) for row in rows) for index in range(len(COLUMNS))]
    lines = []
    for number, row in enumerate(rows):
        lines.append(
            "  ".join(
                value.ljust(width) if index == 0 else value.rjust(width)
                for index, (value, width) in enumerate(zip(row, widths, strict=True))
            )
        )
        if number == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def write_report(runs: Sequence[SaleRun], out: Path) -> dict[str, Path]:
    """Write runs.csv, runs.json and report.html into out; return their paths."""
    from .runs import run_as_dict

    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": out / "runs.csv", "json": out / "runs.json", "html": out / "report.html"}
    records = [run_as_dict(run) for run in runs]
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


def render_html(runs: Sequence[SaleRun]) -> str:
    strategies = [run for run in runs if run.strategy != "baseline"]
    baseline = next((run for run in runs if run.strategy == "baseline"), None)
    first = runs[0]
    title = f"flashsale load runs {first.batch}"
    parameters = ", ".join(f"{key} {value}" for key, value in first.parameters.items())
    head = "".join(f"<th scope='col'>{html.escape(label)}</th>" for _, label in COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell(run, key))}</td>" for key, _ in COLUMNS) + "</tr>"
        for run in runs
    )
    charts = [
        bar_chart(
            "Throughput (requests/s)",
            [(run.strategy, run.requests_per_second or 0) for run in runs],
            reference=("HTTP ceiling", baseline.requests_per_second) if baseline else None,
        ),
        bar_chart("Checkout p99 (ms)", [(run.strategy, run.p99_ms or 0) for run in runs]),
        bar_chart("Oversold units", [(run.strategy, run.oversold or 0) for run in strategies]),
        line_chart(
            "Units sold over time (s)",
            [
                (run.strategy, [(p["t"], p["units_sold"]) for p in run.history])
                for run in strategies
            ],
        ),
    ]
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
<p>{html.escape(parameters)}. <em>x HTTP</em>: requests/s as a share of the baseline measured
in the same batch against a no-op endpoint; <em>units/s</em>: units accepted per second until
sold out; <em>oversold</em>: accepted beyond the initial stock.</p>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
<div class="charts">{"".join(charts)}</div>
</body></html>
"""


def _scale(top: float) -> float:
    return top if top > 0 else 1.0


def bar_chart(
    title: str,
    values: Sequence[tuple[str, float]],
    reference: tuple[str, float | None] | None = None,
) -> str:
    width, height, left, bottom = 420, 220, 40, 40
    top = _scale(max([v for _, v in values] + [reference[1] or 0 if reference else 0]))
    slot = (width - left) / max(len(values), 1)
    bars = []
    for index, (label, value) in enumerate(values):
        bar_height = (height - bottom - 10) * value / top
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
        y = height - bottom - (height - bottom - 10) * reference[1] / top
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
