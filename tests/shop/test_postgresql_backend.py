"""The database backend's health check on a real PostgreSQL: an idle connection is found
healthy without a round trip, one the server closed is found dead."""

from __future__ import annotations

import select
import time

import pytest
from django.db import connection, connections
from django.db.backends.postgresql import base as django_base

from shop.postgresql.base import DatabaseWrapper

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded_smoke]


@pytest.fixture
def other():
    """A second connection to the test database, as a web worker keeps one."""
    wrapper = connections.create_connection("default")
    wrapper.ensure_connection()
    yield wrapper
    wrapper.close()


@pytest.fixture
def round_trips(monkeypatch):
    """Counts the `SELECT 1` checks Django's own backend would send."""
    sent = []
    original = django_base.DatabaseWrapper.is_usable

    def counting(self):
        sent.append(self)
        return original(self)

    monkeypatch.setattr(django_base.DatabaseWrapper, "is_usable", counting)
    return sent


def test_the_settings_use_this_backend(other):
    assert isinstance(other, DatabaseWrapper)


def test_an_idle_connection_is_healthy_without_a_round_trip(other, round_trips):
    with other.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert other.is_usable()
    assert round_trips == []


def test_a_connection_the_server_closed_is_found_dead(other, round_trips):
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [other.connection.info.backend_pid])
        assert cursor.fetchone()[0]
    deadline = time.monotonic() + 5
    while not _readable(other) and time.monotonic() < deadline:
        time.sleep(0.05)

    assert not other.is_usable()
    assert round_trips == [other]  # the unasked message made it ask the server

    # and Django replaces it before the next query
    other.health_check_done = False
    other.close_if_health_check_failed()
    with other.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone()[0] == 1


def _readable(wrapper) -> bool:
    return bool(select.select([wrapper.connection.pgconn.socket], [], [], 0)[0])
