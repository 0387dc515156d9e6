"""The admin's "Compare strategies" page: staff only, runs side by side, starting a batch."""

from __future__ import annotations

import json
import re

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from loadtest.models import SaleRun
from shop.processes.servers import CeleryWorker
from tests.conftest import server_env, wait_until
from tests.support.processes import gone_runner, started_for_batch

pytestmark = pytest.mark.django_db


def _history(units: int) -> list[dict]:
    return [
        {"t": t, "users": 10, "requests_per_second": 100.0, "p95_ms": 20.0, "units_sold": u}
        for t, u in enumerate([0, units // 2, units, units])
    ]


def _batch(batch: str) -> list[SaleRun]:
    common = {"batch": batch, "status": SaleRun.Status.DONE, "parameters": {
        "stock": 50, "users": 10, "duration": 5, "strategies": ["lua", "unsafe"]}}  # fmt: skip
    return [
        SaleRun.objects.create(strategy="baseline", requests_per_second=900, p99_ms=9, **common),
        SaleRun.objects.create(
            strategy="lua",
            requests_per_second=300,
            baseline_requests_per_second=900,
            p99_ms=40,
            goodput=25,
            accepted_units=50,
            oversold=0,
            remaining=0,
            history=_history(50),
            settle_p50_ms=321.5,
            settle_p99_ms=876.5,
            audit={
                "settle": {"orders": 50, "unsettled": 0, "pending": [[0, 0], [1, 20], [2, 0]]},
                "cpu": {
                    "host_busy": 0.97,
                    "per_unit_ms": {
                        "server": 1.83,
                        "worker": 0.35,
                        "locust": 0.63,
                        "postgres": 0.47,
                        "redis": 0.08,
                        "other": 0.07,
                        "all": 3.73,
                    },
                },
            },
            **common,
        ),  # fmt: skip
        SaleRun.objects.create(
            strategy="unsafe",
            requests_per_second=200,
            baseline_requests_per_second=900,
            p99_ms=60,
            goodput=30,
            accepted_units=80,
            oversold=30,
            remaining=0,
            history=_history(80),
            **common,
        ),  # fmt: skip
    ]


def _login(username: str, *, may_start: bool) -> Client:
    user = User.objects.create_user(username, password="pw-for-tests-only", is_staff=True)
    if may_start:
        user.user_permissions.add(Permission.objects.get(codename="start_load_run"))
    client = Client()
    client.login(username=username, password="pw-for-tests-only")
    return client


@pytest.fixture
def staff_client():
    return _login("boss", may_start=True)


def test_staff_without_the_permission_compare_runs_but_start_none():
    _batch("seen")
    viewer = _login("viewer", may_start=False)
    page = viewer.get("/admin/compare/").content.decode()
    assert page.count('role="img"') == 6 and 'aria-label="Start a load run"' not in page
    assert "Can start a load run from the compare page" in page
    response = viewer.post("/admin/compare/", {"strategies": ["lua"], "users": 5, "spawn_rate": 5})
    assert response.status_code == 403
    assert SaleRun.objects.exclude(batch="seen").count() == 0


@pytest.mark.parametrize(
    "field",
    [{"users": 501}, {"spawn_rate": 1001}, {"window": 61}, {"duration": 301}, {"stock": 100_001}],
)
def test_the_page_starts_only_bounded_runs(staff_client, field):
    start = {"strategies": ["lua"], "users": 5, "spawn_rate": 5, **field}
    response = staff_client.post("/admin/compare/", start, follow=True)
    assert "Not started" in response.content.decode()
    assert SaleRun.objects.count() == 0


def test_one_batch_at_a_time(staff_client):
    running = _batch("busy")
    SaleRun.objects.filter(pk=running[0].pk).update(status=SaleRun.Status.RUNNING)
    response = staff_client.post(
        "/admin/compare/", {"strategies": ["lua"], "users": 5, "spawn_rate": 5}, follow=True
    )
    assert "Not started: batch busy is still running" in response.content.decode()
    assert SaleRun.objects.exclude(batch="busy").count() == 0


def test_anyone_but_staff_is_sent_to_the_login_page():
    User.objects.create_user("buyer", password="pw-for-tests-only")
    anonymous = Client().get("/admin/compare/")
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    buyer = Client()
    buyer.login(username="buyer", password="pw-for-tests-only")
    response = buyer.get("/admin/compare/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_the_latest_batch_is_compared_with_table_and_charts(staff_client):
    _batch("older")
    runs = _batch("newer")
    page = staff_client.get("/admin/compare/").content.decode()
    assert page.count('role="img"') == 6
    for run in runs:
        assert f'value="{run.pk}" checked' in page
    assert "0.33" in page  # lua's 300 req/s against the 900 req/s HTTP ceiling
    # the settle lag, in the table and as pending orders over time
    assert "settle p99 ms" in page and "876" in page and "322" in page
    assert "Orders pending, from the opening" in page
    # and where the CPU went, per unit sold, for the runs that measured it (lua's here)
    cpu = page[page.index('id="cpu"') :]
    cpu = cpu[: cpu.index("</table>")]
    assert re.search(r"<td>lua</td><td>1\.83</td><td>0\.35</td>.*<td>3\.73</td><td>97%</td>", cpu)
    assert "unsafe" not in cpu


def test_chosen_runs_and_filters(staff_client):
    older = _batch("older")
    newer = _batch("newer")
    chosen = [older[1].pk, newer[1].pk]
    page = staff_client.get("/admin/compare/", {"run": chosen}).content.decode()
    assert f"lua #{older[1].pk}" in page and f"lua #{newer[1].pk}" in page
    filtered = staff_client.get("/admin/compare/", {"strategy": "unsafe"}).content.decode()
    # (the run checkboxes: the start form's number fields have values too)
    assert f'name="run" value="{older[2].pk}"' in filtered
    assert f'name="run" value="{older[1].pk}"' not in filtered


def test_bad_start_parameters_start_nothing(staff_client):
    response = staff_client.post(
        "/admin/compare/", {"strategies": ["lua"], "stock": 0, "users": 1, "spawn_rate": 1,
                            "duration": 5}, follow=True)  # fmt: skip
    assert "Not started" in response.content.decode()
    assert SaleRun.objects.count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_run_started_from_the_page_runs_on_a_worker_and_appears(staff_client, tmp_path):
    worker = CeleryWorker(server_env(FLASHSALE_REPORTS_DIR=tmp_path), concurrency=1).start()
    try:
        response = staff_client.post(
            "/admin/compare/",
            {"strategies": ["lua"], "stock": 10, "users": 5, "spawn_rate": 50, "duration": 3},
        )
        assert response.status_code == 302 and "?batch=" in response["Location"]
        progress = staff_client.get(response["Location"]).content.decode()
        assert "is running" in progress and 'http-equiv="refresh"' in progress

        def finished() -> bool:
            runs = SaleRun.objects.all()
            done = runs.count() == 2 and not runs.filter(status=SaleRun.Status.RUNNING).exists()
            # The report is written once every run is done: wait for it before stopping.
            return done and (tmp_path / runs[0].batch / "report.html").exists()

        assert wait_until(finished, timeout=120, interval=1)
        # and by then the processes started for the batch (its server and order worker) have
        # stopped: nothing outlives the task that started them
        assert started_for_batch(SaleRun.objects.first().batch) == []
    finally:
        worker.stop()
    done = staff_client.get(response["Location"]).content.decode()
    assert "is done" in done and done.count('role="img"') == 6
    lua = SaleRun.objects.get(strategy="lua")
    assert lua.status == SaleRun.Status.DONE and lua.oversold == 0 and lua.accepted_units == 10
    # The batch's report went where the worker's FLASHSALE_REPORTS_DIR says, and parses.
    report = tmp_path / lua.batch
    assert {"runs.csv", "runs.json", "report.html"} <= {path.name for path in report.iterdir()}
    assert [run["strategy"] for run in json.loads((report / "runs.json").read_text())["runs"]] == [
        "baseline",
        "lua",
    ]


def test_a_batch_delivered_again_is_not_run_again():
    from loadtest.tasks import run_load_batch_task

    _batch("b-again")
    requested = {"strategies": ["lua"], "stock": 5, "users": 2, "spawn_rate": 2, "duration": 3}
    assert run_load_batch_task.run(requested, "b-again") == ""
    assert SaleRun.objects.filter(batch="b-again").count() == 3


@pytest.mark.parametrize("run", ["\u00b2", "\u0663", "1" * 19, "-1", "abc", "1\x00"])
def test_a_run_id_that_is_not_one_is_a_clear_400(staff_client, run):
    runs = _batch("only")
    response = staff_client.get("/admin/compare/", {"run": [runs[0].pk, run]})
    assert response.status_code == 400
    assert "run must be a load run's id" in response.content.decode()


def test_a_run_left_running_by_a_load_run_that_is_gone_shows_as_interrupted(staff_client):
    # Given a batch whose load run was killed outright mid-run
    left = SaleRun.objects.create(
        batch="killed", strategy="baseline", parameters={"strategies": []}, runner=gone_runner()
    )

    # When the page is looked at
    page = staff_client.get("/admin/compare/?batch=killed")

    # Then the run is over, as interrupted, and a new batch may start
    assert page.status_code == 200
    left.refresh_from_db()
    assert left.status == SaleRun.Status.FAILED
    assert left.error.startswith("interrupted: its load run process")
    assert not SaleRun.objects.filter(status=SaleRun.Status.RUNNING).exists()
