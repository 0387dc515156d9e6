"""`sale audit SKU` without --json prints what a reader reads: plain statuses and figures, never
Python's names for them."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client

from inventory.services import start_sale

pytestmark = pytest.mark.django_db


def _audit_lines(sku: str) -> dict[str, str]:
    out = StringIO()
    call_command("sale", "audit", sku, stdout=out)
    return dict(line.split(None, 1) for line in out.getvalue().splitlines())


def test_the_audit_prints_plain_statuses_and_figures(django_capture_on_commit_callbacks):
    # Given a segmented sale with one order of 3 units
    with django_capture_on_commit_callbacks(execute=True):
        start_sale(sku="widget", stock=20, strategy="segmented")
    answer = Client().post(
        "/api/checkout", {"sku": "widget", "qty": 3, "buyer": "ann"}, "application/json"
    )
    assert answer.status_code == 201

    # When it is audited as text
    lines = _audit_lines("widget")

    # Then statuses are plain words with their counts, as in the JSON
    assert lines["orders_by_status"] == "pending: 1, paid: 0, confirmed: 0, failed: 0, expired: 0"
    assert lines["units_by_status"] == "pending: 3, paid: 0, confirmed: 0, failed: 0, expired: 0"
    assert lines["consistent"] == "yes" and lines["accepted_units"] == "3"
    assert lines["stock_rows"].startswith("0: ") and lines["stock_rows"].count(": ") == 10
    assert not [line for line in lines.values() if "OrderStatus" in line or "{" in line]
