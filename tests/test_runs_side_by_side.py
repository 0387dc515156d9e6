"""Two runs of the suite on one PostgreSQL: each has a test database of its own
(`test_<database>_<host>_<pid>`, tests/conftest.py), and a run that starts drops the databases
of runs on its host that were killed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from loadtest.sandbox import database_name

ROOT = Path(__file__).resolve().parent.parent
#: A quick test of the suite that writes rows and commits them.
ANOTHER_RUNS_TEST = "tests/test_flush.py::test_every_row_goes_and_content_types_keep_their_ids"


def _databases(stem: str) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s)", [stem])
        return {name for (name,) in cursor.fetchall()}


@pytest.mark.django_db
def test_a_run_beside_this_one_keeps_to_its_own_database_and_drops_a_killed_runs(
    django_db_keepdb,
):
    if django_db_keepdb:
        pytest.skip("--reuse-db keeps one database name from run to run")
    # given: this run's database, and the two a killed run left (its own and its sandbox)
    ours = connection.settings_dict["NAME"]
    assert ours.endswith(f"_{os.getpid()}")
    stem = ours.removesuffix(str(os.getpid()))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    killed = f"{stem}{gone.pid}"
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as server:
        for name in (killed, database_name(killed)):
            server.execute(f'CREATE DATABASE "{name}"')

    # when: another run of the suite starts, beside this one, and runs a test that commits
    with subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", ANOTHER_RUNS_TEST],
        cwd=ROOT,
        env=os.environ.copy(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as other:
        output, _ = other.communicate(timeout=600)

    # then: it passed on a database of its own, gone with it; ours is still here; the killed
    # run's are dropped
    assert other.returncode == 0, output[-3000:]
    assert "1 passed" in output
    left = _databases(stem)
    assert ours in left
    assert not {killed, database_name(killed)} & left
    assert f"{stem}{other.pid}" not in left
