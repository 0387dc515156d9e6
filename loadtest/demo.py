"""`make demo`: flood each strategy in turn through a real server and print what happened.

    python -m loadtest.demo [--strategies lock,segmented,lua,optimistic,unsafe]
                            [--stock 200] [--buyers 32] [--attempts 600]

Demand (attempts) exceeds supply (stock), so a correct strategy sells exactly the stock and
answers the rest `409 sold_out`; `oversold` counts units sold that did not exist.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import django


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.demo", description=__doc__)
    parser.add_argument("--strategies", default="lock,segmented,lua,optimistic,unsafe")
    parser.add_argument("--stock", type=_positive, default=200)
    parser.add_argument("--buyers", type=_positive, default=32, help="concurrent processes")
    parser.add_argument("--attempts", type=_positive, default=600, help="checkouts in all")
    parser.add_argument("--workers", type=_positive, default=8, help="gunicorn workers")
    parser.add_argument(
        "--unsafe-delay-ms",
        type=int,
        default=5,
        help="simulated work between unsafe's read and write (widens its race)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    django.setup()
    from django.core.management import call_command

    from inventory.selectors import audit_sale
    from inventory.services import start_sale
    from inventory.strategies import strategy_names
    from loadtest.flood import flood
    from loadtest.server import ShopServer

    strategies = [name.strip() for name in args.strategies.split(",") if name.strip()]
    unknown = sorted(set(strategies) - set(strategy_names()))
    if unknown:
        print(f"unknown strategies: {', '.join(unknown)}", file=sys.stderr)
        return 2
    call_command("migrate", verbosity=0, interactive=False)
    env = {"FLASHSALE_UNSAFE_DELAY_MS": str(args.unsafe_delay_ms)}
    print(
        f"flooding {len(strategies)} strategies: {args.stock} units, {args.attempts} checkouts "
        f"from {args.buyers} buyer processes, gunicorn with {args.workers} workers"
    )
    rows = []
    with ShopServer(env=env, workers=args.workers) as server:
        for strategy in strategies:
            sku = f"demo-{strategy}"
            start_sale(sku=sku, stock=args.stock, strategy=strategy, name=f"Demo ({strategy})")
            print(f"  {strategy:<11} ...", end="", flush=True)
            started = time.perf_counter()
            result = flood(server.url, sku, attempts=args.attempts, concurrency=args.buyers)
            audit = audit_sale(sku)
            rows.append((strategy, result, audit))
            print(f" done in {time.perf_counter() - started:.1f} s")
    print()
    header = f"{'strategy':<11} {'accepted':>8} {'oversold':>8} {'remaining':>9} {'req/s':>7} "
    header += f"{'5xx':>4} {'consistent':>10}"
    print(header)
    print("-" * len(header))
    for strategy, result, audit in rows:
        print(
            f"{strategy:<11} {audit['accepted_units']:>8} {audit['oversold']:>8} "
            f"{audit['remaining']:>9} {result.requests_per_second:>7.0f} "
            f"{result.server_errors:>4} {'yes' if audit['consistent'] else 'NO':>10}"
        )
    print()
    print("accepted: units in live orders; oversold: accepted beyond the initial stock;")
    print("remaining: initial stock minus accepted; consistent: database, shards and Redis agree.")
    safe_failures = [
        s for s, _, a in rows if s != "unsafe" and (a["oversold"] or not a["consistent"])
    ]
    if safe_failures:
        print(f"INVARIANT BROKEN by: {', '.join(safe_failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
