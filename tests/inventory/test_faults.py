"""Faults mid-flood, on a shop of the test's own, deployed as compose deploys it (its own
PostgreSQL and Redis; deploy/nginx.conf in front of granian's workers on a unix socket they
share; an order worker; Celery beat, the sweeper's and reconciler's clock): a web worker, the
order worker, beat and Redis each killed (SIGKILL) or stopped for 10 s (SIGSTOP), granian's
main process stopped for 10 s (its workers go on), PostgreSQL restarted with 3 s away or
stopped for 10 s; `lua` and `segmented`, with and without idempotency keys.
Skipped where there is no nginx (`make nginx` installs it, as CI does).

Whatever the fault: nothing is oversold; every 201 names a committed order; every order in the
database was answered 201 to its buyer, or its buyer got no answer from the shop (the web
worker serving it was killed: nginx's JSON 502, which promises nothing either way): a `503`
never hides a sale, and a buyer that retries one after its Retry-After, as told, buys one unit
at most; every answer is JSON, every 503 says when to retry; and `/healthz` answers
within 2 s throughout (but for a probe that the web worker killed or stopped was already
serving: nothing answers a request whose process is gone or frozen).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import psycopg
import pytest
import requests

from loadtest.flood import FloodResult, flood
from shop.processes.children import die_with_parent
from shop.processes.ports import free_port
from shop.processes.redis_server import RedisServer
from shop.processes.servers import PROJECT_DIR, CeleryWorker, ShopServer, kill_group
from tests.conftest import TEST_SECRET_KEY
from tests.support import NGINX, nginx_serving, nginx_site
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.skipif(NGINX is None, reason="no nginx on this machine (make nginx)")

STOCK = 250
ATTEMPTS = 900
BUYERS = 12
#: How long a stopped process stays stopped.
STOPPED_SECONDS = 10.0
#: PostgreSQL's time away in a restart.
DOWN_SECONDS = 3.0
#: What a killed web worker was serving dies with it: nginx answers it 502 (JSON).
GONE = 502
#: Times a buyer answered `503 busy` sends the same checkout again after its Retry-After, as a
#: client told to retry does: a 503 that hid a sale would sell that buyer a second unit (or,
#: keyed, replay an order the 503 denied).
BUSY_RETRIES = 1


class CeleryBeat:
    """`celery -A shop beat` as compose runs it (the schedule in settings: the sweeper every
    10 s, the reconciler every minute), a schedule file of its own in `folder`."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env = {**os.environ, **env}
        self.folder = folder
        self.schedule = folder / f"celerybeat-schedule-{uuid.uuid4().hex[:8]}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> CeleryBeat:
        """Start it; return once it has opened its schedule."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "shop", "beat", "-l", "warning"]
            + ["--schedule", str(self.schedule)],
            cwd=PROJECT_DIR,
            env=self.env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + 60
        while not list(self.folder.glob(f"{self.schedule.name}*")):
            assert self.alive(), f"celery beat exited with {self.process.returncode}"
            assert time.monotonic() < deadline, "celery beat did not open its schedule in 60 s"
            time.sleep(0.05)
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        kill_group(self.process)


@dataclass
class Shop:
    """A whole shop of a test's own: its database, Redis, server, proxy, order worker and
    beat."""

    postgres: PostgresServer
    redis: RedisServer
    env: dict[str, str]
    server: ShopServer
    worker: CeleryWorker
    beat: CeleryBeat
    #: nginx's, in front of the server.
    url: str

    def manage(self, *argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *argv],
            cwd=PROJECT_DIR,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def sessions(self) -> list[tuple]:
        """What each of the database's sessions is doing (to tell a repair held up, when one
        does not come)."""
        with psycopg.connect(self.postgres.url.replace("postgres://", "postgresql://")) as db:
            return db.execute(
                "SELECT application_name, state, wait_event_type, wait_event,"
                " now() - xact_start, left(query, 120) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()

    def audit(self, sku: str) -> dict:
        return json.loads(self.manage("sale", "audit", sku, "--json"))

    def orders(self, sku: str) -> dict[str, str]:
        """buyer: public id of every order of sku in the database (each buyer buys one unit at
        most: one that holds two fails the test)."""
        with psycopg.connect(self.postgres.url.replace("postgres://", "postgresql://")) as db:
            rows = db.execute(
                "SELECT o.buyer, o.public_id::text FROM inventory_order o"
                " JOIN inventory_item i ON o.item_id = i.id WHERE i.sku = %s",
                [sku],
            ).fetchall()
        orders = dict(rows)
        assert len(orders) == len(rows), f"a buyer holds two orders of {sku}: {sorted(rows)}"
        return orders


@pytest.fixture(scope="module")
def shop(tmp_path_factory) -> Iterator[Shop]:
    # The broker on a Redis apart: the faults of the shop's Redis are not the broker's.
    with PostgresServer() as postgres, RedisServer() as redis_server, RedisServer() as broker:
        queue = f"faults-{uuid.uuid4().hex[:8]}"
        env = {
            "DJANGO_SETTINGS_MODULE": "shop.lab_settings",  # for the breaker's probe interval
            "DATABASE_URL": postgres.url,
            "REDIS_URL": redis_server.url,
            "CELERY_BROKER_URL": broker.url,
            "FLASHSALE_TASK_QUEUE": queue,
            "FLASHSALE_REDIS_PREFIX": queue,
            "DJANGO_SECRET_KEY": TEST_SECRET_KEY,
            "DJANGO_CONN_MAX_AGE": "60",
            # Short timeouts, so that a fault is noticed at once.
            "FLASHSALE_REDIS_TIMEOUT": "0.3",
            "FLASHSALE_BREAKER_PROBE_SECONDS": "0.3",
        }
        postgres.migrate(env)
        proxy = tmp_path_factory.mktemp("proxy")
        # granian as compose runs it: the shop's workers and threads, on a socket they share
        server = ShopServer(env=env, uds=proxy / "web.sock").start()
        worker = CeleryWorker(env, concurrency=2).start()
        beat = CeleryBeat(env, proxy).start()
        port = free_port()
        # The order worker and beat that run at the end: a fault's recovery may have started
        # new ones in place of those started here.
        running = Shop(postgres, redis_server, env, server, worker, beat, url="")
        try:
            with nginx_serving(nginx_site(f"unix:{server.uds}", port), proxy, port) as url:
                running.url = url
                yield running
        finally:
            server.stop()
            running.worker.stop()
            running.beat.stop()


@dataclass
class Health:
    """Polls `/healthz` every 0.1 s in a thread; records what went unanswered within 2 s (or was
    answered by nginx for a web worker that died serving it), and when it was asked."""

    url: str
    answered: int = 0
    #: (what happened, when it was asked: time.monotonic()) for each probe unanswered.
    unanswered: list[tuple[str, float]] = field(default_factory=list)
    #: The longest an answer took, in seconds.
    slowest: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            asked = time.monotonic()
            try:
                response = requests.get(f"{self.url}/healthz", timeout=2)
                answer = response.json()
                if response.status_code == GONE:
                    self.unanswered.append((answer["error"], asked))
                else:
                    self.answered += 1
                    self.slowest = max(self.slowest, time.monotonic() - asked)
            except (requests.RequestException, ValueError) as exc:
                self.unanswered.append((type(exc).__name__, asked))
            self.stop.wait(0.1)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _web_worker(shop: Shop) -> psutil.Process:
    assert shop.server.process is not None
    return _children(shop.server.process.pid)[0]


def _web_server(shop: Shop) -> psutil.Process:
    """granian's main process: it starts the web workers and starts again one that dies."""
    assert shop.server.process is not None
    return psutil.Process(shop.server.process.pid)


