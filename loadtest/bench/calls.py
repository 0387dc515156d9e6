"""What redis-py's command layers cost a sale: checkouts with the shop's scripts called through
redis-py's `Script` and through `locking.scripts.DirectScript`, side by side.

    python manage.py bench calls [--strategies lock segmented lua] [--sales 300] [--blocks 6]
        [--json PATH]

Needs DATABASE_URL and REDIS_URL; sells in the load-run sandbox. One buyer (this process, one
thread) buys one unit at a time through `inventory.services.place_order`, in alternating blocks
of --sales checkouts one way then the other, --blocks times each, so that a machine whose speed
drifts within the minute drifts for both. The two ways share one connection pool; only the
client's class differs (`RedisPyScripts` or `redis.Redis`). It prints per strategy the median
CPU per sale each way and their ratio, and the same for one script call alone. Invariant held:
it exits 1 if a sale oversold or its stock does not add up.
See docs/benchmarks.md#script-calls-redis-pys-layers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from .arguments import whole
from .strategies import delete_task_queue, sandboxed, setup_django

STRATEGIES = ["lock", "segmented", "lua"]
#: Script calls per block of the one-call measurement.
CALLS_PER_BLOCK = 2000


class RedisPyScripts(redis.Redis):
    """The shop's client, as a subclass: `script_for` gives it redis-py's `Script`."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="manage.py bench calls",
        description="CPU per sale with the scripts called through redis-py's Script and "
        "straight down a pooled connection (locking.scripts.DirectScript), side by side.",
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=STRATEGIES,
        default=STRATEGIES,
        help="strategies to sell with (lock segmented lua)",
    )
    parser.add_argument("--sales", type=whole(1), default=300, help="checkouts per block (300)")
    parser.add_argument(
        "--blocks", type=whole(1), default=6, help="blocks each way, alternating (6)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


@contextmanager
def _shop_client(client: redis.Redis) -> Iterator[None]:
    """This process's `get_redis_client()` answers `client` for the duration."""
    from inventory import redis_client

    shop = redis_client.get_redis_client()
    key = next(k for k, value in redis_client._clients.items() if value is shop)
    redis_client._clients[key] = client
    try:
        yield
    finally:
        redis_client._clients[key] = shop


def _alternate(
    ways: dict[str, redis.Redis], blocks: int, block: Callable[[], float]
) -> dict[str, list[float]]:
    """`block()` (which returns CPU ms per unit of work) run with each way's client in turn,
    `blocks` times each, after one unmeasured block each way."""
    figures: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(blocks + 1):
        for way, client in ways.items():
            with _shop_client(client):
                measured = block()
            if round_:
                figures[way].append(measured)
    return figures


def _sales_block(sku: str, sales: int, buyers: Iterator[str]) -> Callable[[], float]:
    from inventory.services import place_order

    def block() -> float:
        started = time.process_time()
        for _ in range(sales):
            place_order(sku=sku, qty=1, buyer=next(buyers))
        return 1000 * (time.process_time() - started) / sales

    return block


def _calls_block(key: str) -> Callable[[], float]:
    from inventory.redis_client import get_redis_client
    from locking.scripts import script_for
    from locking.scripts.counter import STOCK_TAKE

    def block() -> float:
        take = script_for(get_redis_client(), STOCK_TAKE)
        started = time.process_time()
        for _ in range(CALLS_PER_BLOCK):
            take(keys=[key], args=[1])
        return 1000 * (time.process_time() - started) / CALLS_PER_BLOCK

    return block


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = setup_django() or sandboxed("loadtest.bench.calls", argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    from inventory.keys import key as redis_key
    from inventory.redis_client import get_redis_client
    from inventory.selectors import audit_sale
    from inventory.services import start_sale
    from shop import queues
    from shop.celery import app

    shop = get_redis_client()
    if not isinstance(shop, redis.Redis):
        print("error: bench calls needs a single Redis (REDIS_URL), not a cluster", file=sys.stderr)
        return 2
    ways: dict[str, redis.Redis] = {
        "redis-py": RedisPyScripts(connection_pool=shop.connection_pool),
        "direct": shop,
    }
    queue = redis_key("bench", "calls")
    queues.use(app, queue)  # the sales' order messages: nobody reads them, dropped after
    print(
        f"one buyer, blocks of {args.sales} checkouts, {args.blocks} each way, alternating; "
        "CPU of this process"
    )
    rows: list[dict[str, Any]] = []
    broken: list[str] = []
    buyers = (f"bench-calls-{number}" for number in itertools.count(1))
    try:
        for strategy in args.strategies:
            sku = f"bench-calls-{strategy}"
            stock = args.sales * 2 * (args.blocks + 1)
            start_sale(sku=sku, stock=stock, strategy=strategy, name=f"Bench calls {strategy}")
            figures = _alternate(ways, args.blocks, _sales_block(sku, args.sales, buyers))
            audit = audit_sale(sku)
            if audit["oversold"] or not audit["consistent"] or audit["accepted_units"] != stock:
                broken.append(strategy)
            rows.append(_row(f"{strategy}, per sale", "ms", figures))
            _print_row(rows[-1])
        counter = redis_key("bench", "calls", "counter")
        shop.set(counter, 10**12)
        try:
            figures = _alternate(ways, args.blocks, _calls_block(counter))
        finally:
            shop.delete(counter)
        rows.append(_row("one script call", "ms", figures))
        _print_row(rows[-1])
    finally:
        delete_task_queue(queue)
    if args.json:
        args.json.write_text(json.dumps({"args": _args(args), "rows": rows}, indent=2) + "\n")
    if broken:
        print(f"oversold or inconsistent: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0


def _row(name: str, unit: str, figures: dict[str, list[float]]) -> dict[str, Any]:
    medians = {way: statistics.median(values) for way, values in figures.items()}
    return {
        "measure": name,
        "unit": unit,
        "blocks": figures,
        "median": medians,
        "direct_over_redis_py": medians["direct"] / medians["redis-py"],
    }


def _print_row(row: dict[str, Any]) -> None:
    median = row["median"]
    print(
        f"  {row['measure']:<22} CPU ms, median: redis-py {median['redis-py']:.3f}, "
        f"direct {median['direct']:.3f}; direct / redis-py {row['direct_over_redis_py']:.2f}x",
        flush=True,
    )


def _args(args: argparse.Namespace) -> dict[str, Any]:
    return {"strategies": args.strategies, "sales": args.sales, "blocks": args.blocks}


if __name__ == "__main__":
    sys.exit(main())
