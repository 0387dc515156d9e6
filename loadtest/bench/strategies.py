"""The strategies without HTTP: every strategy, the peer locks and the ceilings driven directly
by buyers on one hot item, all in one run so that every figure has its baseline beside it.

    python manage.py bench strategies [--rounds 3] [--strategies lock segmented] [--json PATH]

Needs DATABASE_URL and REDIS_URL; sells in the load-run sandbox. The contenders
(`contenders_for`): each strategy, `lua` and `segmented` batched, `lock` and `segmented` with
--work-ms of work, the peer locks inside `lock`'s code, the ceilings (raw EVALSHA, take + row
sale, hot row), and with --crowds `lua, batched` and the hot row at other crowds. Each one's
--buyers warm up on a sale of their own, wait at a barrier, then buy one unit at a time through
`inventory.services.place_order` until sold out; buys/s is units sold from the barrier to the
last sale, beside the CPU per unit of the buyers, their PostgreSQL backends and Redis. Every
sale is audited after its contender: the run exits 1 if one that must be safe (all but
`unsafe`) oversold, is inconsistent or crashed; the targets are printed as met or missed.
See docs/benchmarks.md#the-strategies-without-http.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import django

from .contenders import EVALSHA, PEERS, Result, batch_processes, contenders_for
from .report import (
    crowd_ratios,
    median_row,
    print_crowds,
    print_profile,
    print_ratios,
    print_table,
    ratios,
)
from .rounds import run_contender

# -- command line -------------------------------------------------------------------------


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return number


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.replace(",", " ").split() if name.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="manage.py bench strategies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--buyers", type=_positive, default=8, help="buyers per contender (8)")
    parser.add_argument(
        "--batch-threads",
        type=_positive,
        default=4,
        help="buyers per process, as threads, for the batched rows (`lua, batched`, "
        "`segmented, batched`): --buyers 8 makes 2 processes of 4 threads, one a core (4)",
    )
    parser.add_argument("--stock", type=_positive, default=5000, help="units per sale (5000)")
    parser.add_argument(
        "--duration", type=_positive_float, default=10.0, help="cap per contender, seconds (10)"
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=[],
        help="strategies to run, space- or comma-separated (default: every strategy)",
    )
    parser.add_argument(
        "--hold-ms",
        type=int,
        default=0,
        help="simulated work inside each critical section, ms (FLASHSALE_HOLD_DELAY_MS; 0)",
    )
    parser.add_argument(
        "--work-ms",
        type=int,
        default=5,
        help="also run lock and segmented with this much simulated work in each critical "
        "section (a call to another service, say): there the lock, not the CPU, limits `lock`, "
        "which is what shards are for (5; 0 skips them)",
    )
    parser.add_argument(
        "--work-buyers",
        type=_positive,
        default=10,
        help="buyer processes for the --work-ms rows: more buyers than shards, so that the "
        "shards, not the crowd, are what runs out (10)",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=list(PEERS),
        help=f"peer locks to run ({', '.join(PEERS)}); none with an empty list",
    )
    parser.add_argument(
        "--ceiling-stock",
        type=_positive,
        default=50000,
        help="units the raw EVALSHA ceiling sells: more than --stock, so that its far higher "
        "rate is measured over a long enough time (50000)",
    )
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=1,
        help="run every contender this many times, in rotating order; report medians (1)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also time, in the buyer processes, the phases that serialize checkouts (lock "
        "wait and hold, the item row's UPDATE and hold, commit, publish) and print them",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=25,
        help="units each buyer buys, the contender's way, from a sale of their own before the "
        "measured one starts (connections, prepared statements, caches; 25; 0: none)",
    )
    parser.add_argument(
        "--crowds",
        nargs="+",
        type=_positive,
        default=[],
        help="also run `lua, batched` and the hot row with each of these crowds of buyers "
        "(the batched row as many processes as at --buyers, the crowd spread over their "
        "threads), and print their ratio at each crowd and against the hot row at its best "
        "crowd of the run (none)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    args.strategies = [name for value in args.strategies for name in _names(value)]
    args.peers = [name for value in args.peers for name in _names(value)]
    unknown = sorted(set(args.peers) - set(PEERS))
    if unknown:
        parser.error(f"unknown peers: {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    if args.hold_ms < 0:
        parser.error("--hold-ms must be 0 or more")
    if args.work_ms < 0:
        parser.error("--work-ms must be 0 or more")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    # The crowd of --buyers is the run's own rows.
    args.crowds = sorted(set(args.crowds) - {args.buyers})
    return args


def check_database() -> str | None:
    """Apply missing migrations; a message when the database cannot be used."""
    from django.core.management import call_command
    from django.db import DEFAULT_DB_ALIAS, OperationalError, connections
    from django.db.migrations.executor import MigrationExecutor

    try:
        connection = connections[DEFAULT_DB_ALIAS]
        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except OperationalError as exc:
        return f"cannot reach the database named by DATABASE_URL: {exc}"
    if plan:
        print(f"applying {len(plan)} migration(s) to the benchmark database")
        call_command("migrate", verbosity=0, interactive=False)
    return None


def setup_django() -> str | None:
    """Set Django up for a benchmark run as a program; a message when it cannot be."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.exceptions import ImproperlyConfigured

    try:
        django.setup()
    except ImproperlyConfigured as exc:
        return str(exc)
    return None


def sandboxed(module: str, argv: list[str] | None) -> str | None:
    """Run on in the load-run sandbox, migrated: re-exec `python -m module argv` there unless
    this process is in it already (its items and orders stay out of the shop's database).
    Returns a message when that cannot be done."""
    from loadtest import sandbox

    if not sandbox.active():
        try:
            sandbox.enter(["-m", module, *(sys.argv[1:] if argv is None else argv)])
        except sandbox.SandboxError as exc:
            return str(exc)
    return check_database()


