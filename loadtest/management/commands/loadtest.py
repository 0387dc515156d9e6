"""`manage.py loadtest`: flood each strategy with Locust and compare them."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor

from inventory.exceptions import InvalidRequest
from inventory.strategies import oversells, strategy_names
from loadtest import sandbox
from loadtest.report.columns import BASELINE, stranded
from loadtest.report.ratios import round_figures
from loadtest.report.text import cpu_table, rounds_summary, table
from loadtest.runs.batch import BATCH_ID, MAX_ROUNDS, Batch, run_batch, run_rounds
from loadtest.runs.config import SETTLE_TIMEOUT, LoadRunSettings
from shop.processes.servers import GRANIAN_THREADS, GRANIAN_WORKERS, SERVER_KINDS


class LiveProgress:
    """Writes a batch's progress to `out`: on a terminal, each live line replaces the one before
    it in place; elsewhere (a log, a pipe) every line is a line of its own."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.in_place = out.isatty()
        self._live_shown = False

    def __call__(self, line: str, *, live: bool = False) -> None:
        if live and self.in_place:
            self.out.write(f"\r\x1b[2K{line}", ending="")
            self._live_shown = True
        else:
            if self._live_shown:
                self.out.write("")  # ends the live line
                self._live_shown = False
            self.out.write(line)
        self.out.flush()


