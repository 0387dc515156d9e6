"""The order pipeline's benchmark: a flood with no worker, then real workers on its backlog."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.slow
def test_a_tiny_run_settles_the_backlog_once_for_each_worker_count(django_db_setup, tmp_path):
    # Given tiny settings, against the test database and this session's Redis prefix
    report = tmp_path / "settle.json"
    command = [
        sys.executable, "manage.py", "bench", "settle",
        "--orders", "60", "--buyers", "2", "--workers", "1,2", "--payment-ms", "5",
        "--timeout", "60", "--json", str(report),
    ]  # fmt: skip

    # When it floods a lua sale, then has one worker and then two settle its orders
    result = subprocess.run(
        command, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=240
    )

    # Then it exits 0 and prints the flood, one row per worker count and the target
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "flood (accepted)" in result.stdout
    assert "settle, 1 worker " in result.stdout and "settle, 2 workers" in result.stdout
    assert "target: one worker settles / the flood accepts:" in result.stdout
    document = json.loads(report.read_text())
    assert document["accepted_per_second"] > 0
    assert [r["workers"] for r in document["results"]] == [1, 2]
    for row in document["results"]:
        # every order of the backlog paid exactly once and confirmed, each time
        assert row["orders"] == 60 and row["paid_once"] and not row["timed_out"], row
        assert row["settled_per_second"] > 0
