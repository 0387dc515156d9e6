"""The lock hand-over benchmark: our lock and the peer locks alone, on a real Redis."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest
from django.conf import settings

from loadtest import bench_locks
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import REDIS_PREFIX, server_env


@pytest.mark.parametrize(
    "entry",
    [["-m", "loadtest.bench_locks"], ["manage.py", "bench", "locks"]],
    ids=["module", "manage.py bench"],
)
def test_a_short_run_measures_every_lock_at_every_outside_work_and_none_lets_two_in(
    tmp_path, entry
):
    report = tmp_path / "locks.json"
    command = [
        sys.executable, *entry, "--buyers", "3", "--duration", "0.5",
        "--outside-ms", "0", "0.2", "--prefix", f"{REDIS_PREFIX}:bench-locks",
        "--json", str(report),
    ]  # fmt: skip

    result = subprocess.run(
        command, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=120
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(report.read_text())
    assert sorted((row["outside_ms"], row["lock"]) for row in rows) == sorted(
        (outside, lock) for outside in (0.0, 0.2) for lock in bench_locks.LOCKS
    )
    for row in rows:
        assert row["acquisitions"] > 0, row
        assert row["lost_updates"] == 0, row
        assert row["errors"] == [], row
        assert 1.0 <= row["busiest_share"] <= 3.0, row
        assert row["wait_p50_ms"] <= row["wait_p99_ms"] <= row["wait_max_ms"], row
    # ours hands the lock round in FIFO order: no process gets much more than its share
    for row in rows:
        if row["lock"] == "ours":
            assert row["busiest_share"] < 1.25, row
    # and is set against the fastest peer in each group
    ratios = re.findall(r"^\s*[\d.]+\s+ours\s+\d+\s+(\d+\.\d\d)x ", result.stdout, re.M)
    assert len(ratios) == 2, result.stdout


class _NoLock:
    """Lets everyone in: what the lost-update count exists to catch."""

    def acquire(self) -> bool:
        return True

    def release(self) -> None:
        pass


def test_the_run_counts_the_updates_a_lock_that_lets_two_in_loses(monkeypatch):
    # The buyers are forked, so they inherit the lock that is no lock
    monkeypatch.setattr(bench_locks, "make_lock", lambda kind, client, name: _NoLock())
    args = argparse.Namespace(
        buyers=4, duration=0.5, hold_ms=1.0, prefix=f"{REDIS_PREFIX}:bench-locks"
    )

    row = bench_locks.run_row(settings.REDIS_URL, "ours", 0.0, args)

    assert row.acquisitions > 0
    assert row.lost_updates > 0, row
