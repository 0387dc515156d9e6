"""`manage.py bench strategies|locks|settle|waiters|calls|servers [ARGS...]`: the benchmarks
(`make bench`).

`bench strategies` is `python -m loadtest.bench_strategies` (every strategy, the peer locks
and the ceilings, in the load-run sandbox); `bench locks` is `python -m loadtest.bench_locks`
(our lock and the peers' with no database); `bench settle` is the order pipeline
(`loadtest.bench.settle`: what workers settle against what a flood accepts); `bench waiters`
is `python -m loadtest.bench_waiters` (a thousand lock waiters in one process: connections and
hand-overs, with and without the wake hub); `bench calls` is `loadtest.bench.calls` (the CPU a
sale spends in redis-py's command layers: the scripts called through redis-py's `Script` and
straight down a pooled connection, side by side); `bench servers` is `loadtest.bench.servers`
(the server designs compared over HTTP). ARGS go to them as they are: `bench strategies --help`
lists them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

BENCHMARKS = {
    "strategies": "loadtest.bench.strategies",
    "locks": "loadtest.bench_locks",
    "settle": "loadtest.bench.settle",
    "waiters": "loadtest.bench_waiters",
    "calls": "loadtest.bench.calls",
    "servers": "loadtest.bench.servers",
}


class Command(BaseCommand):
    help = (
        "Run a benchmark: `bench strategies` (every strategy against the peers "
        "and the ceilings), `bench locks` (the locks alone), `bench settle` (the order "
        "workers against a flood), `bench waiters` (lock waiters and connections), `bench "
        "calls` (a sale's script calls through redis-py's layers and without them), or `bench "
        "servers` (the server designs over HTTP); the arguments after it go to the benchmark "
        "(`bench strategies --help`)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("benchmark", choices=sorted(BENCHMARKS))
        parser.add_argument("arguments", nargs=argparse.REMAINDER)

    def run_from_argv(self, argv: list[str]) -> None:
        # Everything after the benchmark's name is the benchmark's, --help included.
        if len(argv) > 2 and argv[2] in BENCHMARKS:
            sys.exit(self._run(argv[2], argv[3:]))
        super().run_from_argv(argv)

    def handle(self, *args: Any, **options: Any) -> None:
        code = self._run(str(options["benchmark"]), list(options["arguments"] or []))
        if code:
            sys.exit(code)

    @staticmethod
    def _run(benchmark: str, arguments: list[str]) -> int:
        from importlib import import_module

        return import_module(BENCHMARKS[benchmark]).main(arguments)
