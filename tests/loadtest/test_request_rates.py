"""A load run's requests/s are measured over the span its units/s are: the baseline's once its
crowd is in, a sale's over its measured window; read off the running counts of Locust's
history, not off Locust's averaged `Requests/s`."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.models import SaleRun
from loadtest.runs.config import LoadRunSettings
from loadtest.runs.locust_driver import http_totals, read_history
from loadtest.runs.window import record_baseline_rate, record_window_rate, requests_between

HEADER = (
    "Timestamp,User Count,Type,Name,Requests/s,Failures/s,95%,Total Request Count,"
    "Total Failure Count"
)


def _history_file(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join([HEADER, *rows]) + "\n")
    return path


def _crowd(path: Path, counts: list[int], *, start: int = 1000) -> Path:
    """A history whose HTTP requests so far are `counts`, one row a second from `start`, split
    between checkouts and item views, with the locustfile's UNITS entry and Locust's
    Aggregated row beside them (both counting what is not an HTTP request here), and a
    `Requests/s` column that is Locust's lagging average, wrong on purpose."""
    rows = []
    for offset, count in enumerate(counts):
        second = start + offset
        views = count // 5
        rows += [
            f"{second},40,POST,checkout,1.0,0,20,{count - views},0",
            f"{second},40,GET,item,1.0,0,20,{views},0",
            f"{second},40,UNITS,sold,1.0,0,0,{count},0",
            f"{second},40,,Aggregated,3.0,0,20,{2 * count},0",
        ]
    return _history_file(path, rows)


def test_requests_between_two_moments_are_read_off_the_running_http_count(tmp_path):
    # Given a crowd that ramps up for two seconds, then sends 1,000 requests a second
    history = _crowd(tmp_path / "h.csv", [0, 200, 800, 1800, 2800, 3800])
    totals = http_totals(history)

    # Then only the HTTP entries count
    assert totals == [(1000, 0), (1001, 200), (1002, 800), (1003, 1800), (1004, 2800),
                      (1005, 3800)]  # fmt: skip
    # and the rate between two moments is the count between them over the time, the count
    # within a second taken as if its requests came evenly
    assert requests_between(totals, 1002, 1005) == pytest.approx(1000)
    assert requests_between(totals, 1002.5, 1004.5) == pytest.approx(1000)
    assert requests_between(totals, 1000, 1005) == pytest.approx(760)  # the ramp included
    assert requests_between(totals, 1001.5, 1002.5) == pytest.approx(800)
    # and a span outside the history, or empty, has no rate
    assert requests_between(totals, 999.0, 1003) is None
    assert requests_between(totals, 1003, 1006.0) is None
    assert requests_between(totals, 1003, 1003) is None
    assert requests_between([(1000, 5)], 1000, 1000) is None


def test_an_entry_written_twice_in_one_second_counts_once(tmp_path):
    history = _history_file(
        tmp_path / "h.csv",
        [
            "1000,40,POST,checkout,1.0,0,20,0,0",
            "1001,40,POST,checkout,1.0,0,20,900,0",
            "1001,40,GET,item,1.0,0,20,100,0",
            "1001,40,POST,checkout,1.0,0,20,950,1",  # its last row, as Locust stopped
        ],
    )

    assert http_totals(history) == [(1000, 0), (1001, 1050)]


def test_the_history_s_rate_each_second_is_the_requests_of_that_second(tmp_path):
    history = _crowd(tmp_path / "h.csv", [0, 200, 800, 1800])

    samples = read_history(history, qty=1)

    assert [sample["requests_per_second"] for sample in samples] == [0, 200, 600, 1000]
    assert [sample["t"] for sample in samples] == [0, 1, 2, 3]


class _NoCpu:
    """A meter that measured nothing (the rate does not depend on it)."""

    def between(self, start: float, end: float) -> None:
        return None


def test_the_baseline_s_rate_is_its_rate_once_the_crowd_is_in(tmp_path):
    # Given a baseline whose crowd took its ramp (a second and a half, rounded up to two) to
    # reach 1,000 requests a second, and whose Locust averaged the whole run
    config = LoadRunSettings(strategies=["lua"], users=40, spawn_rate=40, window=10)
    assert 1 < config.ramp_seconds <= 2
    _crowd(tmp_path / "baseline_stats_history.csv", [0, 200, 800, 1800, 2800, 3800])
    run = SaleRun(strategy="baseline", requests_per_second=760.0, audit={})

    # When its rate is recorded
    record_baseline_rate(run, tmp_path / "baseline", config, _NoCpu())

    # Then it is the rate from once the crowd is in to the end, what the strategies' units/s
    # are held against, and Locust's whole-run figure stays beside it
    assert run.requests_per_second == pytest.approx(1000)
    assert run.audit["http"] == {
        "from": 1002,
        "to": 1005,
        "requests_per_second": 1000.0,
        "whole_run_requests_per_second": 760.0,
    }


def test_a_sale_s_rate_is_its_rate_over_its_measured_window(tmp_path):
    # Given a sale whose window ran from 1002.5 to 1004.5, and whose drain (its sold-out
    # answers, 3,000 a second) came after it
    _crowd(tmp_path / "lua_stats_history.csv", [0, 200, 800, 1800, 2800, 3800, 6800, 9800])
    window = {"units": 1500, "starts_at": 1002.5, "ends_at": 1004.5}
    run = SaleRun(strategy="lua", requests_per_second=1225.0, audit={"window": window})

    record_window_rate(run, tmp_path / "lua")

    assert run.requests_per_second == pytest.approx(1000)
    assert run.audit["http"]["from"] == 1002.5 and run.audit["http"]["to"] == 1004.5
    assert run.audit["http"]["whole_run_requests_per_second"] == 1225.0


def test_a_sale_with_no_window_keeps_locust_s_figure(tmp_path):
    _crowd(tmp_path / "lua_stats_history.csv", [0, 10, 20])
    run = SaleRun(strategy="lua", requests_per_second=10.0, audit={"window": {"units": 0}})

    record_window_rate(run, tmp_path / "lua")

    assert run.requests_per_second == 10.0 and "http" not in run.audit
