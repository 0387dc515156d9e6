"""The plain storefront pages: list, item page with a CSRF-protected buy form, order page."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from inventory.models import Order
from inventory.services import start_sale

pytestmark = [pytest.mark.django_db, pytest.mark.embedded_smoke]


def _form_fields(html: str) -> dict[str, str]:
    return dict(re.findall(r'name="([a-z_]+)" value="([^"]*)"', html))


def test_buying_from_the_item_page_leads_to_the_order_page():
    start_sale(sku="phone", stock=3, strategy="lua", name="Phone", price=199)
    browser = Client(enforce_csrf_checks=True)

    listing = browser.get("/").content.decode()
    assert "Phone" in listing and "3 left" in listing

    page = browser.get("/items/phone/")
    assert page.status_code == 200
    fields = _form_fields(page.content.decode())
    assert fields["csrfmiddlewaretoken"] and fields["idempotency_key"]

    bought = browser.post("/items/phone/", {**fields, "buyer": "ann", "qty": "2"}, follow=True)
    order = Order.objects.get()
    assert bought.redirect_chain == [(f"/orders/{order.public_id}/", 302)]
    assert "pending" in bought.content.decode() and order.qty == 2

    # the same rendered form submitted twice (a double click) makes one order
    browser.post("/items/phone/", {**fields, "buyer": "ann", "qty": "2"})
    assert Order.objects.count() == 1


def test_the_buy_form_refuses_a_post_without_csrf_token():
    start_sale(sku="phone", stock=3, strategy="lua")
    response = Client(enforce_csrf_checks=True).post("/items/phone/", {"buyer": "a", "qty": "1"})
    assert response.status_code == 403
    assert Order.objects.count() == 0


def test_sold_out_and_bad_quantities_are_shown_on_the_item_page():
    start_sale(sku="phone", stock=1, strategy="optimistic")
    browser = Client()
    # (a form re-rendered with its error answers 200, as Django's forms do)
    bad_quantity = browser.post("/items/phone/", {"buyer": "ann", "qty": "0"})
    assert (
        bad_quantity.status_code == 200 and 'data-error="invalid"' in bad_quantity.content.decode()
    )
    assert browser.post("/items/phone/", {"buyer": "ann", "qty": "1"}).status_code == 302
    refused = browser.post("/items/phone/", {"buyer": "bob", "qty": "1"})
    assert refused.status_code == 200
    html = refused.content.decode()
    assert 'data-error="sold_out"' in html and "Every unit has been sold." in html
    assert Order.objects.count() == 1


def test_unknown_item_and_order_pages_are_404():
    assert Client().get("/items/nope/").status_code == 404
    assert Client().get("/orders/12345/").status_code == 404


def test_beat_runs_the_sweeper_and_reconciler_tasks():
    from django.conf import settings

    from shop.celery import app

    app.loader.import_default_modules()
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert scheduled == {
        "inventory.tasks.sweep_orders_task",
        "inventory.tasks.reconcile_sales_task",
    }
    assert scheduled <= set(app.tasks)


def test_an_empty_shop_says_how_to_put_something_on_sale(client):
    page = client.get("/").content.decode()
    assert "Nothing is on sale" in page
    assert "make sale SKU=phone STOCK=100 STRATEGY=lua" in page and "make admin" in page
    start_sale(sku="phone", stock=3, strategy="lua")
    assert "Nothing is on sale" not in client.get("/").content.decode()
