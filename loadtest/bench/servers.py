"""Benchmark over HTTP: the same crowd against each server design, side by side in one run.

    python manage.py bench servers [--designs sync,granian] [--strategies lua] [--rounds 3]
        [--writer-tree PATH] [--json PATH] [LOADTEST OPTIONS...]

Each design (`DESIGNS`) is a `manage.py loadtest` batch (the demo's crowd, probe, window and
audit) with a server of its own; the designs take turns, round after round in a rotating order,
so that a slow minute of the host falls on each in turn. Printed per strategy and design:
units/s over the window, the latency of the sale's 201s, CPU per unit by part, units per
commit; medians over the rounds with each round's figures, then each design against the best
candidate. Exits 1 if a sale oversold, left units unsold or failed.
See docs/benchmarks.md#the-server-designs-over-http and
docs/decisions/0001-group-commit-in-the-web-process.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from loadtest import sandbox
from shop.processes.servers import GRANIAN_THREADS, GRANIAN_WORKERS, PROJECT_DIR


@dataclass(frozen=True)
class Design:
    name: str
    #: `manage.py loadtest` options of its server.
    options: tuple[str, ...]
    #: Environment of its server (and of the batch that starts it).
    env: tuple[tuple[str, str], ...] = ()
    #: Served from the checkout `--writer-tree` names rather than this one.
    writer_tree: bool = False


#: `writer`: the sale writer the batcher replaced, served from --writer-tree (a checkout of the
#: last commit that had it): the figure to beat, not a candidate. `sync`: gunicorn's sync
#: workers, a script and a commit per checkout. `commit-delay`: the same with PostgreSQL's group
#: commit (a commit waits for others to flush the WAL with it). `gthread`: gunicorn's threads
#: and the in-process batcher. `granian`: granian's WSGI workers and the batcher, the shop's
#: server and shape (`GRANIAN_WORKERS` x `GRANIAN_THREADS`); `granian-4x4` and `granian-1x16`
#: the same server narrower and wider (a batch gathers the checkouts of one worker's threads).
#: The designs measured once and not kept (uvicorn's ASGI workers batching on each event loop;
#: granian with a script and a commit per checkout) are in commit 54ddf64.
DESIGNS = {
    design.name: design
    for design in (
        Design("writer", ("--server-workers", "8"), writer_tree=True),
        Design("sync", ("--server", "sync", "--server-workers", "8")),
        Design(
            "commit-delay",
            ("--server", "sync", "--server-workers", "8"),
            (("PGOPTIONS", "-c commit_delay=200 -c commit_siblings=2"),),
        ),
        Design(
            "gthread", ("--server", "gthread", "--server-workers", "4", "--server-threads", "4")
        ),
        Design(
            "granian",
            (
                *("--server", "granian", "--server-workers", str(GRANIAN_WORKERS)),
                *("--server-threads", str(GRANIAN_THREADS)),
            ),
        ),
        Design(
            "granian-4x4",
            ("--server", "granian", "--server-workers", "4", "--server-threads", "4"),
        ),
        Design(
            "granian-1x16",
            ("--server", "granian", "--server-workers", "1", "--server-threads", "16"),
        ),
    )
}
#: The parts of `loadtest.cpu` that are the shop's own (the crowd and the rest of the host are
#: not): what a unit costs the shop.
SHOP_PARTS = ("server", "writer", "worker", "postgres", "redis")
#: The no-op run every batch starts with: the same crowd against a view that does nothing.
BASELINE = "baseline"


@dataclass
class Figures:
    units_per_second: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    cpu_ms: dict[str, float | None] = field(default_factory=dict)
    units_per_commit: float | None = None
    oversold: int | None = None
    remaining: int | None = None
    error: str = ""

    @property
    def shop_cpu_ms(self) -> float | None:
        parts = [self.cpu_ms.get(part) for part in SHOP_PARTS]
        known = [value for value in parts if value is not None]
        return sum(known) if known else None


def _percentiles(path: Path) -> tuple[float | None, float | None, float | None]:
    """p50, p99, p99.9 of the accepted checkouts (Locust's `checkout` row)."""
    try:
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                if row.get("Name") == "checkout":
                    return (
                        float(row["50%"]) if row.get("50%") not in (None, "", "N/A") else None,
                        float(row["99%"]) if row.get("99%") not in (None, "", "N/A") else None,
                        float(row["99.9%"]) if row.get("99.9%") not in (None, "", "N/A") else None,
                    )
    except OSError:
        pass
    return None, None, None


def _units_per_commit(database_url: str, sku: str) -> float | None:
    """Orders per commit of sku's current sale: a batch's orders share its timestamp."""
    with psycopg.connect(database_url, autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*)::float8 / nullif(count(DISTINCT o.created_at), 0)"
            " FROM inventory_order o JOIN inventory_item i ON o.sale_id = i.current_sale_id"
            " WHERE i.sku = %s",
            [sku],
        ).fetchone()
    return None if row is None else row[0]


