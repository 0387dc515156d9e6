"""Helpers shared by the test suite (no fixtures here: import what you need)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from loadtest.sandbox import delete_prefix as delete_prefix
from shop.processes.ports import free_port

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

#: How many times a flood's buyer sends its checkout again after a `503 busy` with Retry-After
#: (`flood(retry_busy=...)`), in the tests that hold a crowd to exact counts rather than to
#: being served without a wait: on a loaded host a lock's waiters give up after their second
#: (docs/decisions/0026-a-second-for-a-lock.md), and such an answer sold nothing.
BUSY_RETRIES = 5


def redis_url() -> str:
    """URL of the shared test Redis: $REDIS_URL, else the local default."""
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def unique_prefix(label: str = "test") -> str:
    """A key prefix no other test run uses, e.g. ``test:lock:3f2a...:``."""
    return f"test:{label}:{uuid.uuid4().hex}:"


def gather_from_processes(processes: list[Any], results: Any, *, timeout: float = 60) -> list:
    """Start the processes, take one item each from ``results``, and leave none running."""
    for process in processes:
        process.start()
    try:
        return [results.get(timeout=timeout) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()


def gone(process: psutil.Process) -> bool:
    """Whether `process` has exited (reaped, or a zombie nobody has reaped yet)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def run_in_thread(target) -> tuple[threading.Thread, dict]:
    """Start target() in a thread; the dict gets 'result' or 'error' and 'at' (monotonic)."""
    outcome: dict = {}

    def body() -> None:
        try:
            outcome["result"] = target()
        except BaseException as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, outcome


def crowd_in_rounds(
    url: str,
    sku: str,
    *,
    until: Callable[[Any], bool],
    attempts: int,
    concurrency: int,
    pause: float = 0.0,
    within: float = 300.0,
    retry_busy: int = 0,
) -> tuple[threading.Thread, Any]:
    """Start a crowd buying sku in a thread: rounds of `attempts` checkouts (`loadtest.flood`,
    each buyer resending a `503 busy` up to `retry_busy` times), each round's buyers named
    apart, until `until(so_far)` holds as a round starts, then that round, the last; no round
    starts after `within` seconds. Returns the thread and the rounds' merged FloodResult, final
    once the thread has ended.

    A crowd of a fixed number of checkouts can be over before what a test waits for happens (a
    slow restart, a slow failover), or run out of checkouts before the sale is sold out."""
    from loadtest.flood import FloodResult, flood

    so_far = FloodResult()
    ends = time.monotonic() + within

    def buy() -> None:
        for round_ in itertools.count():
            last = until(so_far) or time.monotonic() >= ends
            so_far.merge(
                flood(
                    url,
                    sku,
                    attempts=attempts,
                    concurrency=concurrency,
                    pause=pause,
                    buyer_prefix=f"buyer{round_}",
                    retry_busy=retry_busy,
                )
            )
            if last:
                return

    thread = threading.Thread(target=buy, daemon=True)
    thread.start()
    return thread, so_far


def units_held_ahead_returned(sku: str, *, timeout: float = 10.0) -> None:
    """Wait until no process holds units of sku's current sale taken ahead of its checkouts
    (`lua`'s go back within a second of their last use): Redis then counts what the database
    does, and the reconciler compares them. Fails if a holder is still registered."""
    from inventory.models import Item
    from inventory.strategies.ahead import holders

    item = Item.objects.get(sku=sku)
    deadline = time.monotonic() + timeout
    while holders(item)[0]:
        assert time.monotonic() < deadline, f"{sku}: units still held ahead after {timeout} s"
        time.sleep(0.01)


def sold_out(so_far: Any) -> bool:
    """`crowd_in_rounds`'s `until` for a crowd that buys until it is told the sale is sold out."""
    return so_far.errors.get("sold_out", 0) > 0


