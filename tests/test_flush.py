"""The transactional tests' teardown (`tests/support/flush.py`) empties what Django's flush did."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection, connections, transaction
from django.test import TransactionTestCase

from inventory.models import Item, Order, Sale, StockShard
from inventory.services import place_order, start_sale
from tests.support.flush import delete_every_row


def _teardown() -> None:
    case = type("Case", (TransactionTestCase,), {"databases": {"default"}})()
    delete_every_row(case)


@pytest.mark.django_db(transaction=True)
def test_every_row_goes_and_content_types_keep_their_ids():
    start_sale(sku="gone", stock=20, strategy="segmented")
    place_order(sku="gone", qty=1, buyer="ann")
    item_type = ContentType.objects.get_for_model(Item).pk
    permissions = Permission.objects.count()
    assert permissions > 0

    _teardown()

    for model in (Item, Sale, StockShard, Order):
        assert not model.objects.exists(), model
    assert ContentType.objects.get_for_model(Item).pk == item_type
    assert Permission.objects.count() == permissions


@pytest.mark.django_db(transaction=True)
def test_it_waits_for_a_transaction_still_writing_and_deletes_its_rows_too():
    inserted, commit = threading.Event(), threading.Event()

    def late_writer() -> None:
        try:
            with transaction.atomic():
                Item.objects.create(sku="late", name="late")
                inserted.set()
                assert commit.wait(10)
        finally:
            connections.close_all()

    writer = threading.Thread(target=late_writer)
    writer.start()
    assert inserted.wait(10)
    teardown = threading.Thread(target=lambda: (_teardown(), connection.close()))
    teardown.start()
    teardown.join(0.5)
    assert teardown.is_alive()  # held by the writer's open transaction
    commit.set()
    writer.join(10)
    teardown.join(10)
    assert not teardown.is_alive()
    assert not Item.objects.filter(sku="late").exists()