class Command(BaseCommand):
    help = (
        "Flood each strategy in turn with Locust (after a baseline against a no-op endpoint): "
        "a short probe sizes its stock so that the sale still sells through a measured window "
        "(--window), then the crowd buys the rest until it sells out; audit it, record a sale "
        "run, print the comparison (units/s over the window first) and write CSV, JSON and "
        "HTML. With --stock the stock is fixed and there is no probe. Exits non-zero if a "
        "strategy other than unsafe oversold or left stock stranded, or a run broke."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--strategies",
            default=",".join(strategy_names()),
            help="comma-separated strategy names (default: all)",
        )
        parser.add_argument(
            "--stock",
            type=int,
            default=None,
            help="units per sale, the same for every strategy, no probe (default: each "
            "strategy's own, sized by a probe to last the window and --headroom)",
        )
        parser.add_argument("--users", type=int, default=40, help="concurrent Locust users")
        parser.add_argument(
            "--spawn-rate", type=float, default=100.0, help="users started per second"
        )
        parser.add_argument(
            "--window",
            type=float,
            default=10.0,
            help="seconds each sale must still be selling once the crowd is in: what units/s "
            "measures (default 10)",
        )
        parser.add_argument(
            "--duration",
            type=int,
            default=None,
            help="at most this many seconds of sale per strategy, from its opening; a sale ends "
            "earlier once sold out (default: twice the crowd's ramp-up and --headroom windows)",
        )
        parser.add_argument(
            "--headroom",
            type=float,
            default=1.5,
            help="a probe-sized stock lasts window x headroom at the probe's pace (default 1.5)",
        )
        parser.add_argument(
            "--host",
            default=None,
            help="flood this server (sharing this database) instead of starting one",
        )
        parser.add_argument("--out", type=Path, default=None, help="report folder")
        parser.add_argument(
            "--workers", type=int, default=1, help="Locust processes (distributed run)"
        )
        parser.add_argument("--qty", type=int, default=1, help="units per checkout")
        parser.add_argument(
            "--server-workers",
            type=int,
            default=GRANIAN_WORKERS,
            help=f"server workers when started here (default {GRANIAN_WORKERS})",
        )
        parser.add_argument(
            "--server",
            choices=SERVER_KINDS,
            default="granian",
            help="the server started here: granian's WSGI workers (the shop's), or gunicorn's "
            "sync or gthread workers (default: granian)",
        )
        parser.add_argument(
            "--server-threads",
            type=int,
            default=GRANIAN_THREADS,
            help=f"threads per server worker, for granian and gthread (default {GRANIAN_THREADS})",
        )
        parser.add_argument(
            "--settle-timeout",
            type=float,
            default=SETTLE_TIMEOUT,
            help="seconds to wait, after each sale, for the worker to settle its orders before "
            f"the next (default {SETTLE_TIMEOUT:g}; 0: no wait, the worker goes on with them "
            "during the next runs); the settle lag is measured then",
        )
        parser.add_argument(
            "--unsafe-delay-ms",
            type=int,
            default=5,
            help="simulated work between unsafe's read and write, on a server started here",
        )
        parser.add_argument(
            "--warmup",
            type=float,
            default=None,
            help="seconds of a trickle of early visitors before the sale opens and the "
            "crowd arrives (default 1)",
        )

        parser.add_argument(
            "--rounds",
            type=int,
            default=1,
            help="run the baseline and every strategy this many times over, on the same "
            "server, each round a batch of its own, starting one contender further on "
            "than the last; print every round, then each "
            "strategy's median and the ratios of the medians beside every round's "
            f"(default 1, at most {MAX_ROUNDS})",
        )
        parser.add_argument(
            "--no-sandbox",
            action="store_true",
            help="sell in the configured database itself, not in the load-run database beside "
            "it (<name>_loadrun, see docs/load-runs.md)",
        )
        # The batch id, when the admin's load-run task has chosen it already.
        parser.add_argument("--batch", default=None, help=argparse.SUPPRESS)

    def handle(self, *args: Any, **options: Any) -> None:
        config = LoadRunSettings(
            strategies=[name.strip() for name in options["strategies"].split(",") if name.strip()],
            stock=options["stock"],
            users=options["users"],
            spawn_rate=options["spawn_rate"],
            window=options["window"],
            duration=options["duration"],
            headroom=options["headroom"],
            host=options["host"],
            out=options["out"],
            workers=options["workers"],
            qty=options["qty"],
            server_workers=options["server_workers"],
            server=options["server"],
            server_threads=options["server_threads"],
            settle_timeout=options["settle_timeout"],
            warmup=options["warmup"],
            unsafe_delay_ms=options["unsafe_delay_ms"],
        )
        try:
            config.validate()
        except InvalidRequest as error:
            raise CommandError(error.detail) from None
        batch_id = options["batch"]
        if batch_id is not None and not BATCH_ID.fullmatch(batch_id):
            raise CommandError(f"--batch: not a batch id: {batch_id[:40]!r}")
        rounds = options["rounds"]
        if not 1 <= rounds <= MAX_ROUNDS:
            raise CommandError(f"--rounds: from 1 to {MAX_ROUNDS}")
        if rounds > 1 and batch_id is not None:
            raise CommandError("--rounds: each round is a batch of its own; give no --batch")
        if not sandbox.active():
            # The runs are recorded in this database: it must have every table they need.
            executor = MigrationExecutor(connections[DEFAULT_DB_ALIAS])
            if executor.migration_plan(executor.loader.graph.leaf_nodes()):
                raise CommandError(
                    "the database has migrations not applied yet: run `python manage.py "
                    "migrate` first (make demo does)"
                )
        if not (config.host or options["no_sandbox"] or sandbox.active()):
            # A server started here sells in the sandbox: start again there.
            if sys.argv[1:2] != ["loadtest"]:
                raise CommandError(
                    "called from code: pass no_sandbox=True (or run it as a command)"
                )
            try:
                sandbox.enter([str(Path(settings.BASE_DIR) / "manage.py"), *sys.argv[1:]])
            except sandbox.SandboxError as error:
                raise CommandError(str(error)) from None

        progress = LiveProgress(self.stderr)
        # SIGTERM (a supervisor, a CI timeout, `kill`) ends the batch as Ctrl-C does: the run
        # under way is recorded as interrupted, and the server, order worker and
        # crowd started for it are stopped on the way out.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

        if rounds == 1:
            batches = [run_batch(config, progress=progress, batch=batch_id)]
        else:
            batches = run_rounds(config, rounds, progress=progress)  # both checked above
        for number, batch in enumerate(batches, start=1):
            self.stdout.write("")
            if rounds > 1:
                self.stdout.write(f"round {number} of {rounds}, batch {batch.batch}:")
            self._write_batch(batch)
        if rounds > 1:
            figures = round_figures([batch.runs for batch in batches])
            summary = batches[0].out.parent / "rounds.json"
            summary.write_text(json.dumps(figures, indent=2))
            self.stdout.write("")
            self.stdout.write("\n".join(rounds_summary(figures)))
            self.stdout.write(f"JSON  {summary}")
        runs = [run for batch in batches for run in batch.runs]
        broken = [
            run.strategy
            for run in runs
            if run.status != run.Status.DONE
            or (
                run.strategy != BASELINE
                and not oversells(run.strategy)
                and ((run.oversold or 0) > 0 or stranded(run))
            )
        ]
        if broken:
            self.stderr.write(
                f"FAILED: {', '.join(dict.fromkeys(broken))} "
                "(oversold, stock stranded, or the run broke)"
            )
            sys.exit(1)

    def _write_batch(self, batch: Batch) -> None:
        """A batch's comparison, where its CPU went, and its report files."""
        self.stdout.write(table(batch.runs))
        self.stdout.write("")
        if cpu := cpu_table(batch.runs):
            self.stdout.write(cpu)
            self.stdout.write("")
        for kind, path in batch.files.items():
            self.stdout.write(f"{kind.upper():<5} {path}")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
