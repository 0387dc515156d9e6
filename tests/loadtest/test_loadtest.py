"""Load runs for real: Locust floods a real gunicorn, every run is audited, recorded, reported."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection

from inventory.models import Item, Order
from inventory.services import start_sale
from loadtest.models import SaleRun
from loadtest.runs.locust_driver import LOCUSTFILE
from loadtest.runs.recording import end_orphaned_runs
from loadtest.sandbox import database_name
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import TEST_API_TOKEN, server_env, test_database_url, wait_until
from tests.support.processes import (
    gone_runner,
    processes_carrying,
    started_for_batch,
    this_runner,
)

pytestmark = pytest.mark.django_db(transaction=True)


#: A small sale, a small crowd and a short cap, on a server of two workers.
SMALL = ("--stock", "20", "--users", "8", "--spawn-rate", "60", "--duration", "4",
         "--server-workers", "2")  # fmt: skip


def _load_run(out, *arguments: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`manage.py loadtest` with these arguments, its reports in out."""
    return subprocess.run(
        [sys.executable, "manage.py", "loadtest", *arguments, "--out", str(out)],
        cwd=ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_a_short_load_run_records_audits_and_reports_every_strategy(tmp_path):
    # Given every strategy, a small stock and a crowd that outnumbers it
    # When the load run floods them one after another
    result = _load_run(
        tmp_path,
        "--strategies", "lock,segmented,lua,optimistic,unsafe",
        "--stock", "20", "--users", "12", "--spawn-rate", "60", "--duration", "6",
        "--server-workers", "4", "--unsafe-delay-ms", "20",
    )  # fmt: skip

    # Then it succeeds and prints the comparison
    assert result.returncode == 0, result.stderr[-3000:]
    assert "strategy" in result.stdout and "x HTTP" in result.stdout
    assert "settle p50 ms" in result.stdout
    # and under it each strategy's units/s against lock's and the baseline's, in this batch
    assert re.search(
        r"^units/s against lock's \d+: segmented [\d.]+x, lua [\d.]+x, optimistic [\d.]+x, "
        r"unsafe [\d.]+x; against the baseline's \d+ requests/s: lock [\d.]+x",
        result.stdout,
        re.MULTILINE,
    ), result.stdout
    # and a sale run was recorded for the baseline and each strategy, in one batch
    batch = re.search(r"^batch (\S+):", result.stderr, re.MULTILINE).group(1)
    runs = {run.strategy: run for run in SaleRun.objects.filter(batch=batch)}
    assert set(runs) == {"baseline", "lock", "segmented", "lua", "optimistic", "unsafe"}
    assert all(run.status == SaleRun.Status.DONE for run in runs.values())
    for name in ("lock", "segmented", "lua", "optimistic"):
        run = runs[name]
        assert run.oversold == 0 and run.accepted_units == 20 and run.remaining == 0, name
        assert run.audit["consistent"], run.audit
        assert run.requests > 0 and run.p99_ms is not None and run.history
        assert run.baseline_requests_per_second == runs["baseline"].requests_per_second
        assert run.history[-1]["units_sold"] == 20, run.history[-1]
        # the worker settled every order, and how long each took was measured
        settle = run.audit["settle"]
        assert settle["orders"] == settle["settled"] == 20 and settle["unsettled"] == 0
        assert 0 < run.settle_p50_ms <= run.settle_p99_ms, settle
        assert settle["pending"][-1][1] == 0 and max(n for _, n in settle["pending"]) > 0
    assert runs["unsafe"].oversold > 0, runs["unsafe"].audit
    assert runs["lock"].lock_wait_p99_ms is not None
    # and the report files exist and parse
    records = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert {record["strategy"] for record in records} == set(runs)
    lua = next(record for record in records if record["strategy"] == "lua")
    assert lua["settle_p99_ms"] == runs["lua"].settle_p99_ms
    assert lua["goodput_to_lock"] == pytest.approx(runs["lua"].goodput / runs["lock"].goodput)
    with open(tmp_path / "runs.csv", newline="") as handle:
        assert len(list(csv.DictReader(handle))) == 6
    page = (tmp_path / "report.html").read_text()
    assert page.count("<svg") == 6 and "Units sold over time" in page
    assert "Orders pending, from the opening" in page and "settle p99 ms" in page


def _locust(url: str, sku: str, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", url, "--sku", sku, "-u", "12", "-r", "12", "-t", "4s",
        "--warmup-share", "0", "--only-summary", *extra,
    ]  # fmt: skip
    return subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "FLASHSALE_API_TOKEN": TEST_API_TOKEN},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_locust_audit_fails_a_run_that_oversold(shop_server):
    # Given the unsafe baseline, which oversells under a crowd
    sku = f"unsafe-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=20, strategy="unsafe")

    # When Locust floods it without being told oversell is expected
    result = _locust(shop_server.url, sku)

    # Then its audit turns the oversell into a non-zero exit code
    assert result.returncode == 3, result.stderr[-2000:]
    assert "oversold" in result.stderr and "FAILED" in result.stderr


