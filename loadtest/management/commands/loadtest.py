"""`manage.py loadtest`: flood each strategy with Locust and compare them."""

from __future__ import annotations

import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inventory.exceptions import InvalidRequest
from inventory.strategies import strategy_names
from loadtest.report import table
from loadtest.runs import BASELINE, LoadRunSettings, run_batch


class Command(BaseCommand):
    help = (
        "Flood each strategy in turn with Locust (after a baseline against a no-op endpoint), "
        "audit it, record a sale run, print the comparison and write CSV, JSON and HTML."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--strategies",
            default=",".join(strategy_names()),
            help="comma-separated strategy names (default: all)",
        )
        parser.add_argument("--stock", type=int, default=300, help="units per sale")
        parser.add_argument("--users", type=int, default=40, help="concurrent Locust users")
        parser.add_argument(
            "--spawn-rate", type=float, default=100.0, help="users started per second"
        )
        parser.add_argument("--duration", type=int, default=15, help="seconds per run")
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
            "--server-workers", type=int, default=8, help="gunicorn workers when started here"
        )
        parser.add_argument(
            "--settle-timeout",
            type=float,
            default=None,
            help="seconds to wait for orders to be processed (default 60 with a local "
            "server; 0, no wait, with --host)",
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
            "crowd arrives (default: a tenth of --duration)",
        )

    def handle(self, *args: object, **options: object) -> None:
        config = LoadRunSettings(
            strategies=[name.strip() for name in options["strategies"].split(",") if name.strip()],
            stock=options["stock"],
            users=options["users"],
            spawn_rate=options["spawn_rate"],
            duration=options["duration"],
            host=options["host"],
            out=options["out"],
            workers=options["workers"],
            qty=options["qty"],
            server_workers=options["server_workers"],
            settle_timeout=options["settle_timeout"],
            warmup=options["warmup"],
            unsafe_delay_ms=options["unsafe_delay_ms"],
        )
        try:
            config.validate()
        except InvalidRequest as error:
            raise CommandError(error.detail) from None

        def progress(line: str) -> None:
            self.stderr.write(line)
            self.stderr.flush()

        batch = run_batch(config, progress=progress)
        self.stdout.write("")
        self.stdout.write(table(batch.runs))
        self.stdout.write("")
        for kind, path in batch.files.items():
            self.stdout.write(f"{kind.upper():<5} {path}")
        broken = [
            run.strategy
            for run in batch.runs
            if run.status != run.Status.DONE
            or (run.strategy not in (BASELINE, "unsafe") and (run.oversold or 0) > 0)
        ]
        if broken:
            self.stderr.write(f"FAILED: {', '.join(broken)} (oversold, or the run broke)")
            sys.exit(1)
