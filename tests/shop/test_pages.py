"""The storefront and the admin in a real headless Chromium against a real gunicorn.

Every test fails on a JavaScript console error or an uncaught exception in its pages, and saves
screenshots of the states it reaches under artifacts/screenshots/.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import requests
from django.contrib.auth.models import Permission, User
from django.test import Client
from playwright.sync_api import Browser, Page, expect, sync_playwright

from inventory import models
from inventory.models import Order, OrderStatus
from inventory.services import place_order, start_sale
from loadtest.models import SaleRun
from shop.processes.redis_server import RedisServer
from tests.browser import CHROMIUM, CHROMIUM_ARGS, ConsoleWatch, chromium_missing_reason, screenshot
from tests.conftest import start_shop, start_worker

_missing = chromium_missing_reason()
if _missing and os.environ.get("CI"):
    pytest.fail(f"browser tests cannot run in CI: {_missing}", pytrace=False)
if _missing:
    pytest.skip(_missing, allow_module_level=True)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

#: How long a page may take to show what the server already knows (it polls every second).
LIVE = 8_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Playwright's sync API keeps an asyncio loop running in this thread, which Django takes for
    # an async context and refuses ORM calls in; the tests' ORM calls are plain sync code.
    allow_before = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield browser
            browser.close()
    finally:
        if allow_before is None:
            del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = allow_before


@pytest.fixture
def console() -> ConsoleWatch:
    return ConsoleWatch()


@pytest.fixture
def page(browser: Browser, console: ConsoleWatch) -> Iterator[Page]:
    """A fresh browser context (no cookies); any console error in it fails the test."""
    # Reduced motion: no stock-meter animation half-way through a screenshot.
    context = browser.new_context(viewport={"width": 1000, "height": 760}, reduced_motion="reduce")
    context.set_default_timeout(10_000)
    console.attach(context)
    yield context.new_page()
    context.close()
    assert console.errors == [], "\n".join(console.errors)


def _sku(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _mark_page(page: Page) -> None:
    """Leave a mark in this document: it is gone if the page reloads."""
    page.evaluate("window.__sameDocument = true")


def _not_reloaded(page: Page) -> bool:
    return page.evaluate("window.__sameDocument === true")


#: An order page's address: /orders/<the order's public id, a UUID>/
ORDER_URL = re.compile(r"/orders/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/$")


def _order_id(page: Page) -> str:
    match = ORDER_URL.search(page.url)
    assert match, page.url
    return match.group(1)


def test_buy_from_the_item_page_and_see_the_order_confirmed_live(shop_server, page):
    # Given a sale on the list
    sku = _sku("phone")
    start_sale(sku=sku, stock=5, strategy="lua", name="Phone X", price=199)
    page.goto(f"{shop_server.url}/")
    card = page.locator("[data-item]", has_text="Phone X")
    expect(card.locator("[data-stock-text]")).to_have_text("5 left")
    expect(card.locator("[data-state-badge]")).to_have_text("On sale")
    screenshot(page, "01-item-list")

    # When a buyer opens the item and buys 2
    card.get_by_role("link", name="Phone X").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Phone X")
    screenshot(page, "02-item-on-sale")
    page.get_by_label("Your name").fill("ann")
    page.get_by_label("Quantity").fill("2")
    page.get_by_role("button", name="Buy now").click()

    # Then the order page shows it pending
    page.wait_for_url(ORDER_URL)
    order = Order.objects.get(public_id=_order_id(page))
    assert (order.buyer, order.qty, order.item.sku) == ("ann", 2, sku)
    expect(page.locator("[data-order-status]")).to_have_text("pending")
    screenshot(page, "03-order-pending")
    _mark_page(page)

    # and once a worker runs, confirmed, without a reload
    worker = start_worker(concurrency=1, FLASHSALE_PAYMENT_LATENCY_MS=5)
    try:
        expect(page.locator("[data-order-status]")).to_have_text("confirmed", timeout=30_000)
    finally:
        worker.stop()
    expect(page.locator("[data-step=confirmed]")).to_have_class(re.compile(r"\bdone\b"))
    expect(page.locator("[data-order-polling]")).to_be_hidden()
    assert _not_reloaded(page)
    screenshot(page, "04-order-confirmed")

    # and the item page remembers the buyer's name for the next form
    page.goto(f"{shop_server.url}/items/{sku}/")
    expect(page.get_by_label("Your name")).to_have_value("ann")
    expect(page.locator("[data-stock-text]")).to_have_text("3 left")


def test_sold_out_shows_without_a_reload_when_another_buyer_takes_the_last_unit(shop_server, page):
    # Given an item page showing the last unit
    sku = _sku("last")
    start_sale(sku=sku, stock=1, strategy="segmented", name="Last One")
    page.goto(f"{shop_server.url}/items/{sku}/")
    expect(page.locator("[data-stock-text]")).to_have_text("1 left")
    expect(page.get_by_role("button", name="Buy now")).to_be_enabled()
    _mark_page(page)

    # When another buyer takes it through the API
    answer = requests.post(
        f"{shop_server.url}/api/checkout", json={"sku": sku, "qty": 1, "buyer": "bob"}, timeout=10
    )
    assert answer.status_code == 201, answer.text

    # Then the page shows it sold out and refuses to buy, with no reload
    expect(page.locator("[data-state-badge]")).to_have_text("Sold out", timeout=LIVE)
    expect(page.locator("[data-stock-text]")).to_have_text("none left")
    expect(page.get_by_role("button", name="Buy now")).to_be_disabled()
    expect(page.locator("[data-stock-meter]")).to_have_attribute("style", re.compile("width: 0"))
    assert _not_reloaded(page)
    screenshot(page, "05-item-sold-out")

    # and so does the list
    page.goto(f"{shop_server.url}/")
    card = page.locator("[data-item]", has_text="Last One")
    expect(card.locator("[data-state-badge]")).to_have_text("Sold out")
    screenshot(page, "06-item-list-sold-out")


def test_a_double_click_or_a_resent_form_makes_one_order(shop_server, page):
    # Given a rendered buy form
    sku = _sku("double")
    start_sale(sku=sku, stock=5, strategy="lock")
    page.goto(f"{shop_server.url}/items/{sku}/")
    page.get_by_label("Your name").fill("cat")

    # When the very same form is posted twice at once (as a browser retry would)
    landed = page.evaluate(
        """async () => {
            const form = document.querySelector("[data-buy-form]");
            const send = () => fetch(location.href, {method: "POST", body: new FormData(form)});
            const answers = await Promise.all([send(), send()]);
            return answers.map((answer) => [answer.status, answer.url]);
        }"""
    )
    # and then its button is double-clicked
    page.get_by_role("button", name="Buy now").dblclick()
    page.wait_for_url(ORDER_URL)

    # Then there is one order, and everyone landed on it
    order = Order.objects.get(item__sku=sku)
    assert order.qty == 1 and order.buyer == "cat"
    assert landed == [[200, f"{shop_server.url}/orders/{order.public_id}/"]] * 2
    assert _order_id(page) == str(order.public_id)


def test_the_button_is_disabled_on_submit(shop_server, page):
    # Given a filled buy form whose submission this test keeps from leaving the page
    sku = _sku("submit")
    start_sale(sku=sku, stock=5, strategy="lua")
    page.goto(f"{shop_server.url}/items/{sku}/")
    page.get_by_label("Your name").fill("dan")
    page.evaluate(
        """() => document.querySelector("[data-buy-form]")
            .addEventListener("submit", (event) => event.preventDefault())"""
    )

    # When it is submitted
    button = page.get_by_role("button", name="Buy now")
    button.click()

    # Then the button is disabled at once and says what is happening
    button = page.locator("[data-buy-button]")
    expect(button).to_be_disabled()
    expect(button).to_have_text("Placing your order…")
    expect(page.locator("[data-buy-form]")).to_have_attribute("aria-busy", "true")
    screenshot(page, "07-item-submitting")
    # and stays so while the stock polls go on
    page.wait_for_timeout(1_500)
    expect(button).to_be_disabled()


def test_a_sale_opening_later_counts_down_then_opens(shop_server, page):
    # Given a sale that opens in 3 seconds
    sku = _sku("soon")
    start_sale(sku=sku, stock=3, strategy="lua", name="Soon", opens_in=3)
    page.goto(f"{shop_server.url}/items/{sku}/")

    # Then the page counts down, and the buy button waits
    clock = page.locator("[data-countdown-clock]")
    expect(page.locator("[data-state-badge]")).to_have_text("Opens soon")
    expect(clock).to_have_text(re.compile(r"^0:0[1-3]$"))
    expect(page.get_by_role("button", name="Buy now")).to_be_disabled()
    screenshot(page, "08-item-countdown")

    # When the time comes, it opens by itself
    expect(page.locator("[data-state-badge]")).to_have_text("On sale", timeout=LIVE)
    expect(page.locator("[data-countdown]")).to_be_hidden()
    page.get_by_label("Your name").fill("eve")
    page.get_by_role("button", name="Buy now").click()
    page.wait_for_url(ORDER_URL)
    assert Order.objects.filter(item__sku=sku).count() == 1


def test_the_list_follows_every_card_with_one_request_per_poll(shop_server, page):
    # Given two items on the list, and a page that notes every API request it makes
    first, second = _sku("pair-a"), _sku("pair-b")
    start_sale(sku=first, stock=4, strategy="lua", name="Pair A")
    start_sale(sku=second, stock=6, strategy="segmented", name="Pair B")
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))
    page.goto(f"{shop_server.url}/")
    _mark_page(page)

    # When both sell units
    place_order(sku=first, qty=3, buyer="ann")
    place_order(sku=second, qty=6, buyer="bob")

    # Then both cards show it without a reload
    card_a = page.locator("[data-item]", has_text="Pair A")
    card_b = page.locator("[data-item]", has_text="Pair B")
    expect(card_a.locator("[data-stock-text]")).to_have_text("1 left", timeout=LIVE)
    expect(card_b.locator("[data-state-badge]")).to_have_text("Sold out", timeout=LIVE)
    assert _not_reloaded(page)
    # from the one list endpoint, never one request per item
    api = [url.removeprefix(shop_server.url) for url in asked if "/api/items" in url]
    assert api and set(api) == {"/api/items"}, api


def test_the_list_counts_down_too(shop_server, page):
    sku = _sku("later")
    start_sale(sku=sku, stock=3, strategy="optimistic", name="Later", opens_in=600)
    page.goto(f"{shop_server.url}/")
    card = page.locator("[data-item]", has_text="Later")
    expect(card.locator("[data-state-badge]")).to_have_text("Opens soon")
    expect(card.locator("[data-countdown-clock]")).to_have_text(re.compile(r"^(10:00|9:[0-5]\d)$"))


def test_a_buyer_at_the_limit_sees_it_and_cannot_buy(shop_server, page):
    # Given a buyer who took the one unit allowed
    sku = _sku("limit")
    start_sale(sku=sku, stock=5, strategy="lua", limit=1)
    page.goto(f"{shop_server.url}/items/{sku}/")
    page.get_by_label("Your name").fill("fay")
    page.get_by_role("button", name="Buy now").click()
    page.wait_for_url(ORDER_URL)

    # When they come back to the item
    page.goto(f"{shop_server.url}/items/{sku}/")

    # Then the page says the limit is reached and the button waits
    expect(page.locator("[data-state-badge]")).to_have_text("Limit reached")
    expect(page.locator("[data-sale-message]")).to_contain_text("Limit reached")
    expect(page.get_by_role("button", name="Buy now")).to_be_disabled()
    screenshot(page, "09-item-limit-reached")

    # and another buyer's name may buy again
    page.get_by_label("Your name").fill("gus")
    expect(page.get_by_role("button", name="Buy now")).to_be_enabled()
    expect(page.locator("[data-sale-message]")).to_be_hidden()


def test_two_orders_placed_in_the_same_millisecond_have_different_names(
    shop_server, page, monkeypatch
):
    # Given two orders placed within one millisecond (the clock their ids are made by, stopped)
    sku = _sku("twins")
    start_sale(sku=sku, stock=5, strategy="lua", name="Twins")
    stopped = time.time_ns()
    monkeypatch.setattr(models, "time", SimpleNamespace(time_ns=lambda: stopped))
    first, second = (place_order(sku=sku, qty=1, buyer=buyer).order for buyer in ("ann", "bob"))
    assert first.public_id.int >> 80 == second.public_id.int >> 80

    # When each order's page is shown
    names = []
    for order in (first, second):
        page.goto(f"{shop_server.url}/orders/{order.public_id}/")
        heading = page.get_by_role("heading", level=1)
        expect(heading).to_have_text(re.compile(r"^Order "))
        names.append(heading.inner_text())

    # Then they are named apart, each by its id's random tail, in the tab's title too
    assert names[0] != names[1], names
    assert names == [f"Order {str(order.public_id)[-12:]}" for order in (first, second)]
    expect(page).to_have_title(f"{names[1]} · flashsale")


def test_asking_for_more_than_the_limit_says_so_and_the_form_stays_usable(shop_server, page):
    # Given an item of at most 2 per buyer, and a new buyer who holds none
    sku = _sku("two")
    start_sale(sku=sku, stock=5, strategy="lua", limit=2)
    page.goto(f"{shop_server.url}/items/{sku}/")

    # When they ask for 3
    page.get_by_label("Your name").fill("jo")
    page.get_by_label("Quantity").fill("3")
    page.get_by_role("button", name="Buy now").click()

    # Then the page says how many one buyer may have, not that their limit is reached
    notice = page.get_by_role("alert")
    expect(notice).to_have_text("At most 2 per buyer. You asked for 3.")
    expect(page.locator("[data-state-badge]")).to_have_text("On sale")
    expect(page.locator("[data-sale-message]")).to_be_hidden()
    screenshot(page, "13-item-over-the-limit")
    # and the form is usable: the quantity brought within the limit, the button enabled
    expect(page.get_by_label("Quantity")).to_have_value("2")
    page.get_by_label("Quantity").fill("1")
    button = page.get_by_role("button", name="Buy now")
    expect(button).to_be_enabled()
    button.click()
    page.wait_for_url(ORDER_URL)
    order = Order.objects.get(item__sku=sku)
    assert (order.buyer, order.qty) == ("jo", 1)


def test_a_form_without_a_name_says_so_in_a_sentence_and_leaves_the_name_empty(shop_server, page):
    # Given a buyer the shop remembers by name
    sku = _sku("named")
    start_sale(sku=sku, stock=5, strategy="optimistic")
    page.goto(f"{shop_server.url}/items/{sku}/")
    page.get_by_label("Your name").fill("kim")
    page.get_by_role("button", name="Buy now").click()
    page.wait_for_url(ORDER_URL)

    # When they come back, clear the name and press Buy
    page.goto(f"{shop_server.url}/items/{sku}/")
    expect(page.get_by_label("Your name")).to_have_value("kim")
    page.get_by_label("Your name").fill("")
    page.get_by_role("button", name="Buy now").click()

    # Then the page asks for a name in a proper sentence, with the field left as they sent it
    expect(page.get_by_role("alert")).to_have_text(
        "Please check the form. Enter your name (at most 64 characters)."
    )
    name = page.get_by_label("Your name")
    expect(name).to_have_value("")
    expect(name).to_have_attribute("aria-invalid", "true")
    screenshot(page, "14-item-name-missing")
    assert Order.objects.filter(item__sku=sku).count() == 1


def test_an_item_sold_out_offers_no_quantity(shop_server, page):
    # Given an item of one per buyer, its last unit on the page
    sku = _sku("lastone")
    start_sale(sku=sku, stock=1, strategy="lua", limit=1)
    page.goto(f"{shop_server.url}/items/{sku}/")
    quantity, hint = page.get_by_label("Quantity"), page.locator("#qty-hint")
    expect(quantity).to_be_enabled()
    expect(hint).to_have_text("At most 1.")
    _mark_page(page)

    # When another buyer takes it
    answer = requests.post(
        f"{shop_server.url}/api/checkout", json={"sku": sku, "qty": 1, "buyer": "lee"}, timeout=10
    )
    assert answer.status_code == 201, answer.text

    # Then the page offers no quantity to buy, live and once reloaded
    expect(page.locator("[data-state-badge]")).to_have_text("Sold out", timeout=LIVE)
    expect(quantity).to_be_disabled()
    expect(hint).to_be_hidden()
    assert _not_reloaded(page)
    page.reload()
    expect(page.locator("[data-state-badge]")).to_have_text("Sold out")
    expect(quantity).to_be_disabled()
    expect(hint).to_be_hidden()
    expect(page.get_by_text("From 1 to")).to_have_count(0)
    screenshot(page, "15-item-sold-out-no-quantity")


def test_the_fallback_banner_shows_while_redis_is_down(page):
    # Given a shop on a Redis of its own
    with RedisServer() as private_redis:
        server = start_shop(REDIS_URL=private_redis.url, FLASHSALE_BREAKER_PROBE_SECONDS=0.5)
        try:
            sku = _sku("fallback")
            start_sale(sku=sku, stock=4, strategy="lua", name="Fallback")
            page.goto(f"{server.url}/items/{sku}/")
            expect(page.locator("[data-stock-text]")).to_have_text("4 left")
            expect(page.locator("[data-health-banner]")).to_be_hidden()

            # When that Redis dies
            private_redis.kill()

            # Then a banner says the database is serving checkout, and buying still works
            banner = page.locator("[data-health-banner]")
            expect(banner).to_be_visible(timeout=LIVE)
            expect(banner).to_contain_text("Fallback active")
            expect(banner).to_contain_text("database is serving checkout")
            screenshot(page, "10-item-fallback-active")
            page.get_by_label("Your name").fill("hal")
            page.get_by_role("button", name="Buy now").click()
            page.wait_for_url(ORDER_URL)
            assert Order.objects.get(item__sku=sku).fallback
            expect(page.get_by_text("database fallback")).to_be_visible()
            screenshot(page, "11-order-fallback")

            page.close()  # before the server stops: its polls would fail
        finally:
            server.stop()


def test_the_buy_form_works_with_the_keyboard_alone(shop_server, page):
    # Given an item page
    sku = _sku("keys")
    start_sale(sku=sku, stock=5, strategy="optimistic", name="Keyboard")
    page.goto(f"{shop_server.url}/items/{sku}/")

    # When the buyer tabs to the name, types it, tabs to the quantity, raises it to 2, tabs to
    # the button and presses Enter
    for _ in range(20):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "buyer":
            break
    expect(page.get_by_label("Your name")).to_be_focused()
    page.keyboard.type("ida")
    page.keyboard.press("Tab")
    expect(page.get_by_label("Quantity")).to_be_focused()
    page.keyboard.press("ArrowUp")
    page.keyboard.press("Tab")
    button = page.get_by_role("button", name="Buy now")
    expect(button).to_be_focused()
    # Then the focused button is visibly marked
    outline = button.evaluate("(element) => getComputedStyle(element).outlineStyle")
    assert outline == "solid"
    screenshot(page, "12-item-keyboard-focus")
    page.keyboard.press("Enter")

    # and the order is placed
    page.wait_for_url(ORDER_URL)
    order = Order.objects.get(item__sku=sku)
    assert (order.buyer, order.qty) == ("ida", 2)


def _user(username: str, *, staff: bool) -> User:
    user = User.objects.create_user(username, password="a-long-test-password", is_staff=staff)
    if staff:
        user.user_permissions.set(
            Permission.objects.filter(
                content_type__app_label__in=["inventory", "loadtest"], codename__startswith="view_"
            )
        )
    return user


def _staff_signs_in(shop_server, page: Page, viewport: dict[str, int]) -> None:
    """A new staff user signs in to the admin, on a page of the given size."""
    _user("staff", staff=True)
    page.set_viewport_size(viewport)
    page.goto(f"{shop_server.url}/admin/")
    page.get_by_label("Username").fill("staff")
    page.get_by_label("Password").fill("a-long-test-password")
    page.get_by_role("button", name="Log in").click()


def test_the_admin_refuses_a_non_staff_user(shop_server, page):
    # Given a signed-in buyer who is not staff
    buyer = _user("buyer", staff=False)
    client = Client()
    client.force_login(buyer)
    page.context.add_cookies(
        [{"name": "sessionid", "value": client.cookies["sessionid"].value, "url": shop_server.url}]
    )

    # When they open the admin's orders, they are sent to the login page
    page.goto(f"{shop_server.url}/admin/inventory/order/")
    assert page.url.startswith(f"{shop_server.url}/admin/login/")
    expect(page.locator("body")).to_contain_text("not authorized to access this page")
    screenshot(page, "13-admin-refused")
    # and so for the pitfall lab
    page.goto(f"{shop_server.url}/admin/pitfalls/")
    assert page.url.startswith(f"{shop_server.url}/admin/login/")

    # and their password does not sign them in to it either
    page.context.clear_cookies()
    page.goto(f"{shop_server.url}/admin/")
    page.get_by_label("Username").fill("buyer")
    page.get_by_label("Password").fill("a-long-test-password")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator(".errornote")).to_contain_text("staff account")


def test_staff_see_the_item_order_and_sale_run_lists(shop_server, page):
    # Given a sale with an order, a recorded load run, and a staff user
    sku = _sku("admin")
    start_sale(sku=sku, stock=10, strategy="segmented", name="Admin Item")
    answer = requests.post(
        f"{shop_server.url}/api/checkout", json={"sku": sku, "qty": 2, "buyer": "jo"}, timeout=10
    )
    assert answer.status_code == 201
    SaleRun.objects.create(
        batch="b-1",
        strategy="lua",
        sku=sku,
        status=SaleRun.Status.DONE,
        requests=1000,
        requests_per_second=381.25,
        goodput=200.0,
        p99_ms=41.5,
        oversold=0,
        remaining=0,
    )
    _user("staff", staff=True)
    page.set_viewport_size({"width": 1400, "height": 900})

    # When they sign in
    page.goto(f"{shop_server.url}/admin/")
    page.get_by_label("Username").fill("staff")
    page.get_by_label("Password").fill("a-long-test-password")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#site-name")).to_be_visible()

    # Then they see the items with their strategy and stock, and the shards read-only
    page.goto(f"{shop_server.url}/admin/inventory/item/")
    row = page.locator("#result_list tbody tr", has_text=sku)
    expect(row.locator(".field-strategy_name")).to_have_text("segmented")
    expect(row.locator(".field-units_left")).to_have_text("8")  # derived from its shards
    screenshot(page, "14-admin-items")
    row.get_by_role("link", name=sku).click()
    expect(page.locator(".inline-group")).to_contain_text("Stock shards")
    expect(page.locator(".inline-group input:not([type=hidden])")).to_have_count(0)

    # and the orders, filterable by status, served strategy and fallback
    page.goto(f"{shop_server.url}/admin/inventory/order/")
    filters = page.locator("#changelist-filter")
    for title in ("status", "served by", "fallback"):
        expect(filters).to_contain_text(f"By {title}")
    expect(page.locator("#result_list")).to_contain_text("jo")
    screenshot(page, "15-admin-orders")
    page.goto(f"{shop_server.url}/admin/inventory/order/?status__exact={OrderStatus.CONFIRMED}")
    expect(page.locator("#result_list")).to_have_count(0)

    # and the sale runs
    page.goto(f"{shop_server.url}/admin/loadtest/salerun/")
    run = page.locator("#result_list tbody tr").first
    for text in ("lua", "b-1", "Done", "381.2", "200.0", "41.5"):
        expect(run).to_contain_text(text)
    screenshot(page, "16-admin-sale-runs")


def test_staff_compare_two_recorded_runs_side_by_side(shop_server, page):
    # Given a batch of recorded runs and a staff user
    common = {"batch": "b-cmp", "status": SaleRun.Status.DONE, "parameters": {
        "stock": 50, "users": 10, "duration": 5, "strategies": ["lua", "lock"]}}  # fmt: skip
    history = [{"t": t, "users": 10, "requests_per_second": 90.0, "p95_ms": 20.0,
                "units_sold": units} for t, units in enumerate([0, 30, 50])]  # fmt: skip
    SaleRun.objects.create(strategy="baseline", requests_per_second=900, p99_ms=9, **common)
    for strategy, rps in (("lua", 300.0), ("lock", 150.0)):
        SaleRun.objects.create(
            strategy=strategy, requests_per_second=rps, baseline_requests_per_second=900,
            p99_ms=40, goodput=25, accepted_units=50, oversold=0, remaining=0,
            history=history, **common,
        )  # fmt: skip
    _staff_signs_in(shop_server, page, {"width": 1400, "height": 1000})

    # When they follow the admin's link to the comparison
    page.get_by_role("link", name="Compare strategies").click()

    # Then the runs stand side by side in the table, with their charts
    rows = page.locator("#runs tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.nth(1)).to_contain_text("0.33")
    expect(page.locator("svg[role=img]")).to_have_count(6)
    expect(page.get_by_role("img", name="Units sold over time (s)")).to_be_visible()
    expect(page.get_by_role("img", name="Orders pending, from the opening (s)")).to_be_visible()
    screenshot(page, "17-admin-compare")

    # and on a narrower screen the table scrolls inside the page; the page itself does not
    page.set_viewport_size({"width": 1000, "height": 800})
    widths = page.evaluate(
        "() => ({page: document.documentElement.scrollWidth,"
        " view: document.documentElement.clientWidth,"
        " box: document.querySelector('.table-scroll').clientWidth,"
        " table: document.querySelector('#runs').scrollWidth})"
    )
    assert widths["page"] <= widths["view"], widths
    assert widths["table"] > widths["box"], widths  # the table is the one that scrolls
    screenshot(page, "18-admin-compare-narrow")


@pytest.mark.slow
def test_staff_run_a_pitfall_scenario_and_see_the_double_grant_drawn(shop_server, page):
    # Given a staff user and a Celery worker
    worker = start_worker(concurrency=1)
    try:
        _staff_signs_in(shop_server, page, {"width": 1300, "height": 900})

        # When they open the lab from the admin's home and run expiry-mid-work
        page.get_by_role("link", name="Pitfall lab").click()
        expect(page.locator("#scenarios")).to_contain_text("stall-past-ttl")
        page.get_by_role("button", name="Run expiry-mid-work").click()
        expect(page.locator("#run")).to_contain_text("expiry-mid-work")

        # Then, once the worker ran it (the page refreshes itself), they see the verdict, and
        # the naive run's timeline: a lane per client, the double grant highlighted
        expect(page.locator("#verdict")).to_have_text("pass", timeout=60_000)
        naive = page.locator("#variant-naive")
        expect(naive.locator("svg.timeline g.lane")).to_have_count(2)  # A and B
        expect(naive.locator("rect.overlap").first).to_be_visible()
        expect(naive.locator("dd.damage")).to_have_text("1")
        fixed = page.locator("#variant-fixed")
        expect(fixed.locator("rect.overlap")).to_have_count(0)
        expect(fixed.locator("dd.damage")).to_have_text("0")
        screenshot(page, "20-admin-pitfall-lab")
    finally:
        worker.stop()