def test_the_locust_audit_passes_a_safe_run(shop_server):
    sku = f"lua-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=20, strategy="lua")

    result = _locust(shop_server.url, sku)

    assert result.returncode == 0, result.stderr[-2000:]
    assert '"oversold": 0' in result.stderr


def test_the_crowd_looks_an_address_up_in_place_and_a_name_on_gevent_s_threads():
    hosts = ["http://127.0.0.1:8000", "http://[::1]:8000", "http://localhost:8000"]
    # Locust patches the standard library for gevent when imported: in a process of its own,
    # each host on the default resolver to begin with
    script = (
        "import sys, types, gevent\n"
        "from locust import events\n"
        "import loadtest.locustfile\n"
        "hub = gevent.get_hub()\n"
        "for host in sys.argv[1:]:\n"
        "    del hub.resolver\n"
        "    events.init.fire(environment=types.SimpleNamespace(host=host), runner=None,"
        " web_ui=None)\n"
        "    print(type(hub.resolver).__module__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *hosts],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [
        "gevent.resolver.blocking",
        "gevent.resolver.blocking",
        "gevent.resolver.thread",
    ]


@pytest.mark.slow
def test_a_distributed_load_run_uses_several_locust_processes(tmp_path):
    result = _load_run(tmp_path, "--strategies", "lua", *SMALL, "--workers", "2", timeout=180)

    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 workers connected" in (tmp_path / "lua.log").read_text()
    batch = re.search(r"^batch (\S+):", result.stderr, re.MULTILINE).group(1)
    lua = SaleRun.objects.get(batch=batch, strategy="lua")
    assert lua.status == SaleRun.Status.DONE
    assert lua.accepted_units == 20 and lua.oversold == 0 and lua.parameters["workers"] == 2
    # It sold in the load-run database beside the shop's: the shop has its record, not its sale
    # and says how large that database has grown, since nothing prunes it
    assert re.search(r"load-run sandbox: database \S+ \(\d+ (bytes|kB|MB|GB);", result.stderr)
    assert not Item.objects.filter(sku=lua.sku).exists()
    assert not Order.objects.filter(item__sku=lua.sku).exists()
    sandbox_db = database_name(connection.settings_dict["NAME"])
    with psycopg.connect(
        server_env()["DATABASE_URL"].replace(
            f"/{connection.settings_dict['NAME']}", f"/{sandbox_db}", 1
        )
    ) as other:
        sold = other.execute(
            "SELECT count(*), sum(o.qty) FROM inventory_order o"
            " JOIN inventory_item i ON o.sale_id = i.current_sale_id WHERE i.sku = %s",
            [lua.sku],
        ).fetchone()
    assert sold == (20, 20)


def test_a_database_not_migrated_is_a_clear_error_and_nothing_runs():
    # Given a database with no tables at all
    name = f"{connection.settings_dict['NAME']}_unmigrated"
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cursor.execute(f'CREATE DATABASE "{name}"')
    url = urlunsplit(urlsplit(test_database_url())._replace(path=f"/{name}"))
    try:
        # When a load run is asked of it
        result = subprocess.run(
            [sys.executable, "manage.py", "loadtest", "--strategies", "lua"],
            cwd=ROOT,
            env=server_env(DATABASE_URL=url),
            capture_output=True,
            text=True,
            timeout=60,
        )
        # Then it says what to do, and started nothing: no sandbox database beside it
        assert result.returncode == 1, result.stderr[-2000:]
        assert "run `python manage.py migrate` first" in result.stderr
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database_name(name)])
            assert cursor.fetchone() is None
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--rounds", "0"], "--rounds: from 1 to 10"),
        (["--rounds", "11"], "--rounds: from 1 to 10"),
        (["--rounds", "2", "--batch", "20261127-050000-abcd"], "give no --batch"),
    ],
)
def test_bad_rounds_are_refused_and_nothing_runs(arguments, message):
    before = SaleRun.objects.count()

    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("loadtest", "--strategies", "lua", *arguments)

    assert SaleRun.objects.count() == before


