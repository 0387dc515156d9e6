"""`manage.py sandbox drop`: the load-run sandbox's database and Redis keys go, the shop's stay,
and nothing goes while a run is connected to it."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from django.db import connection

from loadtest.sandbox import database_name
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env, test_database_url
from tests.support import delete_prefix

pytestmark = pytest.mark.django_db(transaction=True)


class Shop:
    """A shop database of this test's own (empty: the command only connects to it) and a
    Redis key prefix of its own, with the sandbox beside them."""

    def __init__(self) -> None:
        self.name = f"{connection.settings_dict['NAME']}_sandboxdrop"
        self.sandbox = database_name(self.name)
        self.prefix = f"test-sandbox-drop-{uuid.uuid4().hex[:12]}"
        self.url = urlunsplit(urlsplit(test_database_url())._replace(path=f"/{self.name}"))

    def url_of(self, name: str) -> str:
        return urlunsplit(urlsplit(self.url)._replace(path=f"/{name}"))

    def database_exists(self, name: str) -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
            return cursor.fetchone() is not None

    def create(self, name: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            cursor.execute(f'CREATE DATABASE "{name}"')

    def drop_sandbox(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", "sandbox", "drop"],
            cwd=ROOT,
            env=server_env(DATABASE_URL=self.url, FLASHSALE_REDIS_PREFIX=self.prefix),
            capture_output=True,
            text=True,
            timeout=60,
        )


@pytest.fixture
def shop(r: redis.Redis) -> Iterator[Shop]:
    shop = Shop()
    shop.create(shop.name)
    try:
        yield shop
    finally:
        with connection.cursor() as cursor:
            for name in (shop.sandbox, shop.name):
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        delete_prefix(r, shop.prefix)


def _sandbox_keys(r: redis.Redis, shop: Shop) -> list[str]:
    """Keys as a sale in the sandbox writes them (`inventory.keys`), braces included."""
    keys = [
        f"{shop.prefix}-loadrun:item:phone:sale:1:{{phone:1}}:row:{index}" for index in range(3)
    ] + [f"{shop.prefix}-loadrun:item:phone:sale:1:{{phone:1}}:claim:key-1"]
    for key in keys:
        r.set(key, 1)
    return keys


def test_drop_removes_the_sandbox_database_and_its_keys_and_nothing_of_the_shops(r, shop):
    # Given a sandbox with keys of a sale, beside the shop's own database and keys, and a key
    # whose prefix only starts like the sandbox's
    shop.create(shop.sandbox)
    sandbox_keys = _sandbox_keys(r, shop)
    kept = [f"{shop.prefix}:item:phone:sale:1:{{phone:1}}:row:0", f"{shop.prefix}-loadrunner:x"]
    for key in kept:
        r.set(key, 1)

    # When the sandbox is dropped
    result = shop.drop_sandbox()

    # Then its database and its keys are gone, and the shop's are where they were
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == (
        f"dropped the load-run database {shop.sandbox}; deleted {len(sandbox_keys)} Redis keys"
        f" under {shop.prefix}-loadrun:"
    )
    assert not shop.database_exists(shop.sandbox)
    assert r.exists(*sandbox_keys) == 0
    assert shop.database_exists(shop.name)
    assert r.exists(*kept) == len(kept)


def test_drop_refuses_while_a_run_is_connected_and_drops_nothing(r, shop):
    # Given a sandbox that a run is connected to
    shop.create(shop.sandbox)
    sandbox_keys = _sandbox_keys(r, shop)
    with psycopg.connect(shop.url_of(shop.sandbox)) as run:
        run.execute("SELECT 1")

        # When the sandbox is dropped
        result = shop.drop_sandbox()

        # Then it says why, and its database and its keys are all still there
        assert result.returncode == 1
        assert f"the load-run database {shop.sandbox} is in use" in result.stderr
        assert "nothing was dropped" in result.stderr
        assert shop.database_exists(shop.sandbox)
        assert r.exists(*sandbox_keys) == len(sandbox_keys)


def test_drop_deletes_the_keys_of_a_database_dropped_already(r, shop):
    # Given the sandbox's keys, its database dropped by other means (a sale of a database
    # created again would start at id 1 and meet them)
    sandbox_keys = _sandbox_keys(r, shop)
    assert not shop.database_exists(shop.sandbox)

    # When the sandbox is dropped
    result = shop.drop_sandbox()

    # Then the keys are gone too
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == (
        f"no database {shop.sandbox}; deleted {len(sandbox_keys)} Redis keys under "
        f"{shop.prefix}-loadrun:"
    )
    assert r.exists(*sandbox_keys) == 0
