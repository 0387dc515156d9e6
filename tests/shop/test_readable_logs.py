"""Long commands print their progress and result, not the noise they expect: `make serve`'s log
shows the requests and problems, not beat's timers or the health polls; the pitfall lab prints a
line per scenario and its table, not the expiries a scenario forces."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid

import pytest
import requests

from inventory.models import Item
from inventory.services import start_sale
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_make_serve_logs_requests_not_beat_s_timers_or_health_polls(tmp_path):
    # Given a sale whose item row the reconciler will find wrong, and beat's sweeper and
    # reconciler due every second
    sku = f"logs-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=5, strategy="optimistic")
    Item.objects.filter(sku=sku).update(stock=2)
    port = _free_port()
    env = {
        **os.environ,
        **server_env(
            FLASHSALE_SWEEP_SECONDS=1,
            FLASHSALE_RECONCILE_SECONDS=1,
            FLASHSALE_WORKER_METRICS_PORT=0,
        ),
    }
    log = tmp_path / "serve.log"

    # When the shop is served as `make serve` serves it, polled for health and asked for a page
    with open(log, "wb") as output:
        serve = subprocess.Popen(
            [sys.executable, "-m", "shop.serve", "--port", str(port), "--workers", "1"],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        assert wait_until(
            lambda: "flashsale is serving at" in log.read_text(errors="replace"), timeout=90
        ), log.read_text(errors="replace")[-3000:]
        url = f"http://127.0.0.1:{port}"
        for _ in range(3):
            assert requests.get(f"{url}/healthz", timeout=10).status_code == 200
        assert requests.get(f"{url}/", timeout=10).status_code == 200
        # and beat has had the worker run the reconciler (it put the item row right)
        assert wait_until(lambda: Item.objects.get(sku=sku).stock == 5, timeout=60)
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
    text = log.read_text(errors="replace")

    # Then its log shows the page asked for, and neither the health polls nor beat's tasks
    assert '"GET / HTTP/1.1" 200' in text, text[-3000:]
    assert "GET /healthz" not in text
    assert "Sending due task" not in text
    assert "reconcile_sales_task" not in text and "sweep_orders_task" not in text


def _pitfall(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "pitfall", *arguments],
        cwd=ROOT,
        env={**os.environ, **server_env()},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_the_lab_prints_its_progress_and_table_not_the_expiries_it_forces():
    # When trust-the-lock runs, whose locks expire under their holders by design
    quiet = _pitfall("run", "trust-the-lock")

    # Then it says what it runs and gives its table, and no line of what it forced
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "running trust-the-lock ..." in quiet.stderr
    assert quiet.stdout.splitlines()[0].split() == [
        "scenario",
        "measure",
        "naive",
        "fixed",
        "verdict",
    ]
    assert "had expired before release" not in quiet.stderr + quiet.stdout
    assert not [line for line in quiet.stderr.splitlines() if " INFO " in line]

    # and asked for more, it shows them
    loud = _pitfall("-v", "2", "run", "trust-the-lock")
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "had expired before release" in loud.stderr
