"""The script-call benchmark: each strategy's sales with the scripts called both ways."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.slow
def test_a_tiny_run_sells_each_strategy_both_ways_and_prints_the_ratios(django_db_setup, tmp_path):
    # Given tiny settings, against the test database and this session's Redis prefix
    report = tmp_path / "calls.json"
    command = [
        sys.executable, "manage.py", "bench", "calls",
        "--strategies", "lock", "lua", "--sales", "5", "--blocks", "2", "--json", str(report),
    ]  # fmt: skip

    # When it sells lock's and lua's sales in blocks, alternating the two ways
    result = subprocess.run(
        command, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=240
    )

    # Then it exits 0 (every sale sold out exactly, none oversold) and prints a row per measure
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for measure in ("lock, per sale", "lua, per sale", "one script call"):
        assert measure in result.stdout
    rows = json.loads(report.read_text())["rows"]
    assert [row["measure"] for row in rows] == [
        "lock, per sale",
        "lua, per sale",
        "one script call",
    ]
    for row in rows:
        # two measured blocks each way (the unmeasured first ones left out), each a real figure
        assert {way: len(blocks) for way, blocks in row["blocks"].items()} == {
            "redis-py": 2,
            "direct": 2,
        }
        assert all(value > 0 for blocks in row["blocks"].values() for value in blocks), row
        assert row["direct_over_redis_py"] > 0
