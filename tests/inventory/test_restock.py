"""`sale restock`: units added to a running sale, on every strategy, while it sells."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from inventory.exceptions import Busy, SoldOut
from inventory.models import Item, Order, Sale
from inventory.orders import reconcile_sale
from inventory.selectors import audit_sale
from inventory.services import place_order, restock, start_sale

STRATEGIES = ["lock", "segmented", "lua", "optimistic"]


@pytest.mark.django_db(transaction=True)  # Redis hears of a restock once it is committed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_sold_out_sale_sells_the_units_a_restock_adds(strategy, capsys):
    start_sale(sku="widget", stock=4, strategy=strategy)
    for n in range(4):
        place_order(sku="widget", qty=1, buyer=f"b{n}")
    with pytest.raises(SoldOut):
        place_order(sku="widget", qty=1, buyer="late")

    call_command("sale", "restock", "widget", "--add", "13")
    assert "13 units added (4 at the start, 17 in all)" in capsys.readouterr().out

    for n in range(13):
        place_order(sku="widget", qty=1, buyer=f"c{n}")
    with pytest.raises(SoldOut):
        place_order(sku="widget", qty=1, buyer="later")
    audit = audit_sale("widget")
    assert (audit["initial_stock"], audit["added_stock"], audit["accepted_units"]) == (4, 13, 17)
    assert audit["oversold"] == audit["remaining"] == audit["db_stock"] == 0
    assert audit["consistent"], audit
    assert reconcile_sale("widget") == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_restocks_under_a_flood_sell_every_unit_once(strategy):
    # 16 buyers keep buying while four restocks land; they stop once the last restock is in
    # and the shop says sold out.
    start_sale(sku="widget", stock=40, strategy=strategy)
    restocked = threading.Event()
    sold = []

    def buyer(number: int) -> None:
        try:
            attempt = 0
            while True:
                attempt += 1
                try:
                    sold.append(place_order(sku="widget", qty=1, buyer=f"{number}-{attempt}"))
                except Busy:
                    continue
                except SoldOut:
                    if restocked.is_set():
                        return
        finally:
            connection.close()

    with ThreadPoolExecutor(16) as pool:
        buyers = [pool.submit(buyer, number) for number in range(16)]
        for _ in range(4):
            restock(sku="widget", units=15)
        restocked.set()
        for future in buyers:
            future.result(timeout=120)

    assert len(sold) == 100 == Order.objects.filter(item__sku="widget").count()
    audit = audit_sale("widget")
    assert (audit["accepted_units"], audit["oversold"], audit["db_stock"]) == (100, 0, 0)
    assert audit["consistent"], audit
    assert reconcile_sale("widget") == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (["nope", "--add", "5"], "nope"),
        (["widget", "--add", "0"], "units to add"),
        (["widget", "--add", "-3"], "units to add"),
        (["widget", "--add", str(10**9 + 1)], "units to add"),
    ],
)
def test_a_restock_it_cannot_do_is_a_clear_error_and_changes_nothing(arguments, says):
    start_sale(sku="widget", stock=5, strategy="segmented")
    with pytest.raises(CommandError, match=says):
        call_command("sale", "restock", *arguments)
    assert Sale.objects.get().added_stock == 0
    assert Item.objects.get(sku="widget").units_left == 5
