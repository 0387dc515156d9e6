"""The lock-waiters benchmark: a crowd of waiters in one process, with and without the wake hub,
on a real Redis."""

from __future__ import annotations

import json
import subprocess
import sys

from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import REDIS_PREFIX, server_env


def test_a_short_run_counts_each_ways_connections_and_the_hub_hands_the_lock_down_in_order(
    tmp_path,
):
    report = tmp_path / "waiters.json"
    command = [
        sys.executable, "manage.py", "bench", "waiters", "--waiters", "40", "--pool", "4",
        "--rounds", "1", "--prefix", f"{REDIS_PREFIX}:bench-waiters", "--json", str(report),
    ]  # fmt: skip

    result = subprocess.run(
        command, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=300
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(report.read_text())}
    assert sorted(rows) == ["own wakes", "own wakes, bounded pool", "wake hub"]
    # a connection per waiter without the hub; the pool's and the hub's own with it
    assert rows["own wakes"]["connections"] >= 40, rows["own wakes"]
    assert rows["wake hub"]["connections"] <= 5, rows["wake hub"]
    for mode in ("own wakes", "wake hub"):
        assert rows[mode]["handovers"] == 40 and rows[mode]["failures"] == [], rows[mode]
    assert rows["wake hub"]["in_queue_order"], rows["wake hub"]
    # a capped pool without the hub: the waiters holding it starve the rest
    assert rows["own wakes, bounded pool"]["failures"], rows["own wakes, bounded pool"]
    assert "wake hub vs own wakes: connections" in result.stdout, result.stdout
