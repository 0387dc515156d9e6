"""What a wait costs the work after it: the same request's CPU back to back and after a pause,
and a `lua` checkout answered by the sale writer at once and after its linger.

    python manage.py bench wake [--requests 1000] [--blocks 3] [--pauses 0 1 3 6]
        [--json PATH]

Needs DATABASE_URL and REDIS_URL (or run it through `python -m shop.devservices --`); sells in
the load-run sandbox, as `bench strategies` does.

One process calls Django's WSGI handler directly, no HTTP, and counts its own CPU
(`time.process_time`):

- `POST /api/noop` with a pause (`time.sleep`) of each of --pauses milliseconds before every
  request, the CPU counted around the request alone: the pause itself costs nothing here, so a
  dearer request after it is the machine's, caches and cores gone cold while the process slept;
- `POST /api/checkout` of a `lua` item through two sale writers started for the run, one that
  takes a lone request at once (`FLASHSALE_SALE_WRITER_LINGER_US=0`) and one that waits its
  linger for company first (the setting as configured, 4 ms unless changed): the CPU of the
  whole request, and how long it took.

Blocks of --requests each, every kind in turn, --blocks times over after one unmeasured block
each, so that a machine whose speed drifts within the minute drifts for all. It prints each
kind's median CPU per request and its ratio to the first one of its part. Exits 1 if a writer
does not start, a checkout is not sold, or the `lua` sale oversold or does not add up.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .arguments import whole
from .strategies import delete_task_queue, sandboxed, setup_django

#: Longest pause one may ask for, in ms: past it the request is as cold as it gets.
MAX_PAUSE_MS = 1000
SKU = "bench-wake-lua"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="manage.py bench wake",
        description="CPU of one request back to back and after a pause, and of a lua checkout "
        "answered by the sale writer at once and after its linger, in one process.",
    )
    parser.add_argument(
        "--requests", type=whole(1, 100_000), default=1000, help="requests per block (1000)"
    )
    parser.add_argument(
        "--blocks", type=whole(1, 50), default=3, help="measured blocks of each kind (3)"
    )
    parser.add_argument(
        "--pauses",
        type=whole(0, MAX_PAUSE_MS),
        nargs="+",
        default=[0, 1, 3, 6],
        metavar="MS",
        help=f"pauses before each no-op request, ms (0 1 3 6; at most {MAX_PAUSE_MS})",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    args.pauses = list(dict.fromkeys(args.pauses))
    return args


class _Handler:
    """Django's WSGI handler, called as a server would call it, in this process."""

    def __init__(self) -> None:
        from django.core.handlers.wsgi import WSGIHandler

        self.handler = WSGIHandler()

    def post(self, path: str, body: bytes) -> tuple[str, bytes]:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": path,
            "QUERY_STRING": "",
            "SERVER_NAME": "localhost",
            "SERVER_PORT": "80",
            "HTTP_HOST": "localhost",
            "REMOTE_ADDR": "127.0.0.1",
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.input": io.BytesIO(body),
            "wsgi.url_scheme": "http",
        }
        statuses: list[str] = []

        def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
            statuses.append(status)
            return lambda data: None

        response = self.handler(environ, start_response)
        content = b"".join(response)
        response.close()
        return statuses[0], content


def _noop_block(handler: _Handler, requests: int, pause_ms: int) -> Callable[[], dict]:
    body = json.dumps({"sku": SKU, "qty": 1, "buyer": "bench-wake"}).encode()
    pause = pause_ms / 1000

    def block() -> dict:
        cpu = 0.0
        for _ in range(requests):
            if pause:
                time.sleep(pause)
            started = time.process_time()
            handler.post("/api/noop", body)
            cpu += time.process_time() - started
        return {"cpu_us": 1e6 * cpu / requests}

    return block


def _checkout_block(
    handler: _Handler, requests: int, writer_path: str, buyers: Iterator[str]
) -> Callable[[], dict]:
    from django.conf import settings

    def block() -> dict:
        settings.FLASHSALE_SALE_WRITER = writer_path
        started, wall = time.process_time(), time.perf_counter()
        for _ in range(requests):
            body = json.dumps({"sku": SKU, "qty": 1, "buyer": next(buyers)}).encode()
            status, content = handler.post("/api/checkout", body)
            if not status.startswith("201"):
                raise RuntimeError(f"a checkout was answered {status}: {content[:300]!r}")
        return {
            "cpu_us": 1e6 * (time.process_time() - started) / requests,
            "wall_us": 1e6 * (time.perf_counter() - wall) / requests,
        }

    return block


