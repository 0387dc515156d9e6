"""Every answer under /api/ is the API's JSON: unknown paths, malformed ids, wrong methods,
refused requests and unexpected failures included; and every error it answers is in the API's
documented list (docs/operations.md)."""

from __future__ import annotations

import json
import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from inventory import selectors
from inventory.models import Order
from inventory.services import start_sale
from shop.processes.servers import PROJECT_DIR

pytestmark = [pytest.mark.django_db, pytest.mark.embedded_smoke]

ORDER = "00000000-0000-4000-8000-000000000001"


@pytest.fixture
def item():
    start_sale(sku="phone", stock=1, strategy="optimistic", limit=1)


def _api_error(response) -> dict:
    """The answer's `{"error", "detail"}`, once it is checked to be exactly that, as JSON."""
    assert response["Content-Type"] == "application/json", response.content[:200]
    payload = json.loads(response.content)
    assert set(payload) == {"error", "detail"}, payload
    assert isinstance(payload["detail"], str) and payload["detail"]
    return payload


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [
        ("get", "/api/items/phone/", "not_found"),
        ("get", "/api/nope", "not_found"),
        ("post", "/api/nope", "not_found"),
        ("get", "/api/", "not_found"),
        ("get", "/api/checkout/", "not_found"),
        ("get", "/api/items/phone/audit/", "not_found"),
        ("get", "/api/orders/123", "unknown_order"),
        ("get", "/api/orders/not-a-uuid", "unknown_order"),
        ("get", f"/api/orders/{ORDER}/", "not_found"),
    ],
)
def test_an_unknown_path_or_a_malformed_id_is_a_json_404(item, method, path, code):
    response = getattr(Client(enforce_csrf_checks=True), method)(path)
    assert response.status_code == 404
    assert _api_error(response)["error"] == code


def test_a_path_with_a_slash_too_many_says_which_one_is_meant(item):
    detail = _api_error(Client().get("/api/items/phone/"))["detail"]
    assert detail == "no API endpoint at /api/items/phone/; did you mean /api/items/phone?"
    assert "did you mean" not in _api_error(Client().get("/api/nope/"))["detail"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/checkout"),
        ("post", "/api/items/phone"),
        ("post", "/api/items"),
        ("post", f"/api/orders/{ORDER}"),
        ("post", "/api/items/phone/audit"),
        ("post", "/healthz"),
    ],
)
def test_a_wrong_method_is_a_json_405_even_where_a_page_would_check_csrf(item, method, path):
    response = getattr(Client(enforce_csrf_checks=True), method)(path)
    assert response.status_code == 405
    assert _api_error(response)["error"] == "method_not_allowed"


def test_a_request_refused_before_any_view_is_a_json_400_under_the_api(item):
    # (a Host header not in ALLOWED_HOSTS)
    response = Client().get("/api/items/phone", HTTP_HOST="elsewhere.invalid")
    assert response.status_code == 400
    assert _api_error(response)["error"] == "invalid"
    # while a page keeps Django's own
    page = Client().get("/items/phone/", HTTP_HOST="elsewhere.invalid")
    assert page.status_code == 400 and not page["Content-Type"].startswith("application/json")


def test_an_unexpected_failure_is_a_json_500_under_the_api_and_a_page_elsewhere(item, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(selectors, "item_page", fail)
    monkeypatch.setattr(selectors, "get_item", fail)
    client = Client(raise_request_exception=False)
    response = client.get("/api/items/phone")
    assert response.status_code == 500
    assert _api_error(response)["error"] == "error"
    page = client.get("/items/phone/")
    assert page.status_code == 500 and page["Content-Type"].startswith("text/html")


def _documented_errors() -> set[tuple[int, str]]:
    """The `STATUS code` pairs of the API's list in docs/operations.md."""
    text = (PROJECT_DIR / "docs" / "operations.md").read_text()
    api = text.split("## HTTP API", 1)[1].split("\n## ", 1)[0]
    return {(int(status), code) for status, code in re.findall(r"`(\d{3}) ([a-z_]+)`", api)}


def test_every_error_the_api_answers_is_in_its_documented_list(item, settings, monkeypatch):
    # Given a sale of one unit, one per buyer, and one that opens later
    settings.FLASHSALE_API_TOKEN = "token-for-this-test"
    start_sale(sku="later", stock=1, strategy="lua", opens_in=600)
    client = Client(enforce_csrf_checks=True, raise_request_exception=False)

    def checkout(**body):
        return client.post("/api/checkout", body, content_type="application/json")

    # When the API is asked every wrong thing a client can ask
    assert checkout(sku="phone", qty=1, buyer="ann").status_code == 201
    answers = [
        checkout(sku="phone", qty=1, buyer="bob"),  # sold out
        checkout(sku="phone", qty=2, buyer="cy"),  # over the limit
        checkout(sku="later", qty=1, buyer="ann"),  # not open yet
        checkout(sku="nope", qty=1, buyer="ann"),
        checkout(sku="phone", qty=0, buyer="ann"),
        checkout(sku="phone", qty=1, buyer="x" * 20_000),  # too large
        client.get("/api/checkout"),
        client.get("/api/items?sku=bad%20sku"),
        client.get(f"/api/orders/{ORDER}"),
        client.get("/api/orders/123"),
        client.get("/api/items/phone/audit"),
        client.get("/api/items/phone/"),
        client.get("/api/items/phone", HTTP_HOST="elsewhere.invalid"),
    ]
    monkeypatch.setattr(selectors, "item_page", lambda sku: 1 / 0)
    answers.append(client.get("/api/items/phone"))

    # Then each answer's status and code are in the documented list
    answered = {(answer.status_code, _api_error(answer)["error"]) for answer in answers}
    assert len(answered) == 11
    assert answered - _documented_errors() == set()
    assert Order.objects.count() == 1


def test_a_keyed_checkout_whose_commit_is_unknown_is_not_told_to_retry(item, monkeypatch):
    # Given a sale whose statement lost its connection and whose database did not answer
    # whether it committed (lost_connection.resolve gave up)
    from inventory import services
    from inventory.exceptions import OutcomeUnknown

    def unknown(**kwargs):
        raise OutcomeUnknown("0190a6d2-0000-7000-8000-000000000001")

    monkeypatch.setattr(services, "_sell", unknown)
    # When the buyer checked out with an idempotency key
    with CaptureQueriesContext(connection) as queries:
        response = Client().post(
            "/api/checkout",
            {"sku": "phone", "qty": 1, "buyer": "ann", "idempotency_key": "k-unknown"},
            content_type="application/json",
        )
    # Then the answer says the outcome is unknown and invites no retry (a `503 busy` would
    # tell the buyer that nothing was sold)
    assert response.status_code == 503
    assert _api_error(response)["error"] == "outcome_unknown"
    assert "Retry-After" not in response
    # and the database, which did not answer, was not asked for the key's order
    assert not [q["sql"] for q in queries.captured_queries if "inventory_order" in q["sql"]]
