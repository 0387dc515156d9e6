"""The demo measures selling, then sells out: a probe sizes each sale so that it still sells
through its measured window, the crowd then buys the rest, and the audit finds nothing left."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client

from loadtest.models import SaleRun
from loadtest.report.text import table
from loadtest.runs.config import LoadRunSettings
from loadtest.runs.recording import settle_figures
from loadtest.runs.window import measure_window
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_sized_sale_sells_through_its_window_then_sells_out(tmp_path):
    # Given a safe strategy and unsafe, each sale sized by its own probe for a 2 s window (with
    # room for a machine whose speed moves: a sale up to 3x faster than its probe, or far slower)
    command = [
        sys.executable, "manage.py", "loadtest", "--strategies", "lua,unsafe",
        "--window", "2", "--headroom", "3", "--duration", "60", "--users", "8",
        "--spawn-rate", "60", "--server-workers", "3", "--unsafe-delay-ms", "20",
        "--out", str(tmp_path),
    ]  # fmt: skip

    # When the load run floods them
    result = subprocess.run(
        command, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=240
    )

    # Then it succeeds, and the probe sized the safe strategy's sale
    assert result.returncode == 0, result.stderr[-3000:]
    batch = re.search(r"^batch (\S+):", result.stderr, re.MULTILINE).group(1)
    runs = {run.strategy: run for run in SaleRun.objects.filter(batch=batch)}
    lua = runs["lua"]
    probe = lua.parameters["probe"]
    assert lua.parameters["stock_sizing"] == "probe"
    assert probe["units_per_second"] > 0 and lua.initial_stock == probe["stock"]
    # and the sale was still selling through the whole window, which units/s measures
    window = lua.audit["window"]
    assert window["held"] and window["seconds"] == 2.0, window
    assert 0 < window["units"] < lua.initial_stock
    assert lua.goodput == window["units_per_second"] > 0
    # and its requests/s were counted over that window too, Locust's whole-run figure beside it
    http = lua.audit["http"]
    assert (http["from"], http["to"]) == (window["starts_at"], window["ends_at"])
    assert lua.requests_per_second == http["requests_per_second"] > 0
    assert http["whole_run_requests_per_second"] > 0
    # and the baseline's from once its crowd was in, the span of its CPU per request
    baseline = runs["baseline"]
    steady = baseline.audit["http"]
    assert baseline.requests_per_second == steady["requests_per_second"] > 0
    assert baseline.audit["cpu"]["seconds"] == pytest.approx(steady["to"] - steady["from"])
    # and then it sold out: every unit accepted, none oversold, none left, no update lost
    assert lua.sold_out_after_seconds > window["starts_after_first_order"] + window["seconds"]
    assert lua.accepted_units == lua.initial_stock and lua.oversold == 0 and lua.remaining == 0
    assert lua.audit["db_stock"] == 0 and lua.audit["lost_updates"] == 0
    assert lua.audit["consistent"], lua.audit
    # and where the CPU went over the window was measured, by part: every process started for
    # the run and Locust spent some, the parts add up to the host's busy CPU, and the table of
    # it is printed under the comparison, the baseline's per request
    cpu = lua.audit["cpu"]
    assert cpu["seconds"] == pytest.approx(window["seconds"], abs=0.01)
    costs = cpu["per_unit_ms"]
    assert all(costs[part] > 0 for part in ("server", "worker", "locust")), cpu
    parts = sum(value for part, value in costs.items() if part != "all" and value is not None)
    # (each process's CPU and the host's are counted in clock ticks, read a scan of /proc apart:
    # over 2 s on 2 cores they agree to a few ticks of the ~400, not exactly)
    assert parts == pytest.approx(costs["all"], rel=0.03) and 0 < cpu["host_busy"] <= 1
    assert runs["baseline"].audit["cpu"]["per_request_ms"]["server"] > 0
    assert re.search(r"^cpu ms per unit +server +worker", result.stdout, re.MULTILINE)
    assert re.search(r"^lua +\d+\.\d\d +\d+\.\d\d", result.stdout, re.MULTILINE)
    # and unsafe shows its damage: units accepted beyond what its stock went down by
    unsafe = runs["unsafe"]
    went_down = unsafe.initial_stock - unsafe.audit["db_stock"]
    assert unsafe.audit["lost_updates"] == unsafe.accepted_units - went_down > 0
    # and the comparison leads with units/s over the window, lost updates beside it
    header = next(line for line in result.stdout.splitlines() if line.startswith("strategy"))
    assert header.split()[1:3] == ["units/s", "window"] and "lost updates" in header


def _orders(start: datetime, seconds: float, per_second: int) -> list[tuple[datetime, int]]:
    count = int(seconds * per_second)
    return [(start + timedelta(seconds=index / per_second), 1) for index in range(count)]


def test_a_window_the_stock_cut_short_is_measured_and_said_so():
    # Given a sale whose crowd takes 0.5 s to be in and whose stock ran out 4 s in
    config = LoadRunSettings(strategies=["lua"], users=10, spawn_rate=1000, window=10)
    opened = datetime(2026, 1, 1, tzinfo=UTC)
    orders = _orders(opened, 4.0, 100)

    # When its window is measured
    window = measure_window(orders, config, sold_out=True)

    # Then it covers what there was, from the crowd being in to the last unit, and says so
    assert window["held"] is False and window["ended_by"] == "sold out"
    assert window["starts_after_first_order"] == pytest.approx(0.51)
    assert window["seconds"] == pytest.approx(3.48, abs=0.02)
    assert window["units_per_second"] == pytest.approx(100, rel=0.02)
    # and the comparison shows the short window in its row and in a note under the table
    run = SaleRun(strategy="lua", status=SaleRun.Status.DONE, goodput=100, initial_stock=400)
    run.audit = {"window": window, "sold_out": True, "lost_updates": 0}
    text = table([run])
    assert "3.5 short" in text
    assert "lua: its window lasted 3.5 s, not 10 s (the stock ran out)" in text


def test_a_window_that_held_ends_after_the_window_and_counts_only_its_units():
    config = LoadRunSettings(strategies=["lua"], users=10, spawn_rate=1000, window=2)
    orders = _orders(datetime(2026, 1, 1, tzinfo=UTC), 6.0, 50)

    window = measure_window(orders, config, sold_out=True)

    assert window["held"] is True and window["ended_by"] == "window"
    assert window["seconds"] == 2.0 and window["units"] == 100


def test_a_sale_over_before_its_crowd_was_in_but_for_a_straggler_is_measured_whole():
    # Given a sale whose crowd takes 0.5 s to be in, which sold 60 units in its first 0.3 s and
    # one more (an oversold straggler, say) just after the crowd was in
    config = LoadRunSettings(strategies=["unsafe"], users=10, spawn_rate=1000, window=10)
    opened = datetime(2026, 1, 1, tzinfo=UTC)
    orders = [*_orders(opened, 0.3, 200), (opened + timedelta(seconds=0.515), 1)]

    # When its window is measured
    window = measure_window(orders, config, sold_out=True)

    # Then it is measured from its first order to its last, not over the 5 ms after the crowd
    # was in, in which no unit sold
    assert window["starts_after_first_order"] == 0 and window["seconds"] == 0.52
    assert window["units"] == 60 and window["units_per_second"] == pytest.approx(116.5, abs=0.1)


@pytest.mark.django_db
def test_the_compare_page_leads_with_the_window_and_says_when_it_was_short():
    # Given a batch whose lua sale ran out of stock 3.5 s into its 10 s window
    window = {"target_seconds": 10, "seconds": 3.5, "units": 350, "units_per_second": 100.0,
              "held": False, "ended_by": "sold out"}  # fmt: skip
    common = {"batch": "b-window", "status": SaleRun.Status.DONE,
              "parameters": {"window": 10, "users": 10, "strategies": ["lua"]}}  # fmt: skip
    SaleRun.objects.create(strategy="baseline", requests_per_second=900, **common)
    SaleRun.objects.create(
        strategy="lua", goodput=100, initial_stock=400, accepted_units=400, oversold=0,
        remaining=0, audit={"window": window, "sold_out": True, "lost_updates": 0}, **common,
    )  # fmt: skip
    User.objects.create_user("boss", password="pw-for-tests-only", is_staff=True)
    client = Client()
    client.login(username="boss", password="pw-for-tests-only")

    # When staff compare it
    page = client.get("/admin/compare/").content.decode()

    # Then units/s over the window leads the table and the charts, and the short window shows
    runs = page[page.index('id="runs"') :]  # the sidebar's app list has headers of its own
    headers = re.findall(r'<th scope="col">([^<]*)</th>', runs)
    assert headers[:3] == ["strategy", "units/s", "window s"] and "lost updates" in headers
    assert "<td>3.5 short</td>" in page
    assert "its window lasted 3.5 s, not 10 s (the stock ran out)" in page
    assert page.index("Units/s over the window") < page.index("Throughput (requests/s)")


def test_the_settle_lag_counts_final_orders_and_pending_peaks_each_second():
    # Given twenty orders a tenth of a second apart, each final 0.3 s after its 201, and one
    # still pending
    opened = datetime(2026, 11, 23, tzinfo=UTC)
    orders = [
        (
            opened + timedelta(seconds=0.1 * n),
            opened + timedelta(seconds=0.1 * n + 0.3),
            "confirmed",
        )
        for n in range(20)
    ] + [(opened + timedelta(seconds=2.5), opened + timedelta(seconds=2.5), "pending")]

    figures = settle_figures(orders, opened)

    assert (figures["orders"], figures["settled"], figures["unsettled"]) == (21, 20, 1)
    assert figures["p50_ms"] == figures["p99_ms"] == pytest.approx(300.0)
    # three at most were pending at once in each busy second; the open one stays
    assert figures["pending"] == [[0, 3], [1, 3], [2, 3], [3, 1]]
    assert settle_figures([], opened)["p99_ms"] is None