def _alternate(kinds: dict[str, Callable[[], dict]], blocks: int) -> dict[str, list[dict]]:
    """Each kind's block in turn, `blocks` times over, after one unmeasured block each."""
    figures: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for round_ in range(blocks + 1):
        for kind, block in kinds.items():
            measured = block()
            if round_:
                figures[kind].append(measured)
    return figures


def _rows(figures: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Each kind's medians, and its CPU's ratio to the first kind's."""
    rows = []
    first = None
    for kind, blocks in figures.items():
        cpu = statistics.median(block["cpu_us"] for block in blocks)
        first = first or cpu
        row: dict[str, Any] = {
            "kind": kind,
            "blocks": blocks,
            "cpu_us": cpu,
            "cpu_over_first": cpu / first,
        }
        if "wall_us" in blocks[0]:
            row["wall_us"] = statistics.median(block["wall_us"] for block in blocks)
        rows.append(row)
    return rows


def _print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(title)
    for row in rows:
        wall = f", {row['wall_us'] / 1000:.2f} ms a request" if "wall_us" in row else ""
        print(
            f"  {row['kind']:<34} {row['cpu_us']:7.0f} us of CPU a request "
            f"({row['cpu_over_first']:.2f}x){wall}",
            flush=True,
        )


def _start_writers(linger_us: int, directory: str, started: dict[str, Any]) -> None:
    """Two sale writers, forked from this process, their sockets in `directory`: one that
    takes a lone request at once, one with the configured linger. Each goes into `started`
    ({kind: (its socket, the writer)}) as soon as it runs, for the caller to stop."""
    from django.conf import settings

    from .rounds import _Writer

    context = multiprocessing.get_context("fork")
    try:
        for kind, linger in (
            ("lua checkout, answered at once", 0),
            (f"lua checkout, after a {linger_us / 1000:g} ms linger", linger_us),
        ):
            path = os.path.join(directory, f"writer-{linger}.sock")
            settings.FLASHSALE_SALE_WRITER_LINGER_US = linger
            started[kind] = (path, _Writer(context, path))
    finally:
        settings.FLASHSALE_SALE_WRITER_LINGER_US = linger_us


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = setup_django() or sandboxed("loadtest.bench.wake", argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    from django.conf import settings
    from django.db import connection

    from inventory.keys import key as redis_key
    from inventory.selectors import audit_sale
    from inventory.services import start_sale
    from shop import queues
    from shop.celery import app

    linger_us = settings.FLASHSALE_SALE_WRITER_LINGER_US
    if not linger_us:
        print(
            "error: FLASHSALE_SALE_WRITER_LINGER_US is 0: there is no linger to compare with",
            file=sys.stderr,
        )
        return 2
    # The orders' messages go to a queue of the run's own (the writers publish them), dropped
    # at the end: no worker of the shop settles a benchmark's orders.
    queue = redis_key("bench", "wake", os.getpid())
    queues.use(app, queue)
    handler = _Handler()
    stock = args.requests * 2 * (args.blocks + 1)
    start_sale(sku=SKU, stock=stock, strategy="lua", name="Bench wake")
    connection.close()  # not carried into the writers' forks
    print(
        f"one process, Django's WSGI handler, blocks of {args.requests} requests, "
        f"{args.blocks} of each kind in turn; CPU of this process"
    )
    writers: dict[str, Any] = {}
    directory = tempfile.TemporaryDirectory(prefix="flashsale-bench-wake-")
    try:
        _start_writers(linger_us, directory.name, writers)
        noop = _rows(
            _alternate(
                {
                    f"no-op, {pause} ms pause before": _noop_block(handler, args.requests, pause)
                    for pause in args.pauses
                },
                args.blocks,
            )
        )
        _print_rows("POST /api/noop, the CPU counted around the request alone:", noop)
        buyers = (f"bench-wake-{number}" for number in itertools.count(1))
        checkout = _rows(
            _alternate(
                {
                    kind: _checkout_block(handler, args.requests, path, buyers)
                    for kind, (path, _) in writers.items()
                },
                args.blocks,
            )
        )
        _print_rows("POST /api/checkout of a lua item through a sale writer:", checkout)
    except RuntimeError as exc:  # a writer that did not start, a checkout not sold
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for _, writer in writers.values():
            writer.process.terminate()
            writer.process.join(10)
        directory.cleanup()
        delete_task_queue(queue)
    audit = audit_sale(SKU)
    broken = audit["oversold"] or not audit["consistent"] or audit["accepted_units"] != stock
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {
                        "requests": args.requests,
                        "blocks": args.blocks,
                        "pauses": args.pauses,
                        "linger_us": linger_us,
                    },
                    "noop": noop,
                    "checkout": checkout,
                    "audit": audit,
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
    if broken:
        print(f"the lua sale oversold or does not add up: {audit}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
