"""Each strategy's units/s held against `lock`'s and the baseline's, measured in the same batch:
printed under the comparison, kept in the reports, shown on the compare page."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User
from django.test import Client

from loadtest.models import SaleRun
from loadtest.report.files import write_report
from loadtest.report.ratios import comparisons, goodput_ratios, round_figures
from loadtest.report.text import rounds_summary, table


def _batch(name: str, goodput: dict[str, float | None], baseline: float | None) -> list[SaleRun]:
    runs = [
        SaleRun(
            batch=name,
            strategy="baseline",
            requests_per_second=baseline,
            status=SaleRun.Status.DONE,
        )
    ]
    for strategy, units in goodput.items():
        runs.append(
            SaleRun(
                batch=name,
                strategy=strategy,
                goodput=units,
                baseline_requests_per_second=baseline,
                status=SaleRun.Status.DONE if units else SaleRun.Status.FAILED,
                audit={"sold_out": True},
            )
        )
    return runs


def test_each_strategy_is_held_against_lock_and_the_baseline_of_its_own_batch():
    # Given a batch with lock, two faster strategies and one whose run failed
    runs = _batch("b1", {"lock": 500, "segmented": 600, "lua": 800, "optimistic": None}, 2000)

    # When the comparison is printed
    text = table(runs)

    # Then one line under the table holds each against lock's units/s and the baseline's
    # requests/s; the failed run and the baseline are in neither
    assert (
        "units/s against lock's 500: segmented 1.20x, lua 1.60x; "
        "against the baseline's 2000 requests/s: lock 0.25x, segmented 0.30x, lua 0.40x"
    ) in text.splitlines()
    lua = next(run for run in runs if run.strategy == "lua")
    assert goodput_ratios(lua, runs) == {"goodput_to_lock": 1.6, "goodput_to_baseline": 0.4}
    assert goodput_ratios(runs[0], runs) == {"goodput_to_lock": None, "goodput_to_baseline": None}


def test_runs_of_several_batches_are_compared_within_their_own_batch():
    # Given two batches: one with lock, one without lock and without a baseline
    first = _batch("b1", {"lock": 400, "lua": 600}, 1000)
    second = _batch("b2", {"lua": 900, "segmented": 300}, None)

    # When compared together
    lines = comparisons(first + second)

    # Then each batch's strategies are held against that batch's lock only, and a batch with
    # nothing to hold them against says nothing
    assert lines == [
        "b1: units/s against lock's 400: lua 1.50x; against the baseline's 1000 requests/s: "
        "lock 0.40x, lua 0.60x"
    ]
    lua_of_b2 = second[1]
    assert goodput_ratios(lua_of_b2, first + second) == {
        "goodput_to_lock": None,
        "goodput_to_baseline": None,
    }


@pytest.mark.django_db
def test_the_reports_and_the_compare_page_carry_the_ratios(tmp_path):
    # Given a recorded batch
    runs = _batch("b-ratios", {"lock": 320, "lua": 640}, 1600)
    for run in runs:
        run.parameters = {"strategies": ["lock", "lua"]}
        run.save()
    line = (
        "units/s against lock's 320: lua 2.00x; against the baseline's 1600 requests/s: "
        "lock 0.20x, lua 0.40x"
    )

    # When its reports are written
    files = write_report(runs, tmp_path)

    # Then the JSON keeps each run's ratios, and the HTML report prints the line
    records = {
        record["strategy"]: record for record in json.loads(files["json"].read_text())["runs"]
    }
    assert records["lua"]["goodput_to_lock"] == 2.0
    assert records["lua"]["goodput_to_baseline"] == 0.4
    assert records["lock"]["goodput_to_lock"] == 1.0
    assert records["baseline"]["goodput_to_lock"] is None
    assert "goodput_to_lock" in files["csv"].read_text().splitlines()[0]
    assert f"<p>{line}</p>" in files["html"].read_text().replace("&#x27;", "'")

    # and staff comparing the batch see the same line under the table
    User.objects.create_user("boss", password="pw-for-tests-only", is_staff=True)
    client = Client()
    client.login(username="boss", password="pw-for-tests-only")
    page = client.get("/admin/compare/?batch=b-ratios").content.decode()
    assert f'<p class="comparison">{line}</p>' in page.replace("&#x27;", "'")


def test_rounds_give_each_strategy_its_median_and_the_ratios_of_medians_round_by_round():
    # Given three rounds, each a batch of its own; lua's run failed in the third
    rounds = [
        _batch("r1", {"lock": 300, "segmented": 450, "lua": 600}, 1500),
        _batch("r2", {"lock": 400, "segmented": 480, "lua": 700}, 1700),
        _batch("r3", {"lock": 350, "segmented": 700, "lua": None}, 1600),
    ]
    rounds[0][3].audit["cpu"] = {"per_unit_ms": {"all": 3.0}}
    rounds[1][3].audit["cpu"] = {"per_unit_ms": {"all": 2.0}}

    # When their figures are summed up
    figures = round_figures(rounds)

    # Then each contender has the median of the rounds it ran in, and every round's figure
    assert figures["batches"] == ["r1", "r2", "r3"]
    assert figures["contenders"]["baseline"]["median"] == 1600
    assert figures["contenders"]["lock"] == {
        "median": 350,
        "rounds": [300, 400, 350],
        "cpu_ms_per_unit": None,
    }
    assert figures["contenders"]["lua"]["median"] == 650  # of the two rounds it sold in
    assert figures["contenders"]["lua"]["rounds"] == [600, 700, None]
    assert figures["contenders"]["lua"]["cpu_ms_per_unit"] == 2.5
    # and each ratio is the ratio of two medians, beside each round's own (none for a failed
    # run)
    lua = figures["against_lock"]["lua"]
    assert lua["ratio"] == pytest.approx(650 / 350)
    assert lua["rounds"] == [pytest.approx(2.0), pytest.approx(1.75), None]
    assert figures["against_lock"]["segmented"]["ratio"] == pytest.approx(480 / 350)
    assert "lock" not in figures["against_lock"]
    assert figures["against_baseline"]["lock"]["rounds"] == [
        pytest.approx(0.2),
        pytest.approx(400 / 1700),
        pytest.approx(350 / 1600),
    ]

    # and the text says the same
    text = "\n".join(rounds_summary(figures))
    assert text.startswith("medians of 3 rounds")
    assert (
        "units/s against lock's median 350 units/s: segmented 1.37x (rounds: 1.50x, 1.20x, "
        "2.00x), lua 1.86x (rounds: 2.00x, 1.75x, -)"
    ) in text.splitlines()
    assert "units/s against the baseline's median 1600 requests/s: lock 0.22x" in text
    lua_row = next(line for line in text.splitlines() if line.startswith("lua "))
    assert lua_row.split() == ["lua", "650", "600,", "700,", "-", "2.50"]


def test_rounds_without_lock_give_no_ratio_against_it():
    figures = round_figures([_batch("r1", {"lua": 600}, 1500), _batch("r2", {"lua": 500}, 1000)])

    assert figures["against_lock"] == {}
    assert figures["against_baseline"]["lua"]["ratio"] == pytest.approx(550 / 1250)
    assert not any("against lock" in line for line in rounds_summary(figures))
