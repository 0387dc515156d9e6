"""GET /api/items/<sku> answers with what its process read a moment ago (FLASHSALE_ITEM_PAGE_MS):
the item page's poll and a crowd's looks cost no query and no Redis call, and the stock it
shows is at most that long behind the sales."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from inventory import selectors
from inventory.services import place_order, restock, start_sale
from tests.conftest import wait_until

pytestmark = pytest.mark.django_db


def _stock(client, sku: str) -> int:
    response = client.get(f"/api/items/{sku}")
    assert response.status_code == 200, response.content
    return response.json()["stock"]


def test_a_look_within_the_memory_reads_nothing(
    client, settings, monkeypatch, django_capture_on_commit_callbacks
):
    settings.FLASHSALE_ITEM_PAGE_MS = 60_000
    with django_capture_on_commit_callbacks(execute=True):  # Redis is warmed once committed
        start_sale(sku="page", stock=5, strategy="lua")
    redis_reads = []
    read_redis = selectors.redis_stock_of
    monkeypatch.setattr(
        selectors, "redis_stock_of", lambda item: redis_reads.append(item) or read_redis(item)
    )
    first = client.get("/api/items/page").json()
    assert first["stock"] == 5 and first["redis_stock"] == 5 and len(redis_reads) == 1

    place_order(sku="page", qty=2, buyer="ann")
    with CaptureQueriesContext(connection) as queries:
        again = client.get("/api/items/page").json()
    assert again == first
    assert len(queries) == 0 and len(redis_reads) == 1


def test_a_look_once_the_memory_is_over_sees_the_sales(
    client, settings, django_capture_on_commit_callbacks
):
    settings.FLASHSALE_ITEM_PAGE_MS = 100
    with django_capture_on_commit_callbacks(execute=True):
        start_sale(sku="page", stock=5, strategy="lua")
    assert _stock(client, "page") == 5
    place_order(sku="page", qty=2, buyer="ann")
    # (looks within the memory still show the 5 it remembers)
    assert wait_until(lambda: _stock(client, "page") != 5, timeout=10, interval=0.02)
    fresh = client.get("/api/items/page").json()
    assert fresh["stock"] == 3 and fresh["redis_stock"] == 3


def test_a_sale_restarted_or_restocked_here_is_read_at_once(
    client, settings, django_capture_on_commit_callbacks
):
    settings.FLASHSALE_ITEM_PAGE_MS = 60_000
    start_sale(sku="page", stock=5, strategy="segmented")
    assert _stock(client, "page") == 5

    start_sale(sku="page", stock=9, strategy="segmented")
    assert _stock(client, "page") == 9

    with django_capture_on_commit_callbacks(execute=True):
        restock(sku="page", units=4)
    assert _stock(client, "page") == 13


def test_without_the_memory_every_look_reads(client, settings):
    settings.FLASHSALE_ITEM_PAGE_MS = 0
    start_sale(sku="page", stock=5, strategy="lock")
    assert _stock(client, "page") == 5
    place_order(sku="page", qty=1, buyer="ann")
    assert _stock(client, "page") == 4


def test_an_unknown_sku_is_not_remembered(client, settings):
    settings.FLASHSALE_ITEM_PAGE_MS = 60_000
    assert client.get("/api/items/later").json()["error"] == "unknown_sku"
    start_sale(sku="later", stock=3, strategy="lua")
    assert _stock(client, "later") == 3


def test_the_memory_holds_at_most_so_many_items(client, settings, monkeypatch):
    # Given a memory of two items, and three items looked at in turn
    settings.FLASHSALE_ITEM_PAGE_MS = 60_000
    monkeypatch.setattr(selectors, "MAX_ITEM_PAGES", 2)
    for sku in ("one", "two", "three"):
        start_sale(sku=sku, stock=1, strategy="lock")
        assert _stock(client, sku) == 1

    # When each sells its unit
    for sku in ("one", "two", "three"):
        place_order(sku=sku, qty=1, buyer="ann")

    # Then the last looked at is remembered as it was, and the first, dropped to make room for
    # it, is read afresh
    assert _stock(client, "three") == 1
    assert _stock(client, "one") == 0