def flood_sells_exactly_the_stock(url: str, sku: str, *, stock: int, attempts: int, buyers: int):
    """Flood a running sale of `stock` units (started by the caller) with more attempts than
    units, and assert exactly the stock was sold: each 201 a committed order, every other
    answer sold out, the database and Redis (where the strategy counts there) at 0. Returns
    the sale's orders."""
    from inventory.models import Order
    from inventory.selectors import audit_sale
    from loadtest.flood import flood

    result = flood(url, sku, attempts=attempts, concurrency=buyers, retry_busy=BUSY_RETRIES)
    context = f"{sku}: {dict(result.statuses)} {dict(result.errors)}"
    assert result.transport_failures == 0 and result.server_errors == 0, context
    assert result.accepted == stock, context
    assert result.errors == {"sold_out": attempts - stock}, context
    stored = Order.objects.filter(item__sku=sku)
    placed = sorted(str(pid) for pid in stored.values_list("public_id", flat=True))
    assert sorted(result.order_ids) == placed, context
    audit = audit_sale(sku)
    assert audit["oversold"] == 0 and audit["remaining"] == 0, audit
    assert audit["db_stock"] == 0 and audit["redis_stock"] in (0, None), audit
    assert audit["consistent"], audit
    if audit["strategy"] in ("lua", "segmented"):
        assert audit["redis_stock"] == 0, audit
    return stored


NGINX = shutil.which("nginx") or (
    "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
)


def nginx_site(upstream: str, listen_port: int) -> str:
    """deploy/nginx.conf with its upstream at `upstream` (a test's server: `127.0.0.1:PORT`, or
    `unix:PATH`), listening on 127.0.0.1:`listen_port`, its metrics server on a free port."""
    from shop.processes.servers import PROJECT_DIR

    site = (PROJECT_DIR / "deploy" / "nginx.conf").read_text()
    site, upstreams = re.subn(r"server unix:/run/flashsale/web.sock;", f"server {upstream};", site)
    site, listens = re.subn(r"listen 80;", f"listen 127.0.0.1:{listen_port};", site)
    site, metrics = re.subn(r"listen 9000;", f"listen 127.0.0.1:{free_port()};", site)
    assert upstreams == listens == metrics == 1, (
        "deploy/nginx.conf changed shape: update nginx_site"
    )
    return site


@contextlib.contextmanager
def nginx_serving(site: str, directory: Any, port: int) -> Iterator[str]:
    """Run the machine's nginx (NGINX) on one site's configuration, in `directory` (its temp
    paths, pid and log), listening on 127.0.0.1:`port`; yields its URL once it accepts
    connections, and stops it afterwards. Fails the test if nginx exits or does not listen
    within 15 s."""
    import pytest

    (directory / "site.conf").write_text(site)
    temp = "".join(f"{kind}_temp_path {directory}/{kind};\n" for kind in
                   ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))  # fmt: skip
    user = "user root;\n" if os.geteuid() == 0 else ""
    (directory / "nginx.conf").write_text(
        f"{user}daemon off;\nworker_processes 1;\npid {directory}/nginx.pid;\n"
        f"error_log {directory}/error.log;\nevents {{ worker_connections 256; }}\n"
        f"http {{\naccess_log off;\n{temp}include {directory}/site.conf;\n}}\n"
    )
    process = subprocess.Popen(
        [NGINX, "-p", str(directory), "-c", str(directory / "nginx.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None:
                    pytest.fail(f"nginx exited: {process.stderr.read().decode()}")
                if time.monotonic() > deadline:
                    pytest.fail("nginx did not listen within 15 s")
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


def task_messages_carrying(client: Any, queue: str, pks: list[int]) -> list[dict]:
    """The task messages waiting on the Redis broker's `queue`, newest first, that carry any of
    the orders `pks`: each as {"task": name, "args": its arguments}.

    Found by what they carry, never by where they sit: the queue is the session's, and a worker
    that takes its oldest messages meanwhile moves every position, while an order's key names
    that order alone."""
    found = []
    wanted = set(pks)
    for raw in client.lrange(queue, 0, -1):
        envelope = json.loads(raw)
        message = {
            "task": envelope["headers"]["task"],
            "args": json.loads(base64.b64decode(envelope["body"]))[0],
        }
        first = message["args"][0] if message["args"] else None
        carried = set(first) if isinstance(first, list) else {first}
        if carried & wanted:
            found.append(message)
    return found
