"""`/metrics` of a real gunicorn with several workers: every worker's checkouts counted in one
scrape, by strategy and outcome, and read only with the token (or from this machine, where the
local targets open it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.db.models import Count
from django.test import Client
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from inventory import keys, sale_statement
from inventory.models import Item, Order, OrderStatus
from inventory.redis_client import get_redis_client
from inventory.sale_values import Allocation
from inventory.services import place_order, start_sale
from inventory.tasks import give_back_task
from shop.processes.ports import free_port
from shop.processes.servers import PROJECT_DIR as ROOT
from shop.processes.servers import ShopServer, stop_group
from tests.conftest import (
    TEST_API_TOKEN,
    answers_ok,
    server_env,
    start_shop,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

STOCK, CHECKOUTS = 30, 80


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _checkout(url: str, sku: str, buyer: str) -> requests.Response:
    body = {"sku": sku, "qty": 1, "buyer": buyer}
    return requests.post(f"{url}/api/checkout", json=body, timeout=30)


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return _samples(requests.get(f"{url}/metrics", timeout=10).text)


def test_one_scrape_counts_the_checkouts_of_every_worker_by_strategy_and_outcome():
    # Given a shop of 4 workers, open to this machine as under `make serve`
    sku = f"metered-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=STOCK, strategy="lock")
    server = start_shop(FLASHSALE_METRICS_LOOPBACK="true")
    try:
        # When a crowd checks out more than the stock, over new connections (so every worker
        # serves some), and asks for an item that does not exist
        def buy(number: int) -> int:
            return _checkout(server.url, sku, f"b{number}").status_code

        with ThreadPoolExecutor(max_workers=12) as pool:
            statuses = list(pool.map(buy, range(CHECKOUTS)))
        unknown = _checkout(server.url, "nothing-here", "x")
        scrape = requests.get(f"{server.url}/metrics", timeout=10)
        # (each worker that counted has a file of its own in the server's directory)
        assert server.metrics_dir is not None
        files = os.listdir(server.metrics_dir)
    finally:
        server.stop()

    # Then one scrape has them all: accepted == units sold, the rest sold out
    assert statuses.count(201) == STOCK and unknown.status_code == 404, statuses
    assert len([name for name in files if name.startswith("counter_")]) >= 2, files
    assert scrape.status_code == 200 and scrape.headers["Content-Type"].startswith("text/plain")
    samples = _samples(scrape.text)
    checkouts = "flashsale_checkouts_total"
    assert samples[(checkouts, (("outcome", "accepted"), ("strategy", "lock")))] == STOCK
    sold_out = samples[(checkouts, (("outcome", "sold_out"), ("strategy", "lock")))]
    assert sold_out == CHECKOUTS - STOCK
    assert samples[(checkouts, (("outcome", "unknown_sku"), ("strategy", "none")))] == 1
    latency = "flashsale_checkout_duration_seconds_count"
    assert samples[(latency, (("strategy", "lock"),))] == CHECKOUTS
    # and the database's figures: nothing oversold, the orders still pending (no worker here)
    assert samples[("flashsale_oversold_units", (("sku", sku),))] == 0
    assert samples[("flashsale_orders", (("sku", sku), ("status", "pending")))] == STOCK
    # and every lock granted was waited for and held once, the sold units' locks among them
    waits = samples[("flashsale_lock_wait_seconds_count", (("strategy", "lock"),))]
    holds = samples[("flashsale_lock_hold_seconds_count", (("strategy", "lock"),))]
    assert STOCK <= waits == holds <= CHECKOUTS
    timeouts = ("flashsale_lock_acquire_timeouts_total", (("strategy", "lock"),))
    assert samples.get(timeouts, 0) == 0


def test_every_checkout_is_counted_once_whichever_way_it_came(settings):
    # Given a shop whose metrics this process counts (the test client's requests)
    settings.FLASHSALE_API_TOKEN = "token-for-this-test"
    sku = f"counted-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=10, strategy="optimistic", limit=3)
    client = Client()

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        answer = client.get("/metrics", HTTP_AUTHORIZATION="Bearer token-for-this-test")
        return _samples(answer.content.decode())

    before = scrape()

    # When three orders are placed from the item page's form, one through the API, and the
    # form and the API each refuse one (no name; over the limit)
    page = f"/items/{sku}/"
    for buyer in ("ann", "bob", "cy"):
        form = client.get(page).content.decode()
        key = re.search(r'name="idempotency_key" value="([^"]*)"', form).group(1)
        answer = client.post(page, {"buyer": buyer, "qty": "1", "idempotency_key": key})
        assert answer.status_code == 302, answer.content[:300]
    assert 'data-error="invalid"' in client.post(page, {"buyer": "", "qty": "1"}).content.decode()
    body = {"sku": sku, "qty": 1, "buyer": "dee"}
    assert client.post("/api/checkout", body, "application/json").status_code == 201
    body = {"sku": sku, "qty": 4, "buyer": "eve"}
    assert client.post("/api/checkout", body, "application/json").status_code == 409
    after = scrape()

    # Then each was counted once, by the item's strategy and its outcome, and timed once
    def added(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    checkouts = "flashsale_checkouts_total"
    assert added(checkouts, strategy="optimistic", outcome="accepted") == 4
    assert added(checkouts, strategy="optimistic", outcome="limit_reached") == 1
    assert added(checkouts, strategy="none", outcome="invalid") == 1
    timed = "flashsale_checkout_duration_seconds_count"
    assert added(timed, strategy="optimistic") == 5 and added(timed, strategy="none") == 1
    assert Order.objects.filter(item__sku=sku).count() == 4


#: What an operator alerts on, each series exported before its first event: {family: label sets}.
ALERTING = {
    "flashsale_breaker_open": [{"breaker": "redis"}, {"breaker": "broker"}],
    "flashsale_fallback_checkouts_total": [
        {"strategy": name} for name in ("lock", "segmented", "lua")
    ],
    "flashsale_locks_lost_total": [
        {"strategy": name, "how": how}
        for name in ("lock", "segmented")
        for how in ("watchdog", "fenced")
    ],
    "flashsale_lock_renewals_total": [
        {"strategy": name, "outcome": outcome}
        for name in ("lock", "segmented")
        for outcome in ("renewed", "failed")
    ],
    "flashsale_reconciler_repairs_total": [{"store": "redis"}, {"store": "database"}],
}


def _zeros(samples: dict) -> list[tuple[str, dict[str, str]]]:
    """The alerting series missing from a scrape or not 0 in it."""
    return [
        (name, labels)
        for name, label_sets in ALERTING.items()
        for labels in label_sets
        if samples.get((name, tuple(sorted(labels.items())))) != 0
    ]


@pytest.mark.usefixtures("no_queued_orders")
@pytest.mark.parametrize("preload", [False, True], ids=["workers-load-the-app", "preloaded"])
def test_what_an_operator_alerts_on_is_exported_as_0_before_it_first_happens(preload):
    # Given a shop (its app loaded by each worker, or once before they fork, as load runs do)
    # and a Celery worker that have just started, nothing sold, nothing gone wrong
    port = free_port()
    worker = start_worker(FLASHSALE_WORKER_METRICS_PORT=port)
    server = ShopServer(
        env=server_env(FLASHSALE_METRICS_LOOPBACK="true"), workers=2, preload=preload
    ).start()
    try:
        # When each is scraped
        web = _scrape(server.url)
        worker_samples = _samples(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    finally:
        server.stop()
        worker.stop()

    # Then every series an operator alerts on is there, at 0, in both
    assert _zeros(web) == []
    assert _zeros(worker_samples) == []


def test_checkouts_served_by_the_fallback_and_the_open_breaker_are_counted():
    # Given a shop whose Redis is not there (nothing listens on its port)
    sku = f"fallback-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=10, strategy="lua")
    server = start_shop(
        REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", FLASHSALE_METRICS_LOOPBACK="true"
    )
    try:
        answers = [_checkout(server.url, sku, f"b{n}") for n in range(6)]
        samples = _scrape(server.url)
    finally:
        server.stop()
    # Then each sale went through the database fallback, and the breaker is open
    assert [answer.status_code for answer in answers] == [201] * 6
    assert all(answer.json()["fallback"] for answer in answers)
    assert samples[("flashsale_fallback_checkouts_total", (("strategy", "lua"),))] == 6
    accepted = ("flashsale_checkouts_total", (("outcome", "accepted"), ("strategy", "lua")))
    assert samples[accepted] == 6
    assert samples[("flashsale_breaker_open", (("breaker", "redis"),))] == 1


def test_lock_waits_that_time_out_and_a_lock_the_watchdog_loses_are_counted():
    # Given a shop whose lock checkouts work 1.5 s under a lock of 0.6 s that the watchdog
    # renews, and wait at most 0.2 s for it
    sku = f"contended-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=5, strategy="lock")
    lock_key = keys.item_lock(Item.objects.get(sku=sku))
    redis = get_redis_client()
    server = start_shop(
        FLASHSALE_METRICS_LOOPBACK="true",
        FLASHSALE_LOCK_TTL_MS=600,
        FLASHSALE_LOCK_WAIT_MS=200,
        FLASHSALE_HOLD_DELAY_MS=1500,
    )
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            holder = pool.submit(_checkout, server.url, sku, "holder")
            assert wait_until(lambda: redis.exists(lock_key), timeout=15)
            # When two more checkouts wait for the lock in vain
            waiters = [pool.submit(_checkout, server.url, sku, f"w{n}") for n in range(2)]
            waited = [waiter.result() for waiter in waiters]
            # and the holder's lock vanishes mid-work (as if it expired): its watchdog finds
            # it gone at the next renewal
            redis.delete(lock_key)
            held = holder.result()
        samples = _scrape(server.url)
    finally:
        server.stop()

    # Then all three were told busy, nothing was sold
    assert [answer.status_code for answer in waited] == [503, 503], [a.text for a in waited]
    assert held.status_code == 503 and held.json()["error"] == "busy", held.text
    assert Item.objects.get(sku=sku).stock == 5 and not Order.objects.filter(item__sku=sku)
    # and the scrape says why: two waits timed out, one lock was lost, found by the watchdog
    assert samples[("flashsale_lock_acquire_timeouts_total", (("strategy", "lock"),))] == 2
    lost = ("flashsale_locks_lost_total", (("how", "watchdog"), ("strategy", "lock")))
    assert samples[lost] == 1
    failed = ("flashsale_lock_renewals_total", (("outcome", "failed"), ("strategy", "lock")))
    assert samples[failed] == 1
    busy = ("flashsale_checkouts_total", (("outcome", "busy"), ("strategy", "lock")))
    assert samples[busy] == 3
    assert samples[("flashsale_lock_hold_seconds_count", (("strategy", "lock"),))] == 1


def test_a_write_refused_by_the_fencing_token_is_counted_as_a_lock_lost():
    # Given a shop whose lock checkouts work 1.2 s under a lock of 0.3 s that no watchdog renews
    sku = f"fenced-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=5, strategy="lock")
    lock_key = keys.item_lock(Item.objects.get(sku=sku))
    redis = get_redis_client()
    server = start_shop(
        FLASHSALE_METRICS_LOOPBACK="true",
        FLASHSALE_LOCK_TTL_MS=300,
        FLASHSALE_LOCK_WATCHDOG="false",
        FLASHSALE_HOLD_DELAY_MS=1200,
    )
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            stalled = pool.submit(_checkout, server.url, sku, "stalled")
            assert wait_until(lambda: redis.exists(lock_key), timeout=15)
            # When its lock expires under it, and a later buyer (this process, no work) takes
            # the lock and sells before the stalled holder writes
            assert wait_until(lambda: not redis.exists(lock_key), timeout=5)
            place_order(sku=sku, qty=1, buyer="later")
            answer = stalled.result()
        samples = _scrape(server.url)
    finally:
        server.stop()

    # Then the row refused the stalled holder's older token: busy, and one unit sold, the later's
    assert answer.status_code == 503 and answer.json()["error"] == "busy", answer.text
    assert list(Order.objects.filter(item__sku=sku).values_list("buyer", flat=True)) == ["later"]
    assert Item.objects.get(sku=sku).stock == 4
    lost = ("flashsale_locks_lost_total", (("how", "fenced"), ("strategy", "lock")))
    assert samples[lost] == 1
    assert (
        samples.get(("flashsale_locks_lost_total", (("how", "watchdog"), ("strategy", "lock"))), 0)
        == 0
    )
    accepted = ("flashsale_checkouts_total", (("outcome", "accepted"), ("strategy", "lock")))
    assert samples.get(accepted, 0) == 0


def test_a_checkout_whose_broker_is_away_is_answered_and_the_broker_breaker_shows_open():
    # Given a shop whose Celery broker is not there (nothing listens on its port)
    sku = f"unbrokered-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=5, strategy="lua")
    server = start_shop(
        CELERY_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0", FLASHSALE_METRICS_LOOPBACK="true"
    )
    try:
        answers = [_checkout(server.url, sku, f"b{n}") for n in range(3)]

        def broker_open() -> bool:
            samples = _scrape(server.url)
            return samples.get(("flashsale_breaker_open", (("breaker", "broker"),))) == 1

        # Then each checkout is sold (its order waits for the sweeper), and the breaker in
        # front of the broker shows open
        assert [answer.status_code for answer in answers] == [201] * 3
        assert wait_until(broker_open, timeout=30)
    finally:
        server.stop()
    assert Order.objects.filter(item__sku=sku, status=OrderStatus.PENDING).count() == 3


def test_the_metrics_need_the_token_unless_the_local_targets_open_them():
    server = start_shop()  # as deployed: FLASHSALE_METRICS_LOOPBACK off
    try:
        url = f"{server.url}/metrics"
        requests.post(f"{server.url}/api/checkout", json={"sku": "none", "qty": 1, "buyer": "x"})
        refused = requests.get(url, timeout=10)
        wrong = requests.get(url, headers={"Authorization": "Bearer not-it"}, timeout=10)
        allowed = requests.get(
            url, headers={"Authorization": f"Bearer {TEST_API_TOKEN}"}, timeout=10
        )
        posted = requests.post(
            url, headers={"Authorization": f"Bearer {TEST_API_TOKEN}"}, timeout=10
        )
    finally:
        server.stop()
    for answer in (refused, wrong):
        assert answer.status_code == 401 and answer.json()["error"] == "unauthorized"
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    assert allowed.status_code == 200 and "flashsale_checkouts" in allowed.text
    assert posted.status_code == 405 and posted.headers["Allow"] == "GET"


@pytest.mark.slow
def test_a_server_leaves_no_metrics_directory_behind():
    server = start_shop()
    directory = server.metrics_dir
    try:
        assert directory is not None and directory.is_dir()
    finally:
        server.stop()
    assert not directory.exists()


def test_gunicorn_makes_its_own_metrics_directory_when_none_is_given_and_removes_it(tmp_path):
    # Given gunicorn started with the shop's config and no PROMETHEUS_MULTIPROC_DIR
    env = {key: value for key, value in server_env().items() if key != "PROMETHEUS_MULTIPROC_DIR"}
    env["TMPDIR"] = str(tmp_path)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "shop.wsgi:application", "--config",
         "python:shop.gunicorn_conf", "--bind", f"127.0.0.1:{port}", "--workers", "2",
         "--graceful-timeout", "5"],
        cwd=ROOT, env={**os.environ, **env}, start_new_session=True,
    )  # fmt: skip
    try:
        assert wait_until(lambda: answers_ok(f"http://127.0.0.1:{port}/healthz"), timeout=30)
        # Then its workers count into a directory of its own, which it removes as it stops
        assert [path.name for path in tmp_path.iterdir()] == [f"flashsale-metrics-{process.pid}"]
    finally:
        stop_group(process, timeout=30)  # SIGTERM: a graceful stop, which runs on_exit
    assert list(tmp_path.iterdir()) == []


def test_units_oversold_show_per_item_on_sale(settings):
    # Given an item whose sale accepted three units of two (writes that trust what they read)
    settings.FLASHSALE_API_TOKEN = "token-for-this-test"
    start_sale(sku="oversold", stock=2, strategy="unsafe")
    start_sale(sku="fine", stock=2, strategy="lock")
    item = Item.objects.get(sku="oversold")
    for buyer in ("a", "b", "c"):
        sale_statement.sell(
            sale_statement.SaleRecorder(item=item, qty=1, buyer=buyer),
            Allocation("unsafe", set_stock=1),
        )

    # Then the scrape shows the damage on that item alone
    scrape = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer token-for-this-test")
    samples = _samples(scrape.content.decode())
    assert samples[("flashsale_oversold_units", (("sku", "oversold"),))] == 1
    assert samples[("flashsale_oversold_units", (("sku", "fine"),))] == 0
    assert samples[("flashsale_orders", (("sku", "oversold"), ("status", "pending")))] == 3


def test_every_metric_the_dashboard_queries_is_served_at_metrics(settings):
    settings.FLASHSALE_API_TOKEN = "token-for-this-test"
    scrape = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer token-for-this-test")
    served = {family.name for family in text_string_to_metric_families(scrape.content.decode())}
    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "flashsale.json").read_text()
    )
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b(flashsale_[a-z_]+)", target["expr"])
    }
    assert len(queried) >= 9
    # a counter's family is named without _total; a histogram's series add _bucket, _count, _sum
    families = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in queried}
    assert families <= served, families - served


def test_watchdog_renewals_of_a_lock_strategy_are_counted(settings):
    # Given a lock checkout whose work outlasts a third of its lock's TTL
    settings.FLASHSALE_LOCK_TTL_MS, settings.FLASHSALE_HOLD_DELAY_MS = 300, 600
    start_sale(sku="watched", stock=1, strategy="lock")
    renewed = {"strategy": "lock", "outcome": "renewed"}
    before = REGISTRY.get_sample_value("flashsale_lock_renewals_total", renewed) or 0

    place_order(sku="watched", qty=1, buyer="slow")

    # Then its watchdog renewed it, and the renewals are counted as lock's
    assert (REGISTRY.get_sample_value("flashsale_lock_renewals_total", renewed) or 0) > before


@pytest.mark.usefixtures("no_queued_orders")
def test_the_worker_counts_the_orders_it_settles_and_their_lag_on_its_own_port():
    # Given a worker serving its metrics, whose payments are declined about half the time (and
    # no message of an earlier test left for it: it would count those orders too)
    port = free_port()
    worker = start_worker(
        concurrency=2,
        FLASHSALE_PAYMENT_LATENCY_MS=5,
        FLASHSALE_PAYMENT_FAILURE_RATE=0.5,
        FLASHSALE_WORKER_METRICS_PORT=port,
    )
    try:
        # When six orders are placed (and handed to it, as every checkout's are)
        sku = f"settled-{uuid.uuid4().hex[:6]}"
        start_sale(sku=sku, stock=10, strategy="lua")
        for number in range(6):
            place_order(sku=sku, qty=1, buyer=f"b{number}")
        final = ("confirmed", "failed")
        assert wait_until(
            lambda: Order.objects.filter(item__sku=sku, status__in=final).count() == 6,
            timeout=60,
        )
        samples = _samples(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    finally:
        worker.stop()

    # Then its scrape counts each order settled once, by outcome, and each one's lag
    statuses = dict(
        Order.objects.filter(item__sku=sku).values_list("status").annotate(n=Count("pk"))
    )
    for outcome in final:
        settled = samples.get(("flashsale_orders_settled_total", (("outcome", outcome),)), 0)
        assert settled == statuses.get(outcome, 0), (outcome, statuses)
    assert samples[("flashsale_settle_lag_seconds_count", ())] == 6


@pytest.mark.usefixtures("no_queued_orders")
def test_the_worker_counts_the_retries_of_a_task_while_redis_is_away():
    # Given an order that failed, whose units Redis has yet to get back, and a worker whose
    # Redis is not there (its broker is)
    sku = f"retried-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=5, strategy="lua")
    order = place_order(sku=sku, qty=1, buyer="declined").order
    Order.objects.filter(pk=order.pk).update(status=OrderStatus.FAILED)
    port = free_port()
    worker = start_worker(
        REDIS_URL=f"redis://127.0.0.1:{free_port()}/0", FLASHSALE_WORKER_METRICS_PORT=port
    )
    retries = ("flashsale_task_retries_total", (("task", give_back_task.name),))

    def retried() -> float:
        try:
            text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except requests.RequestException:
            return 0
        return _samples(text).get(retries, 0)

    try:
        # When the give-back is handed to it
        give_back_task.delay([order.pk])
        # Then it retries (with growing waits), each retry counted
        assert wait_until(lambda: retried() >= 2, timeout=60), retried()
    finally:
        worker.stop()
