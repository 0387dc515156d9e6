"""The HTTP API and the management commands, as PRODUCT.md states them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from threading import Barrier

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.utils import timezone

from inventory.models import Item, Order
from inventory.selectors import database_now
from inventory.services import start_sale
from inventory.strategies import segmented
from tests.conftest import wait_until

pytestmark = [pytest.mark.django_db, pytest.mark.embedded_smoke]


def _checkout(client, **body):
    return client.post("/api/checkout", body, content_type="application/json")


@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic", "unsafe"])
def test_item_checkout_and_order_round_trip(client, settings, strategy):
    settings.FLASHSALE_ITEM_PAGE_MS = 0  # every look reads (test_item_page.py: the memory)
    start_sale(sku="widget", stock=5, strategy=strategy, price=12)

    item = client.get("/api/items/widget").json()
    assert item["sku"] == "widget" and item["stock"] == 5 and item["strategy"] == strategy
    assert item["price"] == "12.00" and item["initial_stock"] == 5

    response = _checkout(client, sku="widget", qty=2, buyer="ann")
    assert response.status_code == 201
    created = response.json()
    assert created["status"] == "pending" and created["qty"] == 2 and created["sku"] == "widget"
    assert response["Location"] == f"/api/orders/{created['order']}"

    order = client.get(f"/api/orders/{created['order']}").json()
    assert order["order"] == created["order"] and order["buyer"] == "ann"
    assert client.get("/api/items/widget").json()["stock"] == 3


def test_item_list_answers_for_several_items_at_once(client):
    start_sale(sku="a-one", stock=5, strategy="lua", price=3)
    start_sale(sku="b-two", stock=7, strategy="segmented", opens_in=600)
    assert _checkout(client, sku="a-one", qty=2, buyer="ann").status_code == 201

    # Every item on sale, each as its own endpoint has it, without the Redis figure
    listed = client.get("/api/items").json()
    singles = [client.get(f"/api/items/{sku}").json() for sku in ("a-one", "b-two")]
    assert listed == {
        "items": [{k: v for k, v in one.items() if k != "redis_stock"} for one in singles],
        "unknown": [],
    }
    assert [item["stock"] for item in listed["items"]] == [3, 7]

    # Or those named, in the order named, with the unknown ones said
    named = client.get("/api/items?sku=b-two&sku=nope&sku=a-one&sku=b-two").json()
    assert [item["sku"] for item in named["items"]] == ["b-two", "a-one"]
    assert named["unknown"] == ["nope"]


def test_sold_out_is_409(client):
    start_sale(sku="widget", stock=1, strategy="lua")
    assert _checkout(client, sku="widget", qty=1, buyer="ann").status_code == 201
    response = _checkout(client, sku="widget", qty=1, buyer="bob")
    assert response.status_code == 409 and response.json()["error"] == "sold_out"


def test_same_idempotency_key_returns_the_same_order(client):
    start_sale(sku="widget", stock=5, strategy="lua")
    first = _checkout(client, sku="widget", qty=1, buyer="ann", idempotency_key="k-1")
    again = _checkout(client, sku="widget", qty=1, buyer="ann", idempotency_key="k-1")
    assert first.status_code == again.status_code == 201
    assert first.json() == again.json()
    assert again["Idempotent-Replayed"] == "true"
    assert Order.objects.count() == 1
    assert Item.objects.get(sku="widget").units_left == 4

    reused = _checkout(client, sku="widget", qty=2, buyer="ann", idempotency_key="k-1")
    assert reused.status_code == 400 and reused.json()["error"] == "invalid"
    assert Item.objects.get(sku="widget").units_left == 4


@pytest.mark.parametrize(
    "autocommit",
    # as a server runs it, and inside a caller's transaction (a refused statement must not
    # leave that transaction unusable for the read of the earlier order)
    [pytest.param(True, marks=pytest.mark.django_db(transaction=True)), False],
    ids=["autocommit", "in-transaction"],
)
@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_a_retry_gets_its_order_back_after_the_sale_sold_out_and_the_limit_is_reached(
    client, strategy, autocommit
):
    assert connection.in_atomic_block is not autocommit
    start_sale(sku="widget", stock=2, strategy=strategy, limit=1)
    first = _checkout(client, sku="widget", qty=1, buyer="ann", idempotency_key="k-ann")
    assert first.status_code == 201
    # ann is at her limit: a new checkout of hers is refused, her retry is not
    refused = _checkout(client, sku="widget", qty=1, buyer="ann", idempotency_key="k-ann-2")
    assert refused.status_code == 409 and refused.json()["error"] == "limit_reached"
    again = _checkout(client, sku="widget", qty=1, buyer="ann", idempotency_key="k-ann")
    assert again.status_code == 201 and again.json() == first.json()
    assert again["Idempotent-Replayed"] == "true"

    # Sold out: a retry still gets its order; the key used for another checkout is refused
    assert _checkout(client, sku="widget", qty=1, buyer="bob").status_code == 201
    assert _checkout(client, sku="widget", qty=1, buyer="cy").json()["error"] == "sold_out"
    again = _checkout(client, sku="widget", qty=1, buyer="ann", idempotency_key="k-ann")
    assert again.status_code == 201 and again.json() == first.json()
    reused = _checkout(client, sku="widget", qty=1, buyer="cy", idempotency_key="k-ann")
    assert reused.status_code == 400 and reused.json()["error"] == "invalid"

    assert Order.objects.count() == 2
    audit = _audit("widget")
    assert audit["accepted_units"] == 2 and audit["oversold"] == 0 and audit["consistent"]
    assert audit["db_stock"] == 0 and audit["redis_stock"] in (0, None)


@pytest.mark.django_db(transaction=True)
def test_a_lua_checkout_costs_one_statement_and_a_sold_out_answer_none(client):
    from django.test.utils import CaptureQueriesContext

    start_sale(sku="widget", stock=4, strategy="lua")

    def queries(status: int = 201, **body) -> int:
        with CaptureQueriesContext(connection) as captured:
            assert _checkout(client, sku="widget", qty=1, **body).status_code == status
        return len(captured)

    # the first checkout reads the item; later ones use that read (the sale statement guards
    # the sale it was made for), with a key or without: only the sale statement
    assert queries(buyer="ann") == 2
    assert queries(buyer="bob", idempotency_key="k-bob") == queries(buyer="cy") == 1
    # a retry: the sale statement, which collides with the key, and the read of its order
    assert queries(buyer="bob", idempotency_key="k-bob") == 2
    assert queries(buyer="dee") == 1
    # sold out: Redis answers, the database is not asked at all
    assert queries(status=409, buyer="eve") == 0
    assert Order.objects.count() == 4 and Item.objects.get(sku="widget").units_left == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_concurrent_retries_with_one_key_make_one_order(strategy):
    start_sale(sku="widget", stock=50, strategy=strategy)

    def attempt(_):
        try:
            response = _checkout(Client(), sku="widget", qty=1, buyer="ann", idempotency_key="k")
            return response.status_code, response.content
        finally:
            connection.close()

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(attempt, range(12)))
    assert {status for status, _ in answers} == {201}
    assert len({body for _, body in answers}) == 1
    assert Order.objects.count() == 1
    assert Item.objects.get(sku="widget").units_left == 49
    call_command("sale", "audit", "widget", "--json")


#: Simultaneous retries of one checkout (one idempotency key) on its last unit.
TWINS = 50


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("strategy", "rounds"),
    [
        ("lua", 8),
        ("lock", 2),
        ("segmented", 4),
        ("optimistic", 2),
    ],
)
def test_concurrent_retries_of_one_key_on_the_last_unit_get_one_answer(strategy, rounds):
    # The last unit: a retry that finds the stock gone while its twin still writes the order
    # must wait for that order, not answer sold out (the twins of one process batched
    # together, as a threaded web process batches them).

    def attempt(sku: str, barrier: Barrier) -> tuple[int, bytes]:
        try:
            barrier.wait(10)
            response = _checkout(Client(), sku=sku, qty=1, buyer="ann", idempotency_key=sku)
            return response.status_code, response.content
        finally:
            connection.close()

    for round_ in range(rounds):
        sku = f"last-{round_}"
        start_sale(sku=sku, stock=1, strategy=strategy)
        barrier = Barrier(TWINS)
        with ThreadPoolExecutor(TWINS) as pool:
            answers = list(pool.map(attempt, [sku] * TWINS, [barrier] * TWINS))
        assert {status for status, _ in answers} == {201}, (round_, answers)
        assert len({body for _, body in answers}) == 1
        assert Order.objects.filter(item__sku=sku).count() == 1
        assert Item.objects.get(sku=sku).units_left == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("strategy", ["lock", "segmented", "lua", "optimistic"])
def test_one_buyer_never_passes_the_limit(strategy):
    start_sale(sku="widget", stock=50, strategy=strategy, limit=1)

    def attempt(number):
        try:
            return _checkout(Client(), sku="widget", qty=1, buyer="ann").json().get("error")
        finally:
            connection.close()

    with ThreadPoolExecutor(10) as pool:
        errors = list(pool.map(attempt, range(10)))
    assert errors.count(None) == 1
    assert errors.count("limit_reached") == 9
    assert Order.objects.count() == 1
    assert Item.objects.get(sku="widget").units_left == 49


@pytest.mark.parametrize("qty", [5, 7, 13])
def test_segmented_serves_more_than_one_shard_holds(client, qty):
    # 50 units over 10 shards: 5 per shard, so 7 and 13 need several shards
    start_sale(sku="widget", stock=50, strategy="segmented")
    sold = 0
    while True:
        response = _checkout(client, sku="widget", qty=qty, buyer=f"b{sold}")
        if response.status_code != 201:
            assert response.json()["error"] == "sold_out"
            break
        sold += qty
    assert sold == 50 - 50 % qty
    audit = _audit()
    assert audit["accepted_units"] == sold and audit["db_stock"] == 50 % qty
    assert audit["shard_stock"] == audit["redis_stock"] == 50 % qty
    assert audit["consistent"]


def _audit(sku="widget"):
    from io import StringIO

    out = StringIO()
    call_command("sale", "audit", sku, "--json", stdout=out)
    return json.loads(out.getvalue())


def test_sale_start_and_audit_commands(django_capture_on_commit_callbacks):
    from io import StringIO

    out = StringIO()
    with django_capture_on_commit_callbacks(execute=True):
        call_command("sale", "start", "widget", "--stock", "20", "--strategy", "lua", stdout=out)
    assert "20 units through lua" in out.getvalue()
    Client().post("/api/checkout", {"sku": "widget", "qty": 3, "buyer": "ann"}, "application/json")
    audit = _audit()
    assert {
        "sku",
        "strategy",
        "initial_stock",
        "accepted_units",
        "oversold",
        "remaining",
        "db_stock",
        "redis_stock",
        "orders_by_status",
    } <= set(audit)
    assert audit["initial_stock"] == 20 and audit["accepted_units"] == 3
    assert audit["remaining"] == 17 and audit["db_stock"] == audit["redis_stock"] == 17
    assert audit["orders_by_status"]["pending"] == 1

    # restarting opens a new sale with its own stock, strategy and Redis state; the earlier
    # sale's order stays, as history of that sale
    first_sale = Order.objects.get().sale_id
    with django_capture_on_commit_callbacks(execute=True):
        call_command("sale", "start", "widget", "--stock", "8", "--strategy", "segmented")
    audit = _audit()
    assert audit["strategy"] == "segmented" and audit["accepted_units"] == 0
    assert audit["db_stock"] == audit["redis_stock"] == audit["shard_stock"] == 8
    assert list(Order.objects.values_list("sale_id", flat=True)) == [first_sale]


def test_the_sale_commands_count_one_unit_as_one_unit(django_capture_on_commit_callbacks):
    from io import StringIO

    started, restocked = StringIO(), StringIO()
    with django_capture_on_commit_callbacks(execute=True):
        call_command(
            "sale",
            "start",
            "single",
            "--stock",
            "1",
            "--strategy",
            "lua",
            "--limit",
            "1",
            stdout=started,
        )
        call_command("sale", "restock", "single", "--add", "1", stdout=restocked)
    assert "started: 1 unit through lua, at most 1 per buyer" in started.getvalue()
    assert restocked.getvalue().endswith(": 1 unit added (1 at the start, 2 in all)\n")


def test_healthz_reports_database_and_redis(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {
        "database": "ok",
        "redis": "ok",
        "fallback_active": False,
        "ok": True,
    }


def test_healthz_reports_redis_down(client, settings):
    from shop.processes.ports import free_port

    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    state = client.get("/healthz").json()
    assert state["database"] == "ok" and state["redis"].startswith("down")
    assert state["fallback_active"] is True


@pytest.mark.parametrize("strategy", ["lua", "lock"])
def test_a_sale_opens_by_the_database_clock_whatever_the_hosts_clocks_say(
    client, monkeypatch, strategy
):
    # The host starting the sale runs an hour fast; the one serving checkouts an hour slow.
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(hours=1))
    before = database_now()
    start_sale(sku="widget", stock=5, strategy=strategy, opens_in=2)
    after = database_now()
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(hours=1))
    # (two seconds from the database's clock as the sale started)
    opens_at = Item.objects.get(sku="widget").current_sale.opens_at
    assert before + timedelta(seconds=2) <= opens_at <= after + timedelta(seconds=2)

    # Before the database's clock reaches the opening: refused; after: sold, on every host
    assert _checkout(client, sku="widget", qty=1, buyer="ann").json()["error"] == "not_started"
    assert wait_until(lambda: database_now() >= opens_at, timeout=10, interval=0.05)
    assert _checkout(client, sku="widget", qty=1, buyer="ann").status_code == 201
    # and the pages judge it by the same clock (and give it to the page's script)
    assert 'data-phase="on_sale"' in client.get("/items/widget/").content.decode()
    start_sale(sku="later", stock=5, strategy=strategy, opens_in=600)
    assert 'data-phase="not_started"' in client.get("/items/later/").content.decode()


def test_checkout_before_the_sale_opens_is_refused(client):
    start_sale(sku="widget", stock=5, strategy="lua", opens_in=3600)
    item = client.get("/api/items/widget").json()
    assert item["opens_at"] > item["sale_started_at"]
    response = _checkout(client, sku="widget", qty=1, buyer="ann")
    assert response.status_code == 409 and response.json()["error"] == "not_started"
    assert Order.objects.count() == 0 and Item.objects.get(sku="widget").units_left == 5


def test_the_audit_endpoint_is_for_staff_or_the_bearer_token(client, settings):
    from django.contrib.auth.models import User

    start_sale(sku="widget", stock=5, strategy="lua")
    url = "/api/items/widget/audit"
    settings.FLASHSALE_API_TOKEN = "s3cret-token"

    anonymous = client.get(url)
    assert anonymous.status_code == 401 and anonymous.json()["error"] == "unauthorized"
    assert anonymous["WWW-Authenticate"].startswith("Bearer")
    assert client.get(url, HTTP_AUTHORIZATION="Bearer wrong-token").status_code == 401
    assert client.get(url, HTTP_AUTHORIZATION="Basic s3cret-token").status_code == 401
    tokened = client.get(url, HTTP_AUTHORIZATION="Bearer s3cret-token")
    assert tokened.status_code == 200 and tokened.json()["initial_stock"] == 5

    buyer = User.objects.create_user("buyer", password="pw-for-tests-only")
    client.force_login(buyer)
    assert client.get(url).status_code == 401
    User.objects.create_user("boss", password="pw-for-tests-only", is_staff=True)
    client.login(username="boss", password="pw-for-tests-only")
    assert client.get(url).json()["sku"] == "widget"
    # with no token configured, a bearer header opens nothing
    settings.FLASHSALE_API_TOKEN = ""
    client.logout()
    assert client.get(url, HTTP_AUTHORIZATION="Bearer ").status_code == 401


def test_orders_are_named_by_unguessable_ids(client):
    start_sale(sku="widget", stock=5, strategy="lock")
    first, second = (
        _checkout(client, sku="widget", qty=1, buyer=buyer).json()["order"]
        for buyer in ("ann", "bob")
    )
    # UUIDs (122 random bits), unrelated to each other or to the row's number
    assert {len(first), len(second)} == {36} and first != second
    assert str(Order.objects.get(buyer="ann").public_id) == first
    assert client.get(f"/api/orders/{Order.objects.get(buyer='bob').pk}").status_code == 404
    assert client.get(f"/api/orders/{second}").json()["buyer"] == "bob"


def test_a_sale_started_without_a_strategy_takes_the_default(settings, capsys):
    settings.FLASHSALE_DEFAULT_STRATEGY = "segmented"
    call_command("sale", "start", "widget", "--stock", "20")
    assert "through segmented" in capsys.readouterr().out
    assert Item.objects.get(sku="widget").shard_count == segmented.SHARDS
    settings.FLASHSALE_DEFAULT_STRATEGY = "fastest"
    with pytest.raises(CommandError, match="unknown strategy 'fastest'"):
        call_command("sale", "start", "gadget", "--stock", "20")
    assert not Item.objects.filter(sku="gadget").exists()


def test_each_strategy_says_what_it_is_in_one_place():
    from inventory.strategies import oversells, safe_strategy_names, strategy_label

    assert safe_strategy_names() == ["lock", "segmented", "lua", "optimistic"]
    assert oversells("unsafe") and not oversells("lua") and not oversells("baseline")
    assert strategy_label("segmented").startswith(f"{segmented.SHARDS} shards")
