"""The admin's "Pitfall lab" page: staff only, a scenario started from it runs on a Celery worker,
and its result is drawn as a timeline (one lane per client, the double grant in red)."""

from __future__ import annotations

import base64
import json

import pytest
from django.contrib.auth.models import User
from django.test import Client

from inventory.redis_client import get_redis_client
from pitfalls import lab
from pitfalls.models import PitfallRun
from pitfalls.scenarios import SCENARIOS
from pitfalls.tasks import run_pitfall_task
from shop import queues
from shop.processes.servers import CeleryWorker
from tests.conftest import TASK_QUEUE, server_env, wait_until

PAGE = "/admin/pitfalls/"


def _user(username: str, *, staff: bool) -> Client:
    User.objects.create_user(username, password="pw-for-tests-only", is_staff=staff)
    client = Client()
    client.login(username=username, password="pw-for-tests-only")
    return client


@pytest.mark.django_db
def test_anyone_but_staff_is_sent_to_the_login_page():
    for client in (Client(), _user("buyer", staff=False)):
        for response in (client.get(PAGE), client.post(PAGE, {"scenario": "get-del-race"})):
            assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert PitfallRun.objects.count() == 0


@pytest.mark.django_db
def test_staff_see_every_scenario_with_its_explanation_and_the_link_on_the_admin_home():
    staff = _user("staff", staff=True)
    page = staff.get(PAGE).content.decode()
    for scenario in SCENARIOS.values():
        assert f'id="scenario-{scenario.name}"' in page
        assert f'aria-label="Run {scenario.name}"' in page
    assert "stale writes accepted" in page and "SIGSTOP" in page
    assert 'href="/admin/pitfalls/"' in staff.get("/admin/").content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("scenario", ["", "no-such-thing", "get-del-race;drop", "x" * 200])
def test_an_unknown_scenario_is_a_clear_400_and_queues_nothing(scenario):
    response = _user("staff", staff=True).post(PAGE, {"scenario": scenario})
    assert response.status_code == 400 and "no scenario" in response.content.decode()
    assert PitfallRun.objects.count() == 0


@pytest.mark.django_db
def test_a_get_or_another_method_starts_nothing():
    staff = _user("staff", staff=True)
    response = staff.get(PAGE, {"scenario": "get-del-race"})
    assert response.status_code == 400 and "a GET runs nothing" in response.content.decode()
    for method in (staff.put, staff.delete):
        response = method(PAGE, "scenario=get-del-race")
        assert response.status_code == 405 and response["Allow"] == "GET, POST"
    assert PitfallRun.objects.count() == 0


@pytest.mark.django_db
def test_a_post_records_a_queued_run_and_sends_its_task_to_the_maintenance_queue(
    django_capture_on_commit_callbacks,
):
    broker = get_redis_client()
    maintenance = queues.maintenance(TASK_QUEUE)
    before = broker.llen(maintenance)

    # When staff start get-del-race, the run is recorded queued
    with django_capture_on_commit_callbacks(execute=True) as sent:
        response = _user("staff", staff=True).post(PAGE, {"scenario": "get-del-race"})
    run = PitfallRun.objects.get()
    assert (run.scenario, run.status, run.result) == ("get-del-race", "queued", None)
    assert response.status_code == 302 and response["Location"].endswith(f"?run={run.pk}")

    # and its task is sent once the run is committed, on the maintenance queue, with its id
    assert len(sent) == 1 and broker.llen(maintenance) == before + 1
    message = broker.lindex(maintenance, 0)
    broker.lrem(maintenance, 1, message)  # no worker of a later test is to run it
    envelope = json.loads(message)
    assert envelope["headers"]["task"] == "pitfalls.tasks.run_pitfall_task"
    args, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
    assert (args, kwargs) == ([run.pk], {})


@pytest.mark.django_db
def test_a_scenario_that_gives_no_result_fails_its_run_with_the_reason():
    # (the page refuses an unknown name: this one stands for a command that fails)
    run = PitfallRun.objects.create(scenario="no-such-scenario")
    assert run_pitfall_task.run(run.pk) == "failed"
    run.refresh_from_db()
    assert run.status == PitfallRun.Status.FAILED and run.result is None
    assert run.started_at <= run.finished_at
    assert "exited 1 without a result" in run.error and "no scenario" in run.error


@pytest.mark.django_db
@pytest.mark.parametrize("run", ["abc", "-1", "1" * 19, "\u0663"])
def test_a_run_id_that_is_not_one_is_a_clear_400(run):
    response = _user("staff", staff=True).get(PAGE, {"run": run})
    assert response.status_code == 400 and "run must be" in response.content.decode()
    assert _user("other", staff=True).get(PAGE, {"run": "12345"}).status_code == 400


@pytest.mark.django_db
def test_a_run_not_queued_is_not_run_again():
    done = PitfallRun.objects.create(scenario="get-del-race", status=PitfallRun.Status.DONE)
    assert run_pitfall_task.run(done.pk) == ""
    done.refresh_from_db()
    assert done.status == PitfallRun.Status.DONE and done.result is None


@pytest.mark.django_db
def test_a_finished_run_is_drawn_with_its_verdict_and_numbers():
    result = lab.run("expiry-mid-work").as_dict()
    run = PitfallRun.objects.create(
        scenario="expiry-mid-work", status=PitfallRun.Status.DONE, result=result
    )
    page = _user("staff", staff=True).get(PAGE, {"run": run.pk}).content.decode()
    assert 'id="verdict" class="verdict-pass">pass<' in page
    assert page.count('class="timeline"') == 2
    naive = page[page.index('id="variant-naive"') : page.index('id="variant-fixed"')]
    fixed = page[page.index('id="variant-fixed"') :]
    assert 'data-client="A"' in naive and 'data-client="B"' in naive
    assert 'class="overlap"' in naive  # the double grant
    assert 'class="overlap"' not in fixed
    assert '<dd class="damage">1</dd>' in naive and '<dd class="damage">0</dd>' in fixed


@pytest.mark.django_db(transaction=True)
def test_a_scenario_started_from_the_page_runs_on_a_worker_and_is_drawn():
    staff = _user("staff", staff=True)
    worker = CeleryWorker(server_env(), concurrency=1).start()
    try:
        response = staff.post(PAGE, {"scenario": "foreign-release"})
        assert response.status_code == 302 and "?run=" in response["Location"]
        run = PitfallRun.objects.get()
        waiting = staff.get(response["Location"]).content.decode()
        assert 'http-equiv="refresh"' in waiting and "foreign-release is" in waiting
        assert wait_until(lambda: PitfallRun.objects.get().finished, timeout=120, interval=0.5), (
            PitfallRun.objects.get().status
        )
    finally:
        worker.stop()
    run.refresh_from_db()
    assert run.status == PitfallRun.Status.DONE, run.error
    assert run.result["verdict"] == "pass" and run.result["naive"]["damage"] == 1
    page = staff.get(response["Location"]).content.decode()
    assert 'http-equiv="refresh"' not in page and 'class="overlap"' in page
