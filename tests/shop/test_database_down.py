"""The shop's database stops answering: the pages and the API's reads answer `503` with
`Retry-After` (JSON under /api/, a page elsewhere), never Django's `500`; `/healthz` says the
database is down; nothing is sold meanwhile. On a PostgreSQL of the test's own, stopped; and
one frozen (every process of it stopped), of which /healthz says so at once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
import requests

from shop.processes.servers import PROJECT_DIR, ShopServer
from tests.conftest import server_env, wait_until
from tests.support.postgres import PostgresServer

SKU = "down-lua"
#: The buy form's hidden fields, as the item page renders them.
FORM_FIELDS = r'name="(csrfmiddlewaretoken|idempotency_key)" value="([^"]+)"'


@dataclass
class DownShop:
    postgres: PostgresServer
    url: str
    #: A browser's session with the item page's form, read while the database answered.
    browser: requests.Session
    form: dict[str, str]


@pytest.fixture(scope="module")
def down_shop() -> Iterator[DownShop]:
    with PostgresServer() as postgres:
        env = server_env(DATABASE_URL=postgres.url, DJANGO_CONN_MAX_AGE="60")
        postgres.migrate(env)
        subprocess.run(
            [sys.executable, "manage.py", "sale", "start", SKU, "--stock=5", "--strategy=lua"],
            cwd=PROJECT_DIR,
            env={**os.environ, **env},
            check=True,
            capture_output=True,
            timeout=120,
        )
        server = ShopServer(env=env, workers=1, threads=2)
        server.start()
        try:
            browser = requests.Session()
            page = browser.get(f"{server.url}/items/{SKU}/", timeout=30)
            assert page.status_code == 200, page.text[:2000]
            form = dict(re.findall(FORM_FIELDS, page.text))
            assert set(form) == {"csrfmiddlewaretoken", "idempotency_key"}, page.text[:2000]
            postgres.stop()
            yield DownShop(postgres, server.url, browser, form)
        finally:
            server.stop()


def _orders_once_back(postgres: PostgresServer) -> int:
    """The orders in the database, once it is started again."""
    postgres.start()
    with psycopg.connect(postgres.url.replace("postgres://", "postgresql://")) as db:
        (count,) = db.execute("SELECT count(*) FROM inventory_order").fetchone()
    return count


def test_pages_and_reads_answer_503_with_retry_after_and_sell_nothing(down_shop):
    shop = down_shop
    pages = {
        "the item page": shop.browser.get(f"{shop.url}/items/{SKU}/", timeout=30),
        "the buy form": shop.browser.post(
            f"{shop.url}/items/{SKU}/",
            data={**shop.form, "buyer": "ann", "qty": "1"},
            headers={"Referer": f"{shop.url}/items/{SKU}/"},
            timeout=30,
        ),
        "an order's page": requests.get(f"{shop.url}/orders/{uuid.uuid4()}/", timeout=30),
    }
    for what, answer in pages.items():
        assert answer.status_code == 503, (what, answer.status_code, answer.text[:500])
        assert answer.headers["Retry-After"] == "1", what
        assert answer.headers["Content-Type"].startswith("text/html"), what
        assert "database is not answering" in answer.text, what

    api = {
        "an item": requests.get(f"{shop.url}/api/items/{SKU}", timeout=30),
        "an order": requests.get(f"{shop.url}/api/orders/{uuid.uuid4()}", timeout=30),
        "a checkout": requests.post(
            f"{shop.url}/api/checkout", json={"sku": SKU, "qty": 1, "buyer": "bob"}, timeout=30
        ),
    }
    for what, answer in api.items():
        assert answer.status_code == 503, (what, answer.status_code, answer.text[:500])
        assert answer.headers["Retry-After"] == "1", what
        assert answer.json()["error"] == "busy", what

    health = requests.get(f"{shop.url}/healthz", timeout=2)
    assert health.status_code == 503 and health.json()["database"].startswith("down"), health.text

    assert _orders_once_back(shop.postgres) == 0


def test_healthz_answers_503_at_once_while_the_database_is_frozen():
    # Given a shop whose database answered its item page and /healthz (the processes stay
    # connected), then stopped answering: every process of it stopped, connections kept open
    with PostgresServer() as postgres:
        env = server_env(DATABASE_URL=postgres.url, DJANGO_CONN_MAX_AGE="60")
        postgres.migrate(env)
        server = ShopServer(env=env, workers=1, threads=2)
        server.start()
        try:
            assert requests.get(f"{server.url}/healthz", timeout=30).status_code == 200
            assert requests.get(f"{server.url}/api/items/{SKU}", timeout=30).status_code == 404
            postgres.pause()

            # When /healthz is asked, twice (the first probe still waiting on the database)
            answers = [requests.get(f"{server.url}/healthz", timeout=30) for _ in range(2)]

            # Then each answers 503, the database down for not answering
            for answer in answers:
                assert answer.status_code == 503, answer.text
                assert answer.json()["database"] == "down: no answer in 1 s", answer.text

            # And once the database answers again, so does /healthz: 200
            postgres.resume()
            assert wait_until(
                lambda: requests.get(f"{server.url}/healthz", timeout=30).status_code == 200,
                timeout=60,
                interval=0.1,
            )
        finally:
            postgres.resume()
            server.stop()
