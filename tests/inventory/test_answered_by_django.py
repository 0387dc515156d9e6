"""Every checkout is answered by Django's own response cycle: the view's answer passes through
the middleware (its headers are there, and a response middleware sees the 201 and its order),
and the server logs the status the buyer got."""

from __future__ import annotations

import logging
import re

import pytest
import requests
from django.test import Client

from inventory.services import start_sale
from shop.processes.servers import ShopServer
from tests.conftest import server_env, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_the_test_client_sees_the_201_and_the_middlewares_headers(strategy):
    start_sale(sku=f"seen-{strategy}", stock=3, strategy=strategy)

    response = Client().post(
        "/api/checkout",
        {"sku": f"seen-{strategy}", "qty": 1, "buyer": "ann"},
        content_type="application/json",
    )

    assert response.status_code == 201 and response.json()["status"] == "pending"
    # XFrameOptionsMiddleware and SecurityMiddleware write these on the way out
    assert response["X-Frame-Options"] == "DENY"
    assert response["X-Content-Type-Options"] == "nosniff"


class StatusLogMiddleware:
    """A response middleware of a shop's own, as one that logs or audits answers would be: it
    logs the status and the body's order id that Django's response cycle hands it."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        logging.getLogger("tests.answered").info(
            "%s %s %s %s", request.method, request.path, response.status_code, response.content
        )
        return response


@pytest.mark.parametrize("strategy", ["lua", "segmented"])
def test_a_response_middleware_logs_the_201_and_its_order(strategy, settings, caplog):
    start_sale(sku=f"mw-{strategy}", stock=3, strategy=strategy)
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, f"{__name__}.StatusLogMiddleware"]

    with caplog.at_level(logging.INFO, logger="tests.answered"):
        response = Client().post(
            "/api/checkout",
            {"sku": f"mw-{strategy}", "qty": 1, "buyer": "ann"},
            content_type="application/json",
        )

    assert response.status_code == 201
    order = response.json()["order"]
    (record,) = [r.getMessage() for r in caplog.records if r.name == "tests.answered"]
    assert record.startswith("POST /api/checkout 201 ") and order in record, record


@pytest.mark.parametrize("kind", ["granian", "sync"])
def test_a_real_server_logs_the_201_its_buyer_got(tmp_path, kind):
    # Given the shop under a real server that writes an access log (granian, as the shop runs,
    # and gunicorn)
    start_sale(sku=f"logged-{kind}", stock=3, strategy="lua")
    log = tmp_path / "server.log"
    server = ShopServer(
        env={
            **server_env(),
            "GRANIAN_LOG_ACCESS_ENABLED": "true",
            "GUNICORN_CMD_ARGS": "--access-logfile -",
        },
        workers=2,
        kind=kind,
        threads=4,
        log_path=log,
    ).start()
    try:
        # When a buyer checks out
        response = requests.post(
            f"{server.url}/api/checkout",
            json={"sku": f"logged-{kind}", "qty": 1, "buyer": "ann"},
            timeout=30,
        )
        # Then the buyer got a 201 that passed through the middleware
        assert response.status_code == 201, response.text
        assert response.headers["X-Frame-Options"] == "DENY"
        # and the server logged that very status for it
        assert wait_until(lambda: '"POST /api/checkout' in log.read_text(), timeout=10)
    finally:
        server.stop()
    (line,) = [line for line in log.read_text().splitlines() if "/api/checkout" in line]
    assert re.search(r'" 201\b', line), line