@pytest.mark.slow
def test_rounds_run_every_strategy_again_each_round_and_sum_them_up_in_medians(tmp_path):
    # Given two strategies, a small stock and two rounds
    # When the load run runs them
    result = _load_run(tmp_path, "--strategies", "lock,lua", *SMALL, "--rounds", "2")

    # Then each round is a batch of its own, with a baseline and both strategies, each sale
    # sold exactly, and its reports in a folder of its own
    assert result.returncode == 0, result.stderr[-3000:]
    rounds = re.findall(r"^round \d of 2 \(([^)]*)\), batch (\S+):", result.stderr, re.MULTILINE)
    batches = [batch for _, batch in rounds]
    assert len(set(batches)) == 2, result.stderr[-3000:]
    # each round starting one contender further on, so that no contender runs first in every
    # round (a machine speeding up or slowing down would favour it)
    orders = [["baseline", "lock", "lua"], ["lock", "lua", "baseline"]]
    assert [order.split(", ") for order, _ in rounds] == orders
    for number, batch in enumerate(batches, start=1):
        runs = {run.strategy: run for run in SaleRun.objects.filter(batch=batch)}
        assert set(runs) == {"baseline", "lock", "lua"}
        ran = sorted(runs.values(), key=lambda run: run.started_at)
        assert [run.strategy for run in ran] == orders[number - 1]
        for name in ("lock", "lua"):  # held against the baseline of their round, wherever it ran
            assert runs[name].baseline_requests_per_second == runs["baseline"].requests_per_second
        for name in ("lock", "lua"):
            assert runs[name].status == SaleRun.Status.DONE, runs[name].error
            assert runs[name].accepted_units == 20 and runs[name].oversold == 0, name
            assert runs[name].remaining == 0, name
        report = json.loads((tmp_path / f"round-{number}" / "runs.json").read_text())
        assert {record["batch"] for record in report["runs"]} == {batch}
    # and the medians of the rounds are printed and written, beside every round's figures
    figures = json.loads((tmp_path / "rounds.json").read_text())
    assert figures["batches"] == batches
    for name in ("baseline", "lock", "lua"):
        runs = [SaleRun.objects.get(batch=batch, strategy=name) for batch in batches]
        rates = [run.requests_per_second if name == "baseline" else run.goodput for run in runs]
        assert figures["contenders"][name]["rounds"] == pytest.approx(rates)
        assert figures["contenders"][name]["median"] == pytest.approx(sum(rates) / 2)
    lua = figures["against_lock"]["lua"]
    assert lua["ratio"] == pytest.approx(
        figures["contenders"]["lua"]["median"] / figures["contenders"]["lock"]["median"]
    )
    assert "medians of 2 rounds" in result.stdout
    assert re.search(
        r"^units/s against lock's median \d+ units/s: lua [\d.]+x \(rounds: [\d.]+x, [\d.]+x\)$",
        result.stdout,
        re.MULTILINE,
    ), result.stdout


