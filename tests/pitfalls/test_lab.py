"""The pitfall lab on real Redis servers of its own: every naive variant shows its damage, every
fixed one none (a cost scenario: 3x cheaper), the same verdicts run after run, and the command
says what is wrong with what it is asked."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from pitfalls import lab
from pitfalls.scenarios import ARTICLES, SCENARIOS
from pitfalls.timeline import build
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env

RUNS = 3

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.slow
def test_every_scenario_shows_the_damage_naively_and_none_the_shop_s_way_run_after_run():
    verdicts = []
    for _ in range(RUNS):
        results = [lab.run(name) for name in SCENARIOS]
        verdicts.append({result.scenario.name: result.verdict for result in results})
        for result in results:
            context = (result.scenario.name, result.naive.details, result.fixed.details)
            if result.scenario.kind == "damage":
                assert result.naive.damage > 0 and result.fixed.damage == 0, context
            else:
                assert result.fixed.damage <= result.naive.damage / 3, context
            assert result.passed, context
    assert verdicts == [dict.fromkeys(SCENARIOS, "pass")] * RUNS


def test_a_run_tells_who_held_the_lock_when():
    result = lab.run("expiry-mid-work")
    naive = [(event.client, event.what) for event in result.naive.timeline]
    # A took the lock, B took it too while A still worked, A found its lock gone
    assert naive.index(("A", "acquired")) < naive.index(("B", "acquired"))
    assert naive.index(("B", "acquired")) < naive.index(("A", "released"))
    assert ("A", "lost") in naive
    fixed = [(event.client, event.what) for event in result.fixed.timeline]
    assert fixed.index(("A", "released")) < fixed.index(("B", "acquired"))
    assert result.naive.details["most_holders"] == 2 and result.fixed.details["most_holders"] == 1


def test_a_failover_grants_the_lock_twice_naively_and_neither_of_the_shop_s_fixes_does():
    result = lab.run("failover-loses-lock")

    # Naively: A took the lock on the primary, the primary died, its promoted replica granted
    # the lock to B while A still believed it held it
    naive = [(event.client, event.what) for event in result.naive.timeline]
    assert naive.index(("A", "acquired")) < naive.index(("primary", "died"))
    assert naive.index(("replica", "promoted")) < naive.index(("B", "acquired"))
    assert result.naive.details["most_holders"] == 2
    assert build(result.naive.as_dict()["timeline"]).overlaps != []

    # The shop's way, first fix: the WAITed acquire refused A, so B held the lock alone
    fixed = [(event.client, event.what) for event in result.fixed.timeline]
    quorum_starts = fixed.index(("replica 1", "cut off"))
    waited, quorum = fixed[:quorum_starts], fixed[quorum_starts:]
    assert ("A", "acquired") not in waited
    assert waited.index(("A", "refused")) < waited.index(("primary", "died"))
    assert waited.index(("replica", "promoted")) < waited.index(("B", "acquired"))
    # second fix: the quorum lock outlived master 1's failover; B was refused until A released
    assert quorum == [
        ("replica 1", "cut off"),
        ("A", "acquired"),
        ("master 1", "died"),
        ("replica 1", "promoted"),
        ("B", "refused"),
        ("A", "released"),
        ("B", "acquired"),
        ("B", "released"),
    ]
    details = result.fixed.details
    assert details["most_holders_waiting_for_the_replica"] == 1
    assert details["most_holders_on_the_quorum"] == 1
    assert details["masters_holding_a_after_the_failover"] == 2
    assert details["b_granted_once_a_released"] is True
    assert details["quorum_fences"] == [1, 2]
    assert result.fixed.damage == 0 and details["most_holders"] == 1
    assert build(result.fixed.as_dict()["timeline"]).overlaps == []


@pytest.mark.embedded_smoke
def test_pitfall_run_prints_the_table_and_json_and_exits_0_when_every_verdict_passes():
    command = [sys.executable, "manage.py", "pitfall", "run", "get-del-race"]
    table = subprocess.run(command, cwd=ROOT, env=server_env(), capture_output=True, text=True)
    assert table.returncode == 0, table.stderr
    assert "get-del-race" in table.stdout and "pass" in table.stdout
    assert ARTICLES["pitfalls"] in table.stdout
    as_json = subprocess.run(
        [*command, "--json"], cwd=ROOT, env=server_env(), capture_output=True, text=True
    )
    (result,) = json.loads(as_json.stdout)["results"]
    assert result["scenario"] == "get-del-race" and result["verdict"] == "pass"
    assert result["naive"]["damage"] == 1 and result["fixed"]["damage"] == 0
    assert {"at", "client", "what", "detail"} <= set(result["naive"]["timeline"][0])


def test_a_scenario_that_sells_does_so_in_the_load_run_sandbox_not_the_shop_s_database():
    from inventory.models import Item

    command = [sys.executable, "manage.py", "pitfall", "run", "redis-down", "--json"]
    run = subprocess.run(command, cwd=ROOT, env=server_env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "load-run sandbox" in run.stderr
    (result,) = json.loads(run.stdout)["results"]
    assert result["naive"]["damage"] == 10 and result["fixed"]["damage"] == 0
    assert result["fixed"]["details"]["served_by_the_fallback"] == 10
    for variant in ("naive", "fixed"):
        assert not Item.objects.filter(sku=result[variant]["details"]["sku"]).exists()


def test_pitfall_list_names_every_scenario_and_its_article():
    from io import StringIO

    out = StringIO()
    call_command("pitfall", "list", stdout=out)
    for scenario in SCENARIOS.values():
        assert scenario.name in out.getvalue()
        assert ARTICLES[scenario.article] in out.getvalue()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["no-such-scenario"], "no scenario 'no-such-scenario'"),
        (["get-del-race", "--all"], "not both"),
        ([], "name a scenario"),
    ],
)
def test_pitfall_run_says_what_is_wrong_and_runs_nothing(arguments, message, monkeypatch):
    ran = []
    monkeypatch.setattr(lab, "run", ran.append)
    with pytest.raises(CommandError, match=message):
        call_command("pitfall", "run", *arguments)
    assert ran == []


def test_the_naive_code_is_reachable_from_the_lab_only():
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if {"pitfalls", "tests"} & set(parts) or any(part.startswith(".") for part in parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [alias.name for alias in node.names]
                assert not any(name.startswith("pitfalls") for name in names), Path(path)
