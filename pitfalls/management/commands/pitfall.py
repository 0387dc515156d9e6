"""`manage.py pitfall list` and `manage.py pitfall run NAME|--all [--json]`: the pitfall lab."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from pitfalls import lab
from pitfalls.scenarios import ARTICLES, SCENARIOS


def _figure(value: float) -> str:
    return f"{value:g}"


@contextmanager
def _expected_noise_left_out(*, shown: bool) -> Iterator[None]:
    """The scenarios make the shop's code log what they force on purpose (a lock that expired
    before its release, a lock lost while held, Redis unreachable): dozens of lines that would
    bury the table. Only errors are shown, unless `shown` (`-v 2`); the processes a scenario
    forks inherit it."""
    if shown:
        yield
        return
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


class Command(BaseCommand):
    help = "The pitfall lab: list the scenarios, or run them the naive way and the shop's way."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="{list,run}")
        actions.add_parser("list", help="the scenarios, what each measures, which article")
        run = actions.add_parser(
            "run",
            help="run scenarios, each on a Redis of its own; exit 1 unless every verdict passes",
        )
        run.add_argument("name", nargs="?", help=f"one of: {', '.join(SCENARIOS)}")
        run.add_argument("--all", action="store_true", help="every scenario, in turn")
        run.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "list":
            self._list()
            return
        names = self._names(options)
        if any(SCENARIOS[name].needs_database for name in names):
            self._enter_sandbox()
        results = []
        with _expected_noise_left_out(shown=options["verbosity"] >= 2):
            for name in names:
                if not options["json"]:
                    self.stderr.write(f"running {name} ...")
                results.append(lab.run(name))
        if options["json"]:
            self.stdout.write(json.dumps({"results": [result.as_dict() for result in results]}))
        else:
            self._table(results)
        failed = [result.scenario.name for result in results if not result.passed]
        if failed:
            raise CommandError(f"verdicts that did not pass: {', '.join(failed)}")

    def _enter_sandbox(self) -> None:
        """Scenarios that sell write items and orders: into the load-run sandbox's database,
        never the shop's (this command starts again there, as `manage.py bench` does)."""
        from loadtest import sandbox

        if sandbox.active():
            return
        try:
            sandbox.enter(sys.argv)
        except sandbox.SandboxError as error:
            raise CommandError(str(error)) from None

    def _names(self, options: dict[str, Any]) -> list[str]:
        name, every = options["name"], options["all"]
        if every and name:
            raise CommandError("name one scenario or --all, not both")
        if every:
            return list(SCENARIOS)
        if not name:
            raise CommandError("name a scenario (pitfall list shows them) or --all")
        if name not in SCENARIOS:
            raise CommandError(f"no scenario {name!r}; choose from {', '.join(SCENARIOS)}")
        return [name]

    def _list(self) -> None:
        for scenario in SCENARIOS.values():
            self.stdout.write(f"{scenario.name}  ({scenario.kind}: {scenario.measure})")
            self.stdout.write(f"    {scenario.warning}")
            self.stdout.write(f"    article: {ARTICLES[scenario.article]}")

    def _table(self, results: list[lab.Result]) -> None:
        rows = [
            (
                result.scenario.name,
                result.scenario.measure,
                _figure(result.naive.damage),
                _figure(result.fixed.damage),
                result.verdict,
            )
            for result in results
        ]
        header = ("scenario", "measure", "naive", "fixed", "verdict")
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, tuple("-" * width for width in widths), *rows]:
            self.stdout.write(
                "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            )
        self.stdout.write("")
        for result in results:
            scenario = result.scenario
            self.stdout.write(f"{scenario.name}: {scenario.explanation}")
            self.stdout.write(f"    {ARTICLES[scenario.article]}: {scenario.warning}")
