"""The database closes every connection (a restart, a failover, an idle timeout): the next
checkouts of every web worker open a new one instead of answering 500."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from inventory.models import Order
from inventory.services import start_sale
from loadtest.flood import flood
from tests.conftest import start_shop

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def persistent_shop(django_db_setup, django_db_blocker):
    """A shop whose workers keep their database connections between requests, as in production."""
    server = start_shop(DJANGO_CONN_MAX_AGE=600)
    yield server
    server.stop()


@pytest.mark.parametrize("strategy", ["lock", "lua"])
def test_checkouts_after_the_server_dropped_every_connection_succeed(persistent_shop, strategy):
    # Given a sale every web worker has served, each holding its database connection open
    sku = f"dropped-{strategy}-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=1000, strategy=strategy)
    warm = flood(persistent_shop.url, sku, attempts=120, concurrency=12)
    assert warm.accepted == 120, dict(warm.statuses)

    # When the server terminates every other connection to the database
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        (terminated,) = cursor.fetchone()
    assert terminated >= 1

    # Then the next checkouts all succeed: no worker answers 500 for its dead connection
    after = flood(persistent_shop.url, sku, attempts=120, concurrency=12)
    assert after.server_errors == 0 and after.accepted == 120, dict(after.statuses)
    assert Order.objects.filter(item__sku=sku).count() == 240
