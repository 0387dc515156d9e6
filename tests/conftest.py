"""Shared fixtures: a session-unique Redis key prefix and a real gunicorn on the test database."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from django.conf import settings
from django.db import connection

from loadtest.server import ShopServer

#: Shared by the test process and every server it starts, so both see the same Redis keys.
REDIS_PREFIX = f"flashsale-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True, scope="session")
def _redis_prefix() -> Iterator[None]:
    settings.FLASHSALE_REDIS_PREFIX = REDIS_PREFIX
    yield
    from inventory.redis_client import get_redis_client

    client = get_redis_client()
    keys = list(client.scan_iter(match=f"{REDIS_PREFIX}:*", count=1000))
    if keys:
        client.delete(*keys)


def test_database_url() -> str:
    """DATABASE_URL of the test database, for server processes the tests start."""
    db = connection.settings_dict
    host = quote(db["HOST"] or "", safe="")
    user = quote(db["USER"] or "", safe="")
    password = f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else ""
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgres://{user}{password}@{host}{port}/{db['NAME']}"


test_database_url.__test__ = False  # a helper, not a test


def server_env(**overrides: object) -> dict[str, str]:
    env = {
        "DATABASE_URL": test_database_url(),
        "REDIS_URL": settings.REDIS_URL,
        "FLASHSALE_REDIS_PREFIX": REDIS_PREFIX,
        "DJANGO_CONN_MAX_AGE": "0",
    }
    env.update({key: str(value) for key, value in overrides.items()})
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def start_shop(**overrides: object) -> ShopServer:
    workers = int(os.environ.get("FLASHSALE_TEST_SERVER_WORKERS", "6"))
    return ShopServer(env=server_env(**overrides), workers=workers).start()


@pytest.fixture(scope="session")
def shop_server(django_db_setup, django_db_blocker) -> Iterator[ShopServer]:
    """One real gunicorn for the session; `unsafe` gets a delay that widens its race."""
    server = start_shop(FLASHSALE_UNSAFE_DELAY_MS=15)
    yield server
    server.stop()
