"""`manage.py sandbox drop`: remove the load-run sandbox (loadtest.sandbox): its database and
its Redis keys. The next load run or bench creates it again."""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from loadtest import sandbox


class Command(BaseCommand):
    help = (
        "drop: remove the load-run sandbox, the database beside the shop's where load runs and "
        "benchmarks sell, and its Redis keys, to reclaim what their orders take; the next run "
        "creates it again. Run it between runs: while a connection to that database stays open "
        "5 s, it drops nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["drop"])

    def handle(self, *args: Any, **options: Any) -> None:
        if sandbox.active():
            raise CommandError("this process runs in the sandbox: drop it from the shop's")
        try:
            dropped = sandbox.drop(os.environ)
        except sandbox.SandboxError as error:
            raise CommandError(str(error)) from None
        name = dropped.database
        what = f"dropped the load-run database {name}" if dropped.existed else f"no database {name}"
        self.stdout.write(f"{what}; deleted {dropped.keys} Redis keys under {dropped.prefix}:")