def _order_worker(shop: Shop) -> psutil.Process:
    assert shop.worker.process is not None
    return psutil.Process(shop.worker.process.pid)


def _beat(shop: Shop) -> psutil.Process:
    assert shop.beat.process is not None
    return psutil.Process(shop.beat.process.pid)


def _kill(process: Callable[[Shop], psutil.Process]) -> Callable[[Shop], float]:
    def fault(shop: Shop) -> float:
        process(shop).kill()
        return time.monotonic()

    return fault


def _stop(
    process: Callable[[Shop], psutil.Process], *, children: bool = True
) -> Callable[[Shop], float]:
    """Stopped for STOPPED_SECONDS, with the processes it started (`children`) or while they go
    on."""

    def fault(shop: Shop) -> float:
        stopped = process(shop)
        group = [stopped, *(stopped.children(recursive=True) if children else [])]
        for one in group:
            one.suspend()
        struck = time.monotonic()
        time.sleep(STOPPED_SECONDS)  # the fault: stopped this long, while the crowd buys
        for one in group:
            one.resume()
        return struck

    return fault


def _kill_redis(shop: Shop) -> float:
    struck = time.monotonic()
    shop.redis.kill()
    shop.redis.restart()  # back at once, empty
    return struck


def _pause(server: Callable[[Shop], RedisServer | PostgresServer]) -> Callable[[Shop], float]:
    """Every process of the server stopped for STOPPED_SECONDS: its connections stay open,
    nothing answers on them."""

    def fault(shop: Shop) -> float:
        struck = time.monotonic()
        try:
            server(shop).pause()
            time.sleep(STOPPED_SECONDS)  # the fault: stopped this long, while the crowd buys
        finally:
            server(shop).resume()
        return struck

    return fault


def _restart_postgres(shop: Shop) -> float:
    struck = time.monotonic()
    shop.postgres.restart(down=DOWN_SECONDS)
    return struck


#: Each fault returns when it struck: for a web worker, once its signal is sent (a probe asked
#: before that, on a slow host, may be one the worker had taken already).
FAULTS: dict[str, Callable[[Shop], float]] = {
    "web worker killed": _kill(_web_worker),
    "web worker stopped": _stop(_web_worker),
    "web server's main process stopped": _stop(_web_server, children=False),
    "order worker killed": _kill(_order_worker),
    "order worker stopped": _stop(_order_worker),
    "beat killed": _kill(_beat),
    "beat stopped": _stop(_beat),
    "redis killed": _kill_redis,
    "redis stopped": _pause(lambda shop: shop.redis),
    "postgres restarted": _restart_postgres,
    "postgres stopped": _pause(lambda shop: shop.postgres),
}


