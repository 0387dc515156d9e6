"""The admin's pages read as a reader wants them, in a real headless Chromium: each app once on
the home page with its pages beside its models, no word broken; the lab's sentences with their
code set as code and its figures under names a reader reads; every chart's labels inside it.

Screenshots of what each test reaches go under artifacts/screenshots/.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Browser, Page, expect, sync_playwright

from loadtest.models import SaleRun
from pitfalls import lab
from pitfalls.models import PitfallRun
from tests.browser import CHROMIUM, CHROMIUM_ARGS, ConsoleWatch, chromium_missing_reason, screenshot

_missing = chromium_missing_reason()
if _missing and os.environ.get("CI"):
    pytest.fail(f"browser tests cannot run in CI: {_missing}", pytrace=False)
if _missing:
    pytest.skip(_missing, allow_module_level=True)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


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
def page(browser: Browser) -> Iterator[Page]:
    """A fresh context, signed in as the login `make admin` makes; a console error fails."""
    console = ConsoleWatch()
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    context.set_default_timeout(10_000)
    console.attach(context)
    yield context.new_page()
    context.close()
    assert console.errors == [], "\n".join(console.errors)


def _sign_in(page: Page, url: str) -> None:
    User.objects.create_superuser("admin", "", "a-long-test-password")
    page.goto(f"{url}/admin/")
    page.get_by_label("Username").fill("admin")
    page.get_by_label("Password").fill("a-long-test-password")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#site-name")).to_be_visible()


#: Per word of an element's text, on how many lines it is drawn (a word broken mid-word: 2).
LINES_PER_WORD = """(element) => {
  const text = element.firstChild;
  const lines = [];
  let start = 0;
  for (const word of text.textContent.trim().split(/\\s+/)) {
    start = text.textContent.indexOf(word, start);
    const range = document.createRange();
    range.setStart(text, start);
    range.setEnd(text, start + word.length);
    lines.push(new Set([...range.getClientRects()].map((rect) => Math.round(rect.top))).size);
    start += word.length;
  }
  return lines;
}"""


def test_the_home_page_lists_each_app_once_with_its_pages(shop_server, page):
    _sign_in(page, shop_server.url)

    # Each app has one module, under its own name
    captions = page.locator("#content-main .module caption").all_inner_texts()
    names = [caption.strip().lower() for caption in captions]
    assert len(names) == len(set(names)), names
    assert {"load runs", "pitfall lab"} <= set(names), names
    # and its pages are listed in it, beside its models
    load_runs = page.locator("#content-main .app-loadtest")
    expect(load_runs.get_by_role("link", name="Compare strategies")).to_be_visible()
    expect(load_runs.get_by_role("link", name="Sale runs")).to_be_visible()
    lab_module = page.locator("#content-main .app-pitfalls")
    expect(lab_module.get_by_role("link", name="Scenarios")).to_be_visible()
    expect(lab_module.get_by_role("link", name="Pitfall runs")).to_be_visible()
    screenshot(page, "30-admin-home")

    # and no link's word is broken over two lines, on a wide screen or a phone's
    for width in (1000, 600, 375):
        page.set_viewport_size({"width": width, "height": 800})
        for link in page.locator("#content-main .module th a").all():
            assert set(link.evaluate(LINES_PER_WORD)) == {1}, (width, link.inner_text())
    screenshot(page, "31-admin-home-narrow")

    # and the pages open from there
    page.set_viewport_size({"width": 1000, "height": 800})
    load_runs.get_by_role("link", name="Compare strategies").click()
    expect(page.locator("h1")).to_have_text("Compare strategies")


def test_the_lab_sets_code_as_code_and_names_its_figures_for_a_reader(shop_server, page):
    # Given a finished run whose figures are many (two fixes, booleans, a list of fences)
    result = lab.run("failover-loses-lock").as_dict()
    run = PitfallRun.objects.create(
        scenario="failover-loses-lock", status=PitfallRun.Status.DONE, result=result
    )
    _sign_in(page, shop_server.url)

    # When staff open it on the lab page
    page.goto(f"{shop_server.url}/admin/pitfalls/?run={run.pk}")

    # Then the sentences' code is set as code, and no backtick is left on the page
    lost_update = page.locator("#scenario-lost-update td.explanation")
    expect(lost_update.locator("code")).to_have_text(["unsafe", "lock"])
    assert "`" not in page.locator("#content").inner_text()
    # and the run's figures are named in words, their values as a reader reads them
    fixed = page.locator("#variant-fixed dl.figures")
    labels = fixed.locator("dt").all_inner_texts()
    assert "most holders at once" in labels and "fences handed to A and B" in labels, labels
    assert not [label for label in labels if "_" in label], labels
    values = fixed.locator("dd").all_inner_texts()
    assert "1, 2" in values and "yes" in values, values
    assert not {"True", "False"} & set(values), values
    screenshot(page, "32-admin-pitfall-lab-figures")


#: The bounding box of every text of each chart, and the chart's.
TEXTS_AND_CHART = """(chart) => {
  const box = (element) => {
    const rect = element.getBoundingClientRect();
    return {text: element.textContent, top: rect.top, bottom: rect.bottom,
            left: rect.left, right: rect.right};
  };
  return {chart: box(chart), texts: [...chart.querySelectorAll("text")].map(box)};
}"""


def test_every_chart_s_labels_stay_inside_it(shop_server, page):
    # Given a batch whose tallest bars (the baseline's requests/s, the p99s) reach the top
    common = {"batch": "b-labels", "status": SaleRun.Status.DONE, "parameters": {
        "stock": 50, "users": 10, "duration": 5, "strategies": ["lua", "lock"]}}  # fmt: skip
    history = [{"t": t, "users": 10, "requests_per_second": 90.0, "p95_ms": 20.0,
                "units_sold": units} for t, units in enumerate([0, 30, 50])]  # fmt: skip
    SaleRun.objects.create(strategy="baseline", requests_per_second=2975, p99_ms=9, **common)
    for strategy, rate, goodput in (("lua", 1300.0, 1333.0), ("lock", 650.0, 507.0)):
        SaleRun.objects.create(
            strategy=strategy, requests_per_second=rate, baseline_requests_per_second=2975,
            p99_ms=40, goodput=goodput, accepted_units=50, oversold=0, remaining=0,
            history=history, **common,
        )  # fmt: skip
    _sign_in(page, shop_server.url)

    # When staff compare it
    page.goto(f"{shop_server.url}/admin/compare/?batch=b-labels")
    charts = page.locator("svg[role=img]")
    expect(charts).to_have_count(6)

    # Then every label of every chart is drawn inside the chart, the tallest bar's value too
    outside = []
    for chart in charts.all():
        drawn = chart.evaluate(TEXTS_AND_CHART)
        frame = drawn["chart"]
        for text in drawn["texts"]:
            inside = (
                text["top"] >= frame["top"] - 0.5
                and text["bottom"] <= frame["bottom"] + 0.5
                and text["left"] >= frame["left"] - 0.5
                and text["right"] <= frame["right"] + 0.5
            )
            if not inside:
                outside.append((chart.get_attribute("aria-label"), text))
    assert outside == []
    tallest = page.get_by_role("img", name="Throughput (requests/s)").locator(
        "text", has_text="2975"
    )
    expect(tallest).to_have_count(1)
    screenshot(page, "33-admin-compare-labels")
