"""The benchmarks that sell in the load-run sandbox refuse bad arguments before anything runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env


@pytest.mark.parametrize(
    ("benchmark", "bad"),
    [
        ("settle", ["--workers", "0"]),
        ("settle", ["--workers", "x"]),
        ("settle", ["--orders", "5"]),
        ("calls", ["--sales", "0"]),
        ("calls", ["--blocks", "x"]),
        ("calls", ["--strategies", "optimistic"]),
        ("strategies", ["--crowds", "0"]),
        ("strategies", ["--crowds", "x"]),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(benchmark, bad):
    result = subprocess.run(
        [sys.executable, "manage.py", "bench", benchmark, *bad],
        cwd=ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "error: argument" in result.stderr
