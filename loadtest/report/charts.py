"""The charts of a comparison as inline SVG: the HTML report opens offline and from a CI
artifact store alike, and the admin's compare page draws the same charts.
See docs/load-runs.md#the-comparison.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from loadtest.models import SaleRun

from .columns import BASELINE

#: One color per contender, the same in every chart.
COLORS = {
    BASELINE: "#555555",
    "lock": "#0a58ca",
    "segmented": "#198754",
    "lua": "#9a6700",
    "optimistic": "#6f42c1",
    "unsafe": "#b02a37",
}


def color(name: str) -> str:
    return COLORS.get(name, "#0f7c8c")


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