def _run_batch(
    design: Design, strategies: list[str], extra: list[str], tree: Path
) -> dict[str, Figures]:
    out = Path(tempfile.mkdtemp(prefix=f"flashsale-servers-{design.name}-"))
    env = {**os.environ, **dict(design.env)}
    # The batch enters the sandbox anew, the sandbox's settings with it (those of an older
    # --writer-tree, which may have no lab settings).
    env.pop(sandbox.MARK, None)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    command = [
        sys.executable,
        "manage.py",
        "loadtest",
        "--strategies",
        ",".join(strategies),
        "--out",
        str(out),
        *design.options,
        *extra,
    ]
    print(f"\n== {design.name}: {' '.join(command[2:])}", flush=True)
    done = subprocess.run(command, cwd=tree, env=env, check=False)
    figures: dict[str, Figures] = {}
    try:
        runs = json.loads((out / "runs.json").read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return {
            name: Figures(error=f"no runs.json (exit {done.returncode})") for name in strategies
        }
    database_url = sandbox.environment(os.environ)["DATABASE_URL"]
    for run in runs:
        name = run["strategy"]
        if name not in strategies and name != BASELINE:
            continue
        cpu_figures = (run.get("audit") or {}).get("cpu") or {}
        cpu = cpu_figures.get("per_request_ms" if name == BASELINE else "per_unit_ms") or {}
        p50, p99, p999 = _percentiles(out / f"{name}_stats.csv")
        figures[name] = Figures(
            # The baseline sells nothing: its rate is requests/s, its CPU per request.
            units_per_second=run.get("requests_per_second" if name == BASELINE else "goodput"),
            p50_ms=p50,
            p99_ms=p99,
            p999_ms=p999,
            cpu_ms={part: cpu.get(part) for part in (*SHOP_PARTS, "locust", "other", "all")},
            units_per_commit=_units_per_commit(database_url, run["sku"])
            if run.get("sku")
            else None,
            oversold=run.get("oversold"),
            remaining=run.get("remaining"),
            error=run.get("error") or "",
        )
    return figures


def _median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


#: The CPU columns of the table, and their widths.
_CPU_COLUMNS = (("server", 8), ("writer", 8), ("worker", 8), ("postgres", 7), ("redis", 7))


def _print(results: dict[str, dict[str, list[Figures]]], strategies: list[str]) -> None:
    header = (
        f"{'design':<13}{'units/s':>9}{'p50':>7}{'p99':>7}{'p99.9':>7}"
        f"{'server':>8}{'writer':>8}{'worker':>8}{'pg':>7}{'redis':>7}{'shop':>7}"
        f"{'crowd':>7}{'other':>7}{'per commit':>11}  rounds (units/s)"
    )
    for strategy in (BASELINE, *strategies):
        if strategy == BASELINE:
            print(f"\n{BASELINE}: medians over the rounds; requests/s, CPU in ms per request")
        else:
            print(f"\n{strategy}: medians over the rounds; latency in ms, CPU in ms per unit")
        print(header)
        print("-" * len(header))
        for design, by_strategy in results.items():
            rounds = by_strategy.get(strategy, [])
            if not rounds:
                continue

            def med(get: Any, rounds: list[Figures] = rounds) -> float | None:
                return _median([get(figures) for figures in rounds])

            print(
                f"{design:<13}"
                f"{_cell(med(lambda f: f.units_per_second)):>9}"
                f"{_cell(med(lambda f: f.p50_ms)):>7}"
                f"{_cell(med(lambda f: f.p99_ms)):>7}"
                f"{_cell(med(lambda f: f.p999_ms)):>7}"
                + "".join(
                    _cell(med(lambda f, p=part: f.cpu_ms.get(p)), 2).rjust(width)
                    for part, width in _CPU_COLUMNS
                )
                + f"{_cell(med(lambda f: f.shop_cpu_ms), 2):>7}"
                f"{_cell(med(lambda f: f.cpu_ms.get('locust')), 2):>7}"
                f"{_cell(med(lambda f: f.cpu_ms.get('other')), 2):>7}"
                f"{_cell(med(lambda f: f.units_per_commit), 2):>11}  "
                + " ".join(_cell(f.units_per_second) for f in rounds)
                + "".join(f"  [{f.error[:60]}]" for f in rounds if f.error)
            )
        if strategy != BASELINE:
            _print_against_baseline(results, strategy)
        candidates = {
            design: _median([f.units_per_second for f in by_strategy.get(strategy, [])])
            for design, by_strategy in results.items()
            if design != "writer"
        }
        known = {design: rate for design, rate in candidates.items() if rate}
        if known:
            best = max(known, key=lambda design: known[design])
            print(
                f"against the best candidate ({best}, {known[best]:,.0f} units/s): "
                + ", ".join(
                    f"{design} {rate / known[best]:.2f}x"
                    for design, rate in {
                        **known,
                        "writer": _median(
                            [
                                f.units_per_second
                                for f in results.get("writer", {}).get(strategy, [])
                            ]
                        ),
                    }.items()
                    if rate
                )
            )


def _print_against_baseline(results: dict[str, dict[str, list[Figures]]], strategy: str) -> None:
    """Each design's units/s against its own baseline's requests/s, round by round."""
    ratios = []
    for design, by_strategy in results.items():
        rounds = [
            sale.units_per_second / baseline.units_per_second
            for sale, baseline in zip(
                by_strategy.get(strategy, []), by_strategy.get(BASELINE, []), strict=False
            )
            if sale.units_per_second and baseline.units_per_second
        ]
        if rounds:
            median = statistics.median(rounds)
            ratios.append(f"{design} {median:.2f}x ({', '.join(f'{r:.2f}' for r in rounds)})")
    if ratios:
        print("against the same design's baseline: " + ", ".join(ratios))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="manage.py bench servers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--designs",
        default="",
        help=f"comma-separated, from: {', '.join(DESIGNS)} (default: all; writer only with "
        "--writer-tree)",
    )
    parser.add_argument(
        "--strategies", default="lock,segmented,lua", help="comma-separated strategy names"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="each design this many times, in rotating order"
    )
    parser.add_argument(
        "--writer-tree",
        type=Path,
        default=None,
        help="a checkout of the last commit with the sale writer (for the `writer` design)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    options, extra = parser.parse_known_args(argv)
    designs = [name.strip() for name in options.designs.split(",") if name.strip()] or [
        name for name in DESIGNS if name != "writer" or options.writer_tree is not None
    ]
    unknown = [name for name in designs if name not in DESIGNS]
    if unknown:
        parser.error(f"unknown designs: {', '.join(unknown)}; choose from {', '.join(DESIGNS)}")
    if "writer" in designs and options.writer_tree is None:
        parser.error("the writer design needs --writer-tree (a checkout of a commit with it)")
    strategies = [name.strip() for name in options.strategies.split(",") if name.strip()]
    results: dict[str, dict[str, list[Figures]]] = {name: {} for name in designs}
    for round_number in range(options.rounds):
        order = designs[round_number % len(designs) :] + designs[: round_number % len(designs)]
        for name in order:
            design = DESIGNS[name]
            tree = options.writer_tree if design.writer_tree else PROJECT_DIR
            for strategy, figures in _run_batch(design, strategies, extra, tree).items():
                results[name].setdefault(strategy, []).append(figures)
        print(f"\n==== after round {round_number + 1} of {options.rounds}")
        _print(results, strategies)
    if options.json:
        options.json.write_text(
            json.dumps(
                {
                    design: {s: [asdict(f) for f in rounds] for s, rounds in by.items()}
                    for design, by in results.items()
                },
                indent=1,
            )
        )
    failed = any(
        f.oversold or f.remaining or f.error
        for by in results.values()
        for rounds in by.values()
        for f in rounds
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
