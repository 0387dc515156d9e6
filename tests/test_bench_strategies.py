"""The benchmark without HTTP: one run drives every strategy, the peer locks and the ceilings."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from loadtest.bench_strategies import PEERS
from loadtest.server import PROJECT_DIR as ROOT
from tests.conftest import server_env

pytestmark = pytest.mark.django_db(transaction=True)

STOCK = 30
SAFE = [
    "lock",
    "segmented",
    "lua",
    "optimistic",
    "lua, group commit",
    "lock +5 ms work",
    "segmented +5 ms work",
    *(peer.label for peer in PEERS.values()),
    "take + row sale (SQL)",
    "hot row (SQL)",
]
ROW = re.compile(
    r"^(?P<contender>\S.*?)\s{2,}(?P<rate>\d+)\s+(?P<sold>\d+)\s+(?P<busy>\d+)\s+"
    r"(?P<oversold>\d+)\s+(?P<remaining>\S+)\s+(?P<consistent>yes|NO)\s"
)


def test_a_tiny_run_prints_every_contender_and_no_safe_one_oversells(django_db_setup, tmp_path):
    # Given tiny settings, against the test database and this session's Redis prefix
    report = tmp_path / "bench.json"
    command = [
        sys.executable, "-m", "loadtest.bench_strategies",
        "--buyers", "2", "--stock", str(STOCK), "--duration", "5", "--ceiling-stock", "300",
        "--json", str(report),
    ]  # fmt: skip

    # When the benchmark runs every contender in turn
    result = subprocess.run(
        command, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=180
    )

    # Then it exits 0 and prints one row per contender, the six targets (one of them on p99
    # time per sale) and the two bounds
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {
        match["contender"]: match
        for match in map(ROW.match, result.stdout.splitlines())
        if match is not None
    }
    expected = [*SAFE, "unsafe", "raw EVALSHA"]
    assert sorted(rows) == sorted(expected), result.stdout
    for name in SAFE:
        assert rows[name]["oversold"] == "0", rows[name].string
        assert rows[name]["consistent"] == "yes", rows[name].string
    assert result.stdout.count("(target >= ") == 5, result.stdout
    assert result.stdout.count("(target <= ") == 1, result.stdout
    assert re.search(r"lua\s+vs hot row \(SQL\)\s+\d+\.\d\dx", result.stdout), result.stdout
    assert re.search(r"lock\s+vs hot row \(SQL\)\s+\d+\.\d\dx", result.stdout), result.stdout
    assert re.search(r"take \+ row sale \(SQL\)\s+vs hot row \(SQL\)\s+\d", result.stdout)
    # and every unit a buyer was sold is an order in the database
    results = {entry["contender"]: entry for entry in json.loads(report.read_text())["results"]}
    for name in SAFE:
        assert results[name]["errors"] == [], results[name]["errors"]
        assert results[name]["sold"] == results[name]["accepted_units"] <= STOCK, results[name]
    assert json.loads(report.read_text())["broken"] == []
