"""A load run never fails on how fast Locust writes its files: a Locust slow to start (a busy
host, a cold bytecode cache) has written no history yet when the run first looks, one may write
none at all, and a file read while Locust writes it ends in a line cut short. The run finishes,
records what it measured, and says what it could not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inventory.models import LIVE_STATUSES, Order
from loadtest.models import SaleRun
from loadtest.report.columns import notes
from loadtest.runs.batch import run_batch
from loadtest.runs.config import LoadRunSettings
from loadtest.runs.locust_driver import http_totals, latest_rates, read_history
from tests.conftest import TEST_API_TOKEN

#: Put in front of the Locust processes a load run starts (through PYTHONPATH): the interpreter
#: imports it before Locust. FLASHSALE_TEST_LOCUSTS names, by CSV prefix, the ones that start
#: only once the test creates `<prefix>.go` ("late") and the ones that write their history
#: nowhere ("never").
SITECUSTOMIZE = """
import json, os, sys, time

argv = sys.orig_argv
if "locust" in argv and "--csv" in argv:
    prefix = argv[argv.index("--csv") + 1]
    behaviour = json.loads(os.environ["FLASHSALE_TEST_LOCUSTS"]).get(os.path.basename(prefix))
    if behaviour == "late":
        deadline = time.monotonic() + 120
        while not os.path.exists(prefix + ".go") and time.monotonic() < deadline:
            time.sleep(0.05)
    elif behaviour == "never":
        import locust.stats

        locust.stats.StatsCSVFileWriter.stats_history_file_name = lambda self: os.devnull
"""

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.slow
def test_a_locust_slow_to_start_or_that_writes_no_history_leaves_finished_runs(
    shop_server, tmp_path, monkeypatch
):
    # Given a baseline whose Locust starts only after the run has looked at it once, and a
    # `lua` sale whose Locust never writes its history
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("FLASHSALE_TEST_LOCUSTS", json.dumps({"baseline": "late", "lua": "never"}))
    monkeypatch.setenv("FLASHSALE_API_TOKEN", TEST_API_TOKEN)
    out = tmp_path / "out"
    history_when_first_seen: list[bool] = []
    printed: list[str] = []

    def progress(line: str, *, live: bool = False) -> None:
        printed.append(line)
        go = out / "baseline.go"
        if live and line.startswith("  baseline:") and not go.exists():
            history_when_first_seen.append((out / "baseline_stats_history.csv").exists())
            go.touch()

    # When a small run floods them (the size of one started from the compare page)
    config = LoadRunSettings(
        strategies=["lua"],
        stock=40,
        users=5,
        spawn_rate=50,
        duration=4,
        host=shop_server.url,
        out=out,
        settle_timeout=None,
    )
    batch = run_batch(config, progress=progress)

    # Then the run looked at the baseline's Locust before it had written any history
    assert history_when_first_seen == [False], printed
    # and both runs finished with what Locust measured once it ran
    runs = {run.strategy: run for run in SaleRun.objects.filter(batch=batch.batch)}
    assert {name: run.status for name, run in runs.items()} == {
        "baseline": SaleRun.Status.DONE,
        "lua": SaleRun.Status.DONE,
    }, {name: run.error for name, run in runs.items()}
    baseline, lua = runs["baseline"], runs["lua"]
    assert baseline.requests > 0 and baseline.requests_per_second > 0
    assert baseline.history and baseline.history[-1]["requests_per_second"] >= 0
    assert "missing" not in baseline.audit, baseline.audit
    # and the sale was audited as any other: what the database holds, nothing oversold
    sold = sum(
        Order.objects.filter(item__sku=lua.sku, status__in=LIVE_STATUSES).values_list(
            "qty", flat=True
        )
    )
    assert lua.accepted_units == sold > 0 and lua.oversold == 0
    assert lua.requests > 0 and lua.p99_ms is not None
    # and the figures the missing history would have given are said to be missing
    assert lua.history == []
    assert any(line.startswith("history: Locust wrote none") for line in lua.audit["missing"])
    assert any(line.startswith("lua: not measured: history") for line in notes(batch.runs))
    assert batch.files["html"].exists()


HEADER = (
    "Timestamp,User Count,Type,Name,Requests/s,Failures/s,95%,Total Request Count,"
    "Total Failure Count"
)
ROWS = [
    "1000,5,POST,checkout,1.0,0,20,100,0",
    "1000,5,UNITS,sold,1.0,0,0,100,0",
    "1001,5,POST,checkout,1.0,0,20,300,2",
    "1001,5,UNITS,sold,1.0,0,0,300,0",
]


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_history_read_while_locust_writes_it_counts_only_its_whole_rows(tmp_path):
    whole = _written(tmp_path / "whole.csv", "\r\n".join([HEADER, *ROWS]) + "\r\n")
    # Given the same history caught mid-row: the next second's count cut a digit short
    cut = _written(
        tmp_path / "cut.csv", "\r\n".join([HEADER, *ROWS]) + "\r\n1002,5,POST,checkout,1.0,0,20,4"
    )
    # and one caught after its first field
    stub = _written(tmp_path / "stub.csv", "\r\n".join([HEADER, *ROWS]) + "\r\n1002")

    # Then each reads as the rows Locust had finished
    for path in (cut, stub):
        assert http_totals(path) == http_totals(whole) == [(1000, 100), (1001, 300)]
        assert latest_rates(path) == latest_rates(whole) == (200.0, 2)
        assert read_history(path, qty=1) == read_history(whole, qty=1)
    assert [sample["units_sold"] for sample in read_history(cut, qty=1)] == [100, 300]


@pytest.mark.parametrize(
    "text",
    [None, "", "Timestamp,User Co", HEADER, HEADER + "\r\n"],
    ids=["not yet made", "empty", "header cut", "header unfinished", "header alone"],
)
def test_a_history_locust_has_not_written_yet_reads_as_empty(tmp_path, text):
    path = tmp_path / "lua_stats_history.csv"
    if text is not None:
        path.write_text(text)

    assert http_totals(path) == []
    assert latest_rates(path) == (0.0, 0)
    assert read_history(path, qty=1) == []