def _flooding(out) -> subprocess.Popen:
    """A load run of `lua` started in the background, once its crowd floods the baseline."""
    process = subprocess.Popen(
        [sys.executable, "manage.py", "loadtest", "--strategies", "lua", "--stock", "100000",
         "--users", "8", "--spawn-rate", "60", "--server-workers", "2", "--out", str(out)],
        cwd=ROOT, env=server_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    crowd = f"{out}/baseline"  # on its Locust's command line (--csv)
    if not wait_until(lambda: processes_carrying(crowd), timeout=90, interval=0.2):
        process.kill()
        raise AssertionError(process.communicate(timeout=30)[1].decode()[-3000:])
    return process


def _batch_of(stderr: bytes) -> str:
    return re.search(r"^batch (\S+):", stderr.decode(), re.MULTILINE).group(1)


@pytest.mark.slow
def test_a_load_run_sent_sigterm_stops_what_it_started_and_says_the_run_was_interrupted(
    tmp_path,
):
    # Given a load run whose server, order worker and crowd are all running
    process = _flooding(tmp_path)

    # When it is sent SIGTERM (a supervisor, a CI timeout)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)

    # Then it exits as a process ended by SIGTERM does, having stopped everything it started
    assert process.returncode == 128 + signal.SIGTERM, stderr.decode()[-3000:]
    batch = _batch_of(stderr)
    assert started_for_batch(batch) == []
    assert processes_carrying(str(tmp_path)) == []
    # and the run under way is recorded as interrupted, not left running
    baseline = SaleRun.objects.get(batch=batch, strategy="baseline")
    assert baseline.status == SaleRun.Status.FAILED and baseline.error == "interrupted"
    assert "baseline: interrupted" in stderr.decode()


@pytest.mark.slow
def test_a_load_run_killed_outright_takes_what_it_started_with_it(tmp_path):
    # Given a load run whose server, order worker and crowd are all running
    process = _flooding(tmp_path)

    # When it is killed with no chance to stop them (SIGKILL, the OOM killer)
    process.kill()
    _, stderr = process.communicate(timeout=30)

    # Then the kernel stops them all in turn: none outlives the run
    assert process.returncode == -signal.SIGKILL
    batch = _batch_of(stderr)
    assert wait_until(lambda: not started_for_batch(batch), timeout=30), started_for_batch(batch)
    assert wait_until(lambda: not processes_carrying(str(tmp_path)), timeout=30)
    # and the run it left running is ended as interrupted once anyone looks (the next load
    # run, the compare page), its worker's task queue deleted
    left = SaleRun.objects.get(batch=batch, strategy="baseline")
    assert left.status == SaleRun.Status.RUNNING and _queue_exists(left.runner["queue"])
    (ended,) = end_orphaned_runs()
    assert ended.batch == batch and ended.strategy == "baseline"
    ended.refresh_from_db()
    assert ended.status == SaleRun.Status.FAILED and ended.finished_at is not None
    assert ended.error.startswith("interrupted: its load run process")
    assert not _queue_exists(ended.runner["queue"])


def _queue_exists(queue: str) -> bool:
    """Whether the broker (Redis, in the tests) still holds the queue: its messages or its
    binding to the exchange of its name."""
    import redis

    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    return bool(broker.exists(queue) or broker.exists(f"_kombu.binding.{queue}"))


def test_only_runs_whose_load_run_process_is_gone_are_ended():
    from kombu import Connection

    from shop import queues

    # Given a run recorded by a process that has since died (its worker's queue still there),
    # one by this live process, one by a process on another host, and one recorded with no
    # runner (before runners were recorded)
    queue = f"flashsale-test-orphan-{uuid.uuid4().hex[:8]}"
    with Connection(settings.CELERY_BROKER_URL) as broker:
        for declaration in queues.declarations(queue):
            declaration(broker.default_channel).declare()
        broker.SimpleQueue(queue).put({"task": "a stale one"})
    orphan = SaleRun.objects.create(batch="orphan", strategy="lua", runner=gone_runner(queue=queue))
    assert _queue_exists(queue)
    alive = SaleRun.objects.create(batch="alive", strategy="lua", runner=this_runner())
    elsewhere = SaleRun.objects.create(
        batch="elsewhere", strategy="lua", runner=gone_runner(host="another-host")
    )
    unknown = SaleRun.objects.create(batch="unknown", strategy="lua")

    # When the orphans are looked for
    ended = end_orphaned_runs()

    # Then only the dead process's run is ended, as interrupted, and its queue deleted
    assert [run.pk for run in ended] == [orphan.pk]
    statuses = dict(SaleRun.objects.values_list("batch", "status"))
    assert statuses == {
        "orphan": SaleRun.Status.FAILED,
        "alive": SaleRun.Status.RUNNING,
        "elsewhere": SaleRun.Status.RUNNING,
        "unknown": SaleRun.Status.RUNNING,
    }
    assert not _queue_exists(queue)
    assert end_orphaned_runs() == []
    assert {alive.pk, elsewhere.pk, unknown.pk} <= set(SaleRun.objects.values_list("pk", flat=True))
