"""Shared fixtures: a session-unique Redis key prefix and a real gunicorn on the test database."""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import pytest
import redis
import requests
from django.conf import settings
from django.db import connection

from shop import queues
from shop.processes.children import pid_alive
from shop.processes.servers import CeleryWorker, ShopServer
from tests.support import delete_prefix, flush, redis_url, unique_prefix

#: Shared by the test process and every server and worker it starts: the same Redis keys and
#: the same Celery queue, neither of which anything outside this run touches.
REDIS_PREFIX = f"flashsale-test-{uuid.uuid4().hex[:8]}"
TASK_QUEUE = f"{REDIS_PREFIX}-orders"
#: The servers the tests start sign their sessions with it.
TEST_SECRET_KEY = f"flashsale-tests-{uuid.uuid4().hex}"
#: And take it as the bearer token of their audit endpoint.
TEST_API_TOKEN = f"flashsale-tests-{uuid.uuid4().hex}"


def pytest_configure(config: pytest.Config) -> None:
    # The transactional tests' teardown deletes rows instead of truncating every table.
    flush.install()


@pytest.fixture(autouse=True, scope="session")
def _isolated_redis_and_queue() -> Iterator[None]:
    from shop.celery import app

    settings.FLASHSALE_REDIS_PREFIX = REDIS_PREFIX
    # Sessions made here (a force_login) must be the servers' sessions too.
    settings.SECRET_KEY = TEST_SECRET_KEY
    queues.use(app, TASK_QUEUE)
    yield
    from inventory.orders import publisher
    from inventory.redis_client import get_redis_client

    # Orders the publisher still holds are sent now, not at the interpreter's exit, after the
    # queue below is gone (which would leave it behind, holding their message).
    publisher.stop()
    client = get_redis_client()
    delete_prefix(client, REDIS_PREFIX)  # the shop's keys, and the order queue's (TASK_QUEUE)
    bindings = list(client.scan_iter(match=f"_kombu.binding*.{TASK_QUEUE}*", count=1000))
    if bindings:
        client.delete(*bindings)


@pytest.fixture(autouse=True)
def _no_remembered_item_pages() -> None:
    """Each test starts with no remembered `GET /api/items/<sku>` answers: those of an earlier
    test's items would outlive its rows by FLASHSALE_ITEM_PAGE_MS."""
    from inventory.selectors import forget_item_pages

    forget_item_pages()


@pytest.fixture(autouse=True)
def _breakers_closed() -> Iterator[None]:
    """Each test starts with this process's breakers closed: a failure an earlier test made
    would send its checkouts to the fallback."""
    from inventory.breaker import breaker, broker_breaker

    breaker.reset()
    broker_breaker.reset()
    yield
    breaker.settle(timeout=10)  # a probe the test started: done before its data goes
    breaker.reset()
    broker_breaker.reset()


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    django_db_modify_db_settings_parallel_suffix: None, django_db_blocker, django_db_keepdb: bool
) -> None:
    """This run's own test database, `test_<database>_<host>_<pid>` (`<host>`: a short hash of
    the host's name): two runs on one PostgreSQL (two checkouts, or a run beside CI) would
    otherwise drop each other's database and load-run sandbox. The databases a run on this host
    left when it was killed (its pid gone) are dropped first. `--reuse-db` keeps
    pytest-django's one name, `test_<database>`, from run to run."""
    database = settings.DATABASES["default"]
    if database["ENGINE"] == "shop.nodatabase" or django_db_keepdb:
        return  # no database configured (the tests that need one say so), or one to reuse
    host = hashlib.blake2s(socket.gethostname().encode(), digest_size=3).hexdigest()
    stem = f"test_{database['NAME']}_{host}_"
    database.setdefault("TEST", {})["NAME"] = f"{stem}{os.getpid()}"
    from loadtest.sandbox import SUFFIX

    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s)", [stem])
        for (name,) in cursor.fetchall():
            pid = name.removeprefix(stem).removesuffix(SUFFIX)
            if pid.isdigit() and not pid_alive(int(pid)):
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    connection.close()


