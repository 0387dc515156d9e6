"""An order's public id: a version 7 UUID, unguessable by its random bits and made in time order,
whichever way the order was written (a sale statement of its own, a batch, the ORM)."""

from __future__ import annotations

import time
import uuid

import pytest

from inventory.batch_statement import sell_batch
from inventory.models import Item, Order, new_public_id
from inventory.services import place_order, start_sale


def _milliseconds(public_id: uuid.UUID) -> int:
    return public_id.int >> 80


def _next_millisecond() -> None:
    """Return once the clock has moved on to another millisecond."""
    now = time.time_ns() // 1_000_000
    while time.time_ns() // 1_000_000 == now:
        pass


def test_a_public_id_is_a_version_7_uuid_stamped_with_the_millisecond_it_was_made():
    # When an id is made
    before = time.time_ns() // 1_000_000
    public_id = new_public_id()
    after = time.time_ns() // 1_000_000

    # Then it is an RFC 9562 UUID of version 7 whose first 48 bits are that millisecond
    assert public_id.version == 7
    assert public_id.variant == uuid.RFC_4122
    assert before <= _milliseconds(public_id) <= after


def test_public_ids_are_unique_and_sort_in_the_order_they_were_made():
    # When ids are made a few milliseconds apart, and many within one millisecond
    spaced = []
    for _ in range(5):
        spaced.append(new_public_id())
        _next_millisecond()
    many = [new_public_id() for _ in range(20_000)]

    # Then ids of different milliseconds sort as they were made, and none is repeated: 74 random
    # bits tell apart the ids of one millisecond
    assert sorted(spaced) == spaced
    assert len(set(many)) == len(many)
    assert len({public_id.int & ((1 << 62) - 1) for public_id in many}) == len(many)


@pytest.mark.django_db(transaction=True)
def test_every_way_an_order_is_written_gives_it_a_time_ordered_id():
    # Given a sale through the item row and one through stock rows
    start_sale(sku="ids-lock", stock=5, strategy="optimistic")
    start_sale(sku="ids-lua", stock=10, strategy="lua")
    lua = Item.objects.get(sku="ids-lua")

    # When orders are written by a sale statement of their own, by a batch and by the ORM
    started = time.time_ns() // 1_000_000
    own = place_order(sku="ids-lock", qty=1, buyer="ann").order
    _next_millisecond()
    batch = sell_batch(
        [
            {
                "item": lua.pk,
                "sale": lua.current_sale_id,
                "qty": 1,
                "buyer": buyer,
                "key": None,
                "limit": None,
                "served_by": "lua",
                "fallback": False,
                "rows": {str(index): 1},
            }
            for index, buyer in enumerate(["bob", "cy"])
        ]
    )
    _next_millisecond()
    made = Order.objects.create(item=lua, sale=lua.current_sale, buyer="dee", qty=1)

    # Then each stored id is a version 7 UUID made during the test, in the order of the writes
    stored = [
        Order.objects.get(pk=own.pk).public_id,
        *(Order.objects.get(pk=answer.order_id).public_id for answer in batch),
        Order.objects.get(pk=made.pk).public_id,
    ]
    assert [public_id.version for public_id in stored] == [7, 7, 7, 7]
    assert all(_milliseconds(public_id) >= started for public_id in stored)
    assert _milliseconds(stored[0]) < _milliseconds(stored[1]) <= _milliseconds(stored[2])
    assert _milliseconds(stored[2]) < _milliseconds(stored[3])
    # and the order a checkout returns is the one stored
    assert own.public_id == stored[0]
