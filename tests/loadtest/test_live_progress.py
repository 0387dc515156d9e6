"""A load run says how it goes while it goes: the command's live line (in place on a terminal,
plain lines elsewhere) and the compare page's running batch."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.management.base import OutputWrapper
from django.test import Client

from loadtest.management.commands.loadtest import LiveProgress
from loadtest.models import SaleRun
from loadtest.runs.locust_driver import latest_rates

HEADER = (
    "Timestamp,User Count,Type,Name,Requests/s,Failures/s,50%,95%,"
    "Total Request Count,Total Failure Count"
)


def test_the_latest_second_s_http_rate_and_the_failures_so_far(tmp_path: Path):
    history = tmp_path / "lua_stats_history.csv"
    assert latest_rates(history) == (0.0, 0)  # before Locust wrote anything
    history.write_text(
        "\n".join(
            [
                HEADER,
                "100,10,POST,checkout,50.0,0,5,9,50,0",
                "100,10,GET,item,10.0,0,3,4,10,0",
                "101,10,POST,checkout,80.0,1.0,5,9,130,2",
                "101,10,GET,item,20.0,0,3,4,30,1",
                "101,10,UNITS,sold,40.0,0,0,0,70,0",  # not an HTTP request
                "101,10,,Aggregated,140.0,1.0,5,9,230,3",
            ]
        )
        + "\n"
    )
    assert latest_rates(history) == (100.0, 3)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_lines_replace_each_other_on_a_terminal_and_are_lines_elsewhere():
    terminal = _Terminal()
    progress = LiveProgress(OutputWrapper(terminal))
    progress("starting")
    progress("  lua: 1 s of 30", live=True)
    progress("  lua: 3 s of 30", live=True)
    progress("lua done")
    assert terminal.getvalue() == (
        "starting\n\r\x1b[2K  lua: 1 s of 30\r\x1b[2K  lua: 3 s of 30\nlua done\n"
    )
    log = io.StringIO()
    plain = LiveProgress(OutputWrapper(log))
    plain("  lua: 1 s of 30", live=True)
    plain("  lua: 3 s of 30", live=True)
    assert log.getvalue() == "  lua: 1 s of 30\n  lua: 3 s of 30\n"


@pytest.mark.django_db
def test_the_compare_page_shows_the_run_under_way_and_its_units_sold_so_far():
    common = {"batch": "live-1", "parameters": {"strategies": ["lua"]}}
    SaleRun.objects.create(strategy="baseline", status=SaleRun.Status.DONE, **common)
    SaleRun.objects.create(
        strategy="lua",
        status=SaleRun.Status.RUNNING,
        initial_stock=3000,
        requests_per_second=812.4,
        failures=0,
        history=[
            {"t": 0, "users": 40, "requests_per_second": 700.0, "p95_ms": 9.0, "units_sold": 0},
            {"t": 6, "users": 40, "requests_per_second": 812.4, "p95_ms": 9.0, "units_sold": 1234},
        ],
        **common,
    )
    User.objects.create_user("boss", password="pw-for-tests-only", is_staff=True)
    client = Client()
    client.login(username="boss", password="pw-for-tests-only")
    page = client.get("/admin/compare/", {"batch": "live-1"}).content.decode()
    assert 'http-equiv="refresh"' in page
    assert "lua: 6 s, 1234 of 3000 units sold, 812 req/s, 0 failures" in page
    assert "Units sold over time" in page