def _recover(shop: Shop) -> None:
    """What a supervisor does after a kill: the order worker and beat started again (the web
    server's master respawns its own workers)."""
    assert shop.worker.process is not None
    if shop.worker.process.poll() is not None or not psutil.pid_exists(shop.worker.process.pid):
        shop.worker = CeleryWorker(shop.env, concurrency=2).start()
    if not shop.beat.alive():
        shop.beat.stop()
        shop.beat = CeleryBeat(shop.env, shop.beat.folder).start()


def _sale_through(shop: Shop, fault: str, strategy: str, keyed: bool) -> None:
    # Given a sale and a flood of buyers that outlasts its stock, and /healthz polled
    sku = f"fault-{uuid.uuid4().hex[:8]}"
    shop.manage("sale", "start", sku, "--stock", str(STOCK), "--strategy", strategy)
    results: list[FloodResult] = []
    crowd = threading.Thread(
        target=lambda: results.append(
            flood(
                shop.url,
                sku,
                attempts=ATTEMPTS,
                concurrency=BUYERS,
                pause=0.01,
                timeout=30,
                keyed=keyed,
                buyer_prefix=sku,
                retry_busy=BUSY_RETRIES,
            )
        )
    )
    health = Health(shop.url)
    crowd.start()
    try:
        # When the fault strikes once a fifth is sold
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(shop.orders(sku)) < STOCK // 5:
            time.sleep(0.05)
        struck = FAULTS[fault](shop)
        crowd.join(300)
    finally:
        health.end()
    _recover(shop)
    (result,) = results

    context = f"{fault}/{strategy}/keyed={keyed}: {dict(result.statuses)} {dict(result.errors)}"
    # Then every answer is JSON: 201, 409 sold out, or 503 busy with Retry-After (and, when a
    # web worker is killed, 502 for what it was serving: at most one request of each buyer);
    # a buyer's answer is its last, after its retry of a 503
    killed = fault == "web worker killed"
    assert result.not_json == 0 and result.busy_without_retry_after == 0, context
    assert set(result.statuses) <= {201, 409, 503, *([GONE] if killed else [])}, context
    assert set(result.errors) <= {"sold_out", "busy", *(["bad_gateway"] if killed else [])}
    assert result.statuses[GONE] <= BUYERS, context
    # and every 201 is an order in the database, and every order was answered 201 to its
    # buyer, or its buyer got no answer from the shop (nothing a 503 was given for was sold,
    # and no buyer that retried one holds two)
    orders = shop.orders(sku)
    assert sorted(result.order_ids) == sorted(
        public_id for buyer, public_id in orders.items() if result.answers[buyer] == 201
    ), context
    for buyer in orders:
        assert result.answers[buyer] in (201, GONE, 0), (buyer, result.answers[buyer], context)
    # and nothing was oversold
    audit = shop.audit(sku)
    assert audit["oversold"] == 0 and audit["accepted_units"] <= STOCK, audit
    assert audit["accepted_units"] == len(orders), audit
    # and once the fault is over, what it left wrong is repaired with no reconciler run: the
    # database, the stock rows and Redis agree (a process that started, a breaker that closed,
    # the units given back by the checkouts the fault refused)
    deadline = time.monotonic() + 60
    while not audit["consistent"] and time.monotonic() < deadline:
        time.sleep(0.5)
        audit = shop.audit(sku)
    assert audit["consistent"], f"{json.dumps(audit, default=str)}\n{shop.sessions()}"
    # and /healthz answered within 2 s throughout: every probe asked once the fault struck (a
    # probe that a web worker killed or stopped was already serving dies or waits with it)
    assert health.answered > 0
    web_worker = fault.startswith("web worker")
    late = [(what, asked - struck) for what, asked in health.unanswered if asked >= struck]
    serving = [what for what, asked in health.unanswered if asked < struck]
    assert not late and len(serving) <= (1 if web_worker else 0), (
        f"unanswered: {serving} asked before the fault, {late} after (s), "
        f"slowest answer {health.slowest:.2f} s"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "strategy", "keyed"),
    [
        (fault, strategy, keyed)
        for fault in FAULTS
        for strategy in ("lua", "segmented")
        for keyed in (False, True)
    ],
)
def test_a_fault_mid_flood_loses_nothing_promised(shop, fault, strategy, keyed):
    _sale_through(shop, fault, strategy, keyed)


@pytest.mark.parametrize(
    ("fault", "strategy", "keyed"),
    [("postgres restarted", "lua", True), ("redis stopped", "segmented", False)],
)
def test_a_fault_mid_flood_loses_nothing_promised_quick(shop, fault, strategy, keyed):
    # Two of the matrix's cases in every run of the suite (the whole matrix: -m slow)
    _sale_through(shop, fault, strategy, keyed)