def delete_task_queue(queue: str) -> None:
    """Drop the private queues (shop.queues) the checkouts published their order tasks to."""
    from shop import queues
    from shop.celery import app

    try:
        with app.connection_for_write() as connection:
            for declaration in queues.declarations(queue):
                # Declared first: a channel deletes only the bindings it knows of.
                bound = declaration(connection.default_channel)
                bound.declare()
                bound.delete()
    except Exception as exc:  # the broker may be down; the checkouts then published nothing
        print(f"note: could not delete the task queue {queue} ({exc})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = setup_django()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from django.conf import settings

    from inventory.strategies import strategy_names

    args.strategies = args.strategies or strategy_names()
    unknown = sorted(set(args.strategies) - set(strategy_names()))
    if unknown:
        print(f"error: unknown strategies: {', '.join(unknown)}", file=sys.stderr)
        return 2
    problem = sandboxed("loadtest.bench.strategies", argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    # Import in the parent what the buyers use, so that every fork starts warm.
    import redis.lock  # noqa: F401
    import redis_lock  # noqa: F401

    import inventory.services  # noqa: F401
    import inventory.strategies.lock  # noqa: F401
    from inventory.keys import key as redis_key
    from shop import queues
    from shop.celery import app

    settings.FLASHSALE_HOLD_DELAY_MS = args.hold_ms
    # Order tasks go to a queue of this run's own, dropped at the end: no worker of the shop
    # picks up orders of a benchmark, and nothing piles up in the shop's queue.
    queue = redis_key("bench", os.getpid(), "orders")
    queues.use(app, queue)

    contenders = contenders_for(args)
    for contender in contenders:
        if contender.name == EVALSHA:
            contender.sku = redis_key("bench", "ceiling", "evalsha", os.getpid())
    print(
        f"{len(contenders)} contenders, {args.rounds} round(s): {args.buyers} buyers "
        f"(batched: threads of processes of {args.batch_threads}), "
        f"{args.stock} units each (raw EVALSHA: {args.ceiling_stock}), cap {args.duration:g} s, "
        f"hold {args.hold_ms} ms, lock TTL {settings.FLASHSALE_LOCK_TTL_MS} ms, "
        f"{os.cpu_count()} CPUs"
    )
    results: dict[str, list[Result]] = {contender.name: [] for contender in contenders}
    try:
        for round_ in range(args.rounds):
            shift = round_ % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                print(f"  round {round_ + 1}: {contender.name:<27}", end=" ", flush=True)
                result = run_contender(contender, args, round_)
                results[contender.name].append(result)
                print(
                    f"{result.buys_per_second:>7.0f} buys/s in {result.seconds:.2f} s"
                    + (" ERRORS" if result.errors else ""),
                    flush=True,
                )
                for note in result.notes:
                    print(f"    {note}", flush=True)
                for error in result.errors:
                    print(f"    {error.rstrip()}", file=sys.stderr)
    finally:
        delete_task_queue(queue)

    rows = [median_row(results[contender.name]) for contender in contenders]
    print_table(rows, args.rounds)
    if args.profile:
        print_profile(rows)
    by_name = {row.contender: row for row in rows}
    checks = ratios(by_name, args.work_ms, results)
    print_ratios(checks)
    crowds = crowd_ratios(by_name, args.buyers, args.crowds)
    if crowds:
        print_crowds(crowds, batch_processes(args))
    print(
        "\nbuys/s: units sold / seconds from the start barrier to the last sale. cpu py: the "
        "buyer processes; cpu pg: their PostgreSQL backends; cpu redis: the whole Redis server; "
        "wal kB: what the PostgreSQL server wrote to its write-ahead log per unit sold (every "
        "database of the server, anything else writing to it counted); host cpu: all CPUs of "
        "this machine, anything else running included. p50/p99 ms: how "
        "long one sale took a buyer, from its first call for the unit, busy answers and retries "
        "included (a lock that lets its waiters sleep can sell fast and still keep some buyers "
        "waiting long). fewest: the fewest units one buyer (a process, or a thread of the "
        "batched rows) sold, over an even share (1.00: every buyer alike; 0.00: a buyer that "
        "never got the lock, whose waits no p99 over sales made can show)."
    )

    broken = sorted(
        {result.contender for runs in results.values() for result in runs if result.broken}
    )
    crashed = sorted(
        {result.contender for runs in results.values() for result in runs if result.errors}
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "parameters": {
                        "buyers": args.buyers,
                        "batch_threads": args.batch_threads,
                        "stock": args.stock,
                        "duration": args.duration,
                        "hold_ms": args.hold_ms,
                        "work_ms": args.work_ms,
                        "rounds": args.rounds,
                        "warmup": args.warmup,
                        "ceiling_stock": args.ceiling_stock,
                        "crowds": args.crowds,
                        "profile": args.profile,
                        "lock_ttl_ms": settings.FLASHSALE_LOCK_TTL_MS,
                        "lock_wait_ms": settings.FLASHSALE_LOCK_WAIT_MS,
                        "cpus": os.cpu_count(),
                    },
                    "results": [asdict(result) for runs in results.values() for result in runs],
                    "medians": {row.contender: row.buys_per_second for row in rows},
                    "targets": checks,
                    "crowds": crowds,
                    "broken": broken,
                    "crashed": crashed,
                },
                indent=2,
            )
            + "\n"
        )
    if broken:
        print(f"INVARIANT BROKEN by: {', '.join(broken)}", file=sys.stderr)
    if crashed:
        print(f"buyer processes failed in: {', '.join(crashed)}", file=sys.stderr)
    return 1 if broken or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
