"""The wake benchmark: one request's CPU back to back and after pauses, and a lua checkout
answered by a real sale writer at once and after its linger."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_tiny_run_measures_every_pause_and_both_writers_and_sells_exactly_the_stock(
    django_db_setup, tmp_path
):
    # Given tiny settings, against the test database and this session's Redis prefix
    report = tmp_path / "wake.json"
    command = [
        sys.executable, "manage.py", "bench", "wake",
        "--requests", "15", "--blocks", "2", "--pauses", "0", "2", "--json", str(report),
    ]  # fmt: skip

    # When it runs
    result = subprocess.run(
        command, cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=240
    )

    # Then it exits 0 and prints a line per kind
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(report.read_text())
    assert [row["kind"] for row in figures["noop"]] == [
        "no-op, 0 ms pause before",
        "no-op, 2 ms pause before",
    ]
    linger_ms = figures["args"]["linger_us"] / 1000
    assert [row["kind"] for row in figures["checkout"]] == [
        "lua checkout, answered at once",
        f"lua checkout, after a {linger_ms:g} ms linger",
    ]
    for row in figures["noop"] + figures["checkout"]:
        assert row["kind"] in result.stdout
        # two measured blocks (the unmeasured first one left out), each a real figure
        assert len(row["blocks"]) == 2 and all(block["cpu_us"] > 0 for block in row["blocks"])
    # and a checkout the writer lingers over takes at least the linger, one taken at once less
    at_once, lingered = figures["checkout"]
    assert lingered["wall_us"] >= linger_ms * 1000
    assert at_once["wall_us"] < lingered["wall_us"]
    # and every checkout was sold exactly once: 15 a block, 3 blocks, 2 writers
    audit = figures["audit"]
    assert audit["accepted_units"] == audit["initial_stock"] == 90
    assert audit["oversold"] == 0 and audit["remaining"] == 0 and audit["consistent"]
