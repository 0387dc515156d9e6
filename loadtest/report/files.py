"""The report of a batch on disk: runs.csv, runs.json and report.html, one self-contained file
whose charts are inline SVG. See docs/load-runs.md#the-comparison.
"""

from __future__ import annotations

import csv
import html
import json
from collections.abc import Sequence
from pathlib import Path

from loadtest.models import SaleRun

from .charts import charts
from .columns import (
    COLUMNS,
    CPU_HEADER,
    CPU_LEGEND,
    LEGEND,
    cell,
    cpu_rows,
    figure,
    notes,
    window_of,
)
from .ratios import comparisons, goodput_ratios


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


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th scope='col'>{html.escape(label)}</th>" for label in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(value)}</td>" for value in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
