"""Invariant 6: bad input gets a clear JSON error and changes nothing."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from inventory.models import BuyerAllowance, Item, Order, Sale
from inventory.services import start_sale

pytestmark = [pytest.mark.django_db, pytest.mark.embedded_smoke]


@pytest.fixture
def item():
    start_sale(sku="gadget", stock=10, strategy="optimistic", limit=3)
    return Item.objects.get(sku="gadget")


def _snapshot():
    return (
        list(Item.objects.values_list("sku", "stock", "version", "strategy")),
        Order.objects.count(),
        BuyerAllowance.objects.count(),
        Sale.objects.count(),
    )


VALID = {"sku": "gadget", "qty": 1, "buyer": "ann"}

BAD_BODIES = [
    ("malformed JSON", b'{"sku": "gadget", "qty": ', 400, "invalid"),
    ("not an object", b"[1, 2]", 400, "invalid"),
    ("empty body", b"", 400, "invalid"),
    ("not UTF-8", b"\xff\xfe{}", 400, "invalid"),
    ("qty zero", {**VALID, "qty": 0}, 400, "invalid"),
    ("qty negative", {**VALID, "qty": -1}, 400, "invalid"),
    ("qty huge", {**VALID, "qty": 10**30}, 400, "invalid"),
    ("qty a string", {**VALID, "qty": "2"}, 400, "invalid"),
    ("qty a float", {**VALID, "qty": 1.5}, 400, "invalid"),
    ("qty a boolean", {**VALID, "qty": True}, 400, "invalid"),
    ("qty missing", {"sku": "gadget", "buyer": "ann"}, 400, "invalid"),
    ("buyer missing", {"sku": "gadget", "qty": 1}, 400, "invalid"),
    ("buyer blank", {**VALID, "buyer": "   "}, 400, "invalid"),
    ("buyer too long", {**VALID, "buyer": "b" * 65}, 400, "invalid"),
    ("buyer not a string", {**VALID, "buyer": 7}, 400, "invalid"),
    ("buyer with a control character", {**VALID, "buyer": "a\nb"}, 400, "invalid"),
    ("sku missing", {"qty": 1, "buyer": "ann"}, 400, "invalid"),
    ("unknown sku", {**VALID, "sku": "nope"}, 404, "unknown_sku"),
    ("unexpected field", {**VALID, "price": 0}, 400, "invalid"),
    ("idempotency key not a string", {**VALID, "idempotency_key": 5}, 400, "invalid"),
    ("idempotency key too long", {**VALID, "idempotency_key": "k" * 129}, 400, "invalid"),
    ("over the per-buyer limit", {**VALID, "qty": 4}, 409, "limit_reached"),
]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_a_bad_checkout_is_refused_and_changes_nothing(client, item, body, status, code):
    before = _snapshot()
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post("/api/checkout", raw, content_type="application/json")
    assert response.status_code == status
    payload = response.json()
    assert payload["error"] == code
    assert isinstance(payload["detail"], str) and payload["detail"]
    assert _snapshot() == before


def test_an_oversized_body_is_refused_and_changes_nothing(client, item):
    before = _snapshot()
    body = json.dumps({**VALID, "buyer": "x" * 20_000}).encode()
    response = client.post("/api/checkout", body, content_type="application/json")
    assert response.status_code == 413
    assert response.json()["error"] == "too_large"
    assert _snapshot() == before


def test_asking_for_more_than_is_left_is_sold_out_and_changes_nothing(client, item):
    Item.objects.filter(pk=item.pk).update(stock=2)
    before = _snapshot()
    response = client.post("/api/checkout", {**VALID, "qty": 3}, content_type="application/json")
    assert response.status_code == 409
    assert response.json()["error"] == "sold_out"
    assert "only 2 left" in response.json()["detail"]
    assert _snapshot() == before


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/checkout"),
        ("post", "/api/items/gadget"),
        ("post", "/api/items"),
        ("delete", "/api/orders/00000000-0000-4000-8000-000000000001"),
    ],
)
def test_a_wrong_method_gets_405_json(client, item, method, path):
    response = getattr(client, method)(path)
    assert response.status_code == 405
    assert response.json()["error"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("query", "detail"),
    [
        ("sku=" + "&sku=".join(f"s{n}" for n in range(101)), "at most 100 sku parameters, got 101"),
        ("sku=", "not a sku: ''"),
        ("sku=gadget&sku=bad%20sku!", "not a sku: 'bad sku!'"),
        ("sku=" + "x" * 65, "not a sku"),
    ],
)
def test_a_bad_item_list_query_is_400_json(client, item, query, detail):
    response = client.get(f"/api/items?{query}")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid"
    assert detail in response.json()["detail"]


def test_unknown_item_and_order_are_404_json(client, item):
    assert client.get("/api/items/nope").json()["error"] == "unknown_sku"
    response = client.get("/api/orders/00000000-0000-4000-8000-000000000001")
    assert response.status_code == 404
    assert response.json()["error"] == "unknown_order"
    # and an order is never found by counting: sequential ids are no order's
    assert client.get("/api/orders/1").status_code == 404


def test_deeply_nested_json_is_a_400_not_a_500(client, item):
    before = _snapshot()
    nested = b"[" * 5000 + b"]" * 5000  # under the body limit, past the parser's recursion
    response = client.post("/api/checkout", nested, content_type="application/json")
    assert response.status_code == 400 and response.json()["error"] == "invalid"
    assert client.post("/api/noop", nested, content_type="application/json").status_code == 200
    assert _snapshot() == before


@pytest.mark.parametrize("path", ["/api/items/%00", "/items/%00/", "/api/items/a%00b/audit"])
def test_a_nul_byte_in_a_sku_is_unknown_not_a_500(client, item, path, settings):
    settings.FLASHSALE_API_TOKEN = "audit-token"
    assert client.get(path, HTTP_AUTHORIZATION="Bearer audit-token").status_code == 404


@pytest.mark.parametrize(
    "form",
    [
        {"buyer": "ann", "qty": "1", "idempotency_key": "k" * 129},
        {"buyer": "ann", "qty": "1", "idempotency_key": "nul\x00key"},
        {"buyer": "nul\x00ann", "qty": "1"},
    ],
    ids=["long-key", "nul-key", "nul-buyer"],
)
def test_a_tampered_buy_form_is_refused_with_the_form_and_changes_nothing(client, item, form):
    before = _snapshot()
    response = client.post("/items/gadget/", form)
    assert response.status_code == 200
    assert 'data-error="invalid"' in response.content.decode()
    assert _snapshot() == before


@pytest.mark.parametrize(
    "args",
    [
        ["start", "gadget", "--stock", "-1", "--strategy", "lua"],
        ["start", "gadget", "--stock", "5", "--strategy", "magic"],
        ["start", "gadget", "--stock", "5", "--strategy", "lua", "--limit", "0"],
        ["start", "bad sku!", "--stock", "5", "--strategy", "lua"],
        ["start", "gadget", "--stock", "many", "--strategy", "lua"],
        ["start", "gadget", "--stock", "5", "--strategy", "lua", "--price", "-3"],
        ["start", "gadget", "--stock", "5", "--strategy", "lua", "--opens-in", "-1"],
        ["start", "gadget", "--stock", "5", "--strategy", "lua", "--price", "NaN"],
        ["start", "gadget", "--stock", "5", "--strategy", "lua", "--price", "Infinity"],
        ["start", "gadget", "--stock", "5", "--strategy", "lua", "--name", "x" * 201],
        ["start", "gadget", "--stock", "5", "--strategy", "lua", "--name", "nul\x00name"],
        ["audit", "nope"],
    ],
)
def test_sale_command_refuses_bad_arguments_and_changes_nothing(item, args):
    before = _snapshot()
    with pytest.raises(CommandError):
        call_command("sale", *args)
    assert _snapshot() == before


@pytest.mark.parametrize(
    ("setting", "value", "complaint"),
    [
        ("FLASHSALE_ITEM_PAGE_MS", "-1", "FLASHSALE_ITEM_PAGE_MS must be from 0 to 60000, not -1"),
        ("FLASHSALE_ITEM_PAGE_MS", "x", "FLASHSALE_ITEM_PAGE_MS must be from 0 to 60000, not x"),
        ("FLASHSALE_CHECKOUT_DEADLINE_MS", "99", "must be from 100 to 60000, not 99"),
        ("FLASHSALE_CHECKOUT_DEADLINE_MS", "60001", "must be from 100 to 60000, not 60001"),
        ("FLASHSALE_PAYMENT_FAILURE_RATE", "1.5", "must be from 0.0 to 1.0, not 1.5"),
        ("FLASHSALE_REDIS_TIMEOUT", "0", "REDIS_TIMEOUT must be from 0.01 to 10.0, not 0"),
    ],
)
def test_a_setting_out_of_range_is_refused_at_start(setting, value, complaint):
    import os
    import subprocess
    import sys

    from shop.processes.servers import PROJECT_DIR

    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=PROJECT_DIR,
        env={**os.environ, setting: value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert complaint in result.stderr
