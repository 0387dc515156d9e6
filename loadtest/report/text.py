"""The comparison, the CPU table and the rounds' medians as fixed-width text, for the terminal.
See docs/load-runs.md#the-comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadtest.models import SaleRun

from .columns import BASELINE, COLUMNS, CPU_HEADER, CPU_LEGEND, cell, cpu_rows, notes
from .ratios import REFERENCE, comparisons


def table(runs: Sequence[SaleRun]) -> str:
    """The comparison as fixed-width text, the ratios between the strategies under it."""
    rows = [[cell(run, key) for key, _ in COLUMNS] for run in runs]
    lines = fixed_width([label for _, label in COLUMNS], rows)
    lines += comparisons(runs)
    lines += [f"* {note}" for note in notes(runs)]
    return "\n".join(lines)


def fixed_width(header: list[str], rows: list[list[str]]) -> list[str]:
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


def cpu_table(runs: Sequence[SaleRun]) -> str:
    """Where each run's CPU went, per unit sold, as fixed-width text ("" if none was measured)."""
    rows = cpu_rows(runs)
    if not rows:
        return ""
    return "\n".join([*fixed_width(CPU_HEADER, rows), CPU_LEGEND])


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
    lines += fixed_width(["contender", "units/s", "rounds", "cpu ms per unit"], rows)
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