@pytest.fixture(autouse=True, scope="session")
def _drop_load_run_database(django_db_setup, django_db_blocker) -> Iterator[None]:
    """Load runs started by the tests sell in `<test database>_loadrun`: gone afterwards.
    Named from the test database's name, never from the connection's: a session whose tests
    need no database sets none up, and its connection still names the shop's own database,
    whose sandbox a demo may be selling in."""
    yield
    from loadtest.sandbox import database_name

    with django_db_blocker.unblock(), connection.cursor() as cursor:
        name = database_name(connection.creation._get_test_db_name())
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(autouse=True, scope="session")
def _database_probe_closed(django_db_setup) -> Iterator[None]:
    """/healthz asks the database from a thread of its own, on a connection of its own
    (`inventory.selectors.database_probe`): closed before the test database is dropped."""
    yield
    from inventory.selectors import database_probe

    database_probe.close()


@pytest.fixture
def r() -> Iterator[redis.Redis]:
    """A plain client of the shared test Redis, for tests of `locking` alone."""
    client = redis.Redis.from_url(redis_url())
    yield client
    client.close()


@pytest.fixture
def prefix(r: redis.Redis, request) -> Iterator[str]:
    """A key prefix of this test's own, deleted afterwards."""
    key_prefix = unique_prefix(request.node.module.__name__.rsplit(".", 1)[-1])
    yield key_prefix
    delete_prefix(r, key_prefix)


def test_database_url() -> str:
    """DATABASE_URL of the test database, for server processes the tests start."""
    db = connection.settings_dict
    host = quote(db["HOST"] or "", safe="")
    user = quote(db["USER"] or "", safe="")
    password = f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else ""
    port = f":{db['PORT']}" if db["PORT"] else ""
    # A unix-socket server (the embedded one) is named by a `host` option, not HOST.
    socket_dir = db.get("OPTIONS", {}).get("host")
    query = f"?host={quote(socket_dir, safe='/')}" if socket_dir else ""
    return f"postgres://{user}{password}@{host}{port}/{db['NAME']}{query}"


test_database_url.__test__ = False  # a helper, not a test


def server_env(**overrides: object) -> dict[str, str]:
    """The environment of a process the tests start: on the test database, the session's Redis
    keys and task queue, under the lab settings (shop.lab_settings), so that `overrides` may
    set the lab's seams as well as the shop's settings."""
    env = {
        "DJANGO_SETTINGS_MODULE": "shop.lab_settings",
        "DATABASE_URL": test_database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "FLASHSALE_REDIS_PREFIX": REDIS_PREFIX,
        "FLASHSALE_TASK_QUEUE": TASK_QUEUE,
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "DJANGO_CONN_MAX_AGE": "0",
        "DJANGO_SECRET_KEY": TEST_SECRET_KEY,
        "FLASHSALE_API_TOKEN": TEST_API_TOKEN,
    }
    env.update({key: str(value) for key, value in overrides.items()})
    return env


def start_shop(*, kind: str = "granian", threads: int = 4, **overrides: object) -> ShopServer:
    """A real server of the shop on the test database (granian, as the shop runs, three workers
    of four threads unless FLASHSALE_TEST_SERVER_WORKERS says otherwise): `kind` and `threads`
    as `ShopServer` takes them; `overrides` are settings or seams (environment variables) of
    its own."""
    workers = int(os.environ.get("FLASHSALE_TEST_SERVER_WORKERS", "3"))
    return ShopServer(
        env=server_env(**overrides), workers=workers, kind=kind, threads=threads
    ).start()


@pytest.fixture(scope="session")
def shop_server(django_db_setup, django_db_blocker) -> Iterator[ShopServer]:
    """One real granian server for the session; `unsafe` gets a delay that widens its race."""
    server = start_shop(FLASHSALE_UNSAFE_DELAY_MS=15)
    yield server
    server.stop()


@pytest.fixture
def no_queued_orders() -> None:
    """The session's task queue emptied: a worker started in the test settles what the test
    sells, not first every order the tests before it sold through the session's server."""
    from shop.celery import app

    app.control.purge()


def start_worker(concurrency: int = 2, **overrides: object) -> CeleryWorker:
    return CeleryWorker(server_env(**overrides), concurrency=concurrency).start()


def wait_until(condition, *, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def answers_ok(url: str) -> bool:
    """Whether `url` answers 200 within 2 s (False when it does not answer at all)."""
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False
