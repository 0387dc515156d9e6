"""`make serve` (`python -m shop.serve`) survives the death of any one of its processes: it
starts the one that died again while the others go on. When granian's main process dies, its
workers answer the checkouts they hold before they stop: on a port, and on the unix socket
compose's `web` serves its proxy (the same supervisor, the web server alone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from inventory import keys
from inventory.models import Item, Order
from inventory.redis_client import get_redis_client
from inventory.selectors import audit_sale
from inventory.services import start_sale
from loadtest.flood import flood
from shop.processes.ports import free_port
from shop.processes.serve import STOP_TIMEOUT_SECONDS, socket_answers, stop_timeout
from shop.processes.servers import PROJECT_DIR, granian_kill_timeout, stop_group
from tests.conftest import answers_ok, server_env, wait_until
from tests.support import NGINX, gone, nginx_serving, nginx_site, run_in_thread

pytestmark = pytest.mark.django_db(transaction=True)


def _child(serve: subprocess.Popen[bytes], marker: str) -> psutil.Process | None:
    """The child of `serve` whose command line holds `marker`."""
    for child in psutil.Process(serve.pid).children():
        try:
            if marker in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def _serve(tmp_path, port: int, **overrides: object) -> subprocess.Popen[bytes]:
    """`make serve`'s supervisor on `port`, its log in tmp_path/serve.log."""
    env = {
        **os.environ,
        **server_env(**overrides),
        "FLASHSALE_WORKER_METRICS_PORT": str(free_port()),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "shop.serve", "--port", str(port), "--workers", "2"],
        cwd=PROJECT_DIR,
        env=env,
        start_new_session=True,
        stderr=open(tmp_path / "serve.log", "wb"),  # noqa: SIM115 - the child keeps it
    )


@pytest.mark.parametrize(
    "marker", ["shop.wsgi:application", "celery -A shop worker", "celery -A shop beat"]
)
def test_serve_starts_a_process_that_died_again(tmp_path, marker):
    # Given `make serve`'s supervisor running the shop, its worker and beat
    port = free_port()
    serve = _serve(tmp_path, port)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: answers_ok(f"{url}/healthz"), timeout=90)
        assert wait_until(lambda: _child(serve, marker) is not None, timeout=30)
        first = _child(serve, marker)
        assert first is not None

        # When that process is killed (SIGKILL: no goodbye)
        first.send_signal(signal.SIGKILL)

        # Then the supervisor starts it again and goes on serving
        def started_again() -> bool:
            again = _child(serve, marker)
            return again is not None and again.pid != first.pid

        assert wait_until(started_again, timeout=60), (tmp_path / "serve.log").read_text()
        assert wait_until(lambda: answers_ok(f"{url}/healthz"), timeout=60)
        assert serve.poll() is None
        assert "starting it again" in (tmp_path / "serve.log").read_text()
    finally:
        stop_group(serve, timeout=30)
    # and stops cleanly on SIGTERM afterwards
    assert serve.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and answers_ok(f"{url}/healthz"):
        time.sleep(0.1)
    assert not answers_ok(f"{url}/healthz")


#: (strategy, keyed): the first in every run of the suite, the others with -m slow.
IN_FLIGHT = [
    ("lua", False),
    pytest.param("lua", True, marks=pytest.mark.slow),
    pytest.param("segmented", False, marks=pytest.mark.slow),
    pytest.param("segmented", True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("strategy", "keyed"), IN_FLIGHT)
def test_serve_answers_the_checkouts_in_flight_when_granians_main_process_dies(
    tmp_path, strategy, keyed
):
    # Given `make serve` selling a sale whose batches take 1.5 s to write (the lab's hold
    # delay, between a batch's take or locks and its statement)
    sku = f"serve-in-flight-{strategy}-{'keyed' if keyed else 'unkeyed'}"
    start_sale(sku=sku, stock=100, strategy=strategy, name="Checkouts in flight")
    port = free_port()
    serve = _serve(
        tmp_path, port, FLASHSALE_HOLD_DELAY_MS=1500, FLASHSALE_CHECKOUT_DEADLINE_MS=30000
    )
    try:
        _granians_main_dies_with_checkouts_in_flight(
            serve, f"http://127.0.0.1:{port}", sku, tmp_path / "serve.log", keyed=keyed
        )
    finally:
        stop_group(serve, timeout=30)
    assert serve.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]


@pytest.mark.skipif(NGINX is None, reason="no nginx on this machine (make nginx)")
def test_composes_web_answers_the_checkouts_in_flight_when_granians_main_process_dies(tmp_path):
    # Given compose's web command (the supervisor, the web server alone, on the unix socket its
    # proxy shares) behind deploy/nginx.conf, selling a `lua` sale whose batches take 1.5 s
    sku = "compose-in-flight"
    start_sale(sku=sku, stock=100, strategy="lua", name="Checkouts in flight behind nginx")
    socket_path = tmp_path / "web.sock"
    web = yaml.safe_load((PROJECT_DIR / "docker-compose.yml").read_text())["services"]["web"]
    argv = list(web["command"])
    assert argv[:3] == ["python", "-m", "shop.serve"], argv
    argv[argv.index("--uds") + 1] = str(socket_path)
    serve = subprocess.Popen(
        [sys.executable, *argv[1:]],
        cwd=PROJECT_DIR,
        env={
            **os.environ,
            **server_env(FLASHSALE_HOLD_DELAY_MS=1500, FLASHSALE_CHECKOUT_DEADLINE_MS=30000),
        },
        start_new_session=True,
        stderr=open(tmp_path / "serve.log", "wb"),  # noqa: SIM115 - the child keeps it
    )
    try:
        site = nginx_site(f"unix:{socket_path}", port := free_port())
        with nginx_serving(site, tmp_path, port) as url:
            _granians_main_dies_with_checkouts_in_flight(serve, url, sku, tmp_path / "serve.log")
            # and the new server serves the socket's path, the proxy's one upstream
            assert socket_answers(socket_path)
            assert not socket_path.with_name("web.sock.next").exists()
    finally:
        stop_group(serve, timeout=30)
    assert serve.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    # the web server alone: no Celery worker or beat was started
    assert "Celery" not in (tmp_path / "serve.log").read_text()


def _in_flight(sku: str) -> bool:
    """Whether a batch of sku's checkouts is being written: `lua`'s units taken from Redis,
    or a `segmented` shard's lock held."""
    item = Item.objects.get(sku=sku)
    if item.strategy == "segmented":
        return bool(get_redis_client().exists(*keys.shard_locks(item)))
    return audit_sale(sku)["redis_stock"] < 100


def _granians_main_dies_with_checkouts_in_flight(
    serve: subprocess.Popen[bytes], url: str, sku: str, log: Path, *, keyed: bool = False
) -> None:
    """The shop at `url`, served by `serve`'s granian, sells 8 units of `sku` (100 in stock,
    each batch held 1.5 s) while granian's main process is SIGKILLed and /healthz is polled:
    every checkout answered 201 with its order, nothing oversold, the server started again, the
    old workers gone once the new ones serve, /healthz answered throughout. `keyed`: each
    checkout with an idempotency key of its own."""
    buyers = 8
    probed = threading.Event()
    try:
        assert wait_until(lambda: answers_ok(f"{url}/healthz"), timeout=90), log.read_text()
        assert wait_until(lambda: _child(serve, "shop.wsgi:application") is not None, timeout=30)
        main = _child(serve, "shop.wsgi:application")
        assert main is not None
        old_workers = main.children()
        assert old_workers

        # When checkouts are in flight (a batch has taken its units and not yet written them)
        flooding, outcome = run_in_thread(
            lambda: flood(url, sku, attempts=buyers, concurrency=buyers, timeout=60, keyed=keyed)
        )
        assert wait_until(lambda: _in_flight(sku), timeout=30)
        # and granian's main process is killed (SIGKILL: no goodbye) while /healthz is polled
        probes: list[bool] = []

        def probe() -> None:
            while not probed.is_set():
                probes.append(answers_ok(f"{url}/healthz"))

        prober = threading.Thread(target=probe, daemon=True)
        main.send_signal(signal.SIGKILL)
        prober.start()

        # Then every checkout is answered, each a sale with its order: none was dropped
        flooding.join(120)
        assert "error" not in outcome, outcome.get("error")
        result = outcome["result"]
        assert result.transport_failures == 0
        assert result.statuses == {201: buyers}, result.statuses
        placed = Order.objects.filter(public_id__in=result.order_ids).count()
        assert placed == buyers
        audit = audit_sale(sku)
        assert audit["oversold"] == 0 and audit["accepted_units"] == buyers, audit

        # and the server was started again, its old workers gone once the new ones serve
        def started_again() -> bool:
            again = _child(serve, "shop.wsgi:application")
            return again is not None and again.pid != main.pid

        assert wait_until(started_again, timeout=60), log.read_text()
        assert wait_until(lambda: all(gone(worker) for worker in old_workers), timeout=60), (
            log.read_text()
        )
        # and /healthz answered throughout: the old workers served until the new ones did
        probed.set()
        prober.join(10)
        assert probes and all(probes), f"{probes.count(False)} of {len(probes)} probes unanswered"
        assert answers_ok(f"{url}/healthz")
        assert serve.poll() is None
        assert "its workers serve meanwhile" in log.read_text()
    finally:
        probed.set()


def test_a_stop_outwaits_granians_workers_whatever_the_checkout_deadline():
    # granian's workers, told to stop, have a checkout's deadline and 2 s to answer what they
    # hold; the supervisor waits at least 15 s, and 3 s longer than they may take
    for deadline_ms, expected in (("3000", 15.0), ("12000", 17.0), ("60000", 65.0)):
        environ = {"FLASHSALE_CHECKOUT_DEADLINE_MS": deadline_ms}
        assert stop_timeout(environ) == expected
        assert stop_timeout(environ) > granian_kill_timeout(environ)
    assert stop_timeout({}) == STOP_TIMEOUT_SECONDS


def test_serve_refuses_a_checkout_deadline_out_of_bounds_at_start(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "shop.serve", "--port", str(free_port())],
        cwd=PROJECT_DIR,
        env={**os.environ, **server_env(), "FLASHSALE_CHECKOUT_DEADLINE_MS": "60001"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "flashsale cannot serve: FLASHSALE_CHECKOUT_DEADLINE_MS must be from 100 to 60000, "
        "not 60001"
    )


@pytest.mark.slow
def test_a_stop_answers_a_checkout_held_longer_than_fifteen_seconds(tmp_path):
    # Given `make serve` with a 30 s checkout deadline, selling a `lua` sale whose batches
    # take 17 s to write (the lab's hold delay), longer than a stop's least wait of 15 s
    sku = "serve-long-stop"
    start_sale(sku=sku, stock=10, strategy="lua", name="A checkout held past 15 s")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = _serve(
        tmp_path, port, FLASHSALE_HOLD_DELAY_MS=17_000, FLASHSALE_CHECKOUT_DEADLINE_MS=30_000
    )
    try:
        assert wait_until(lambda: answers_ok(f"{url}/healthz"), timeout=90)
        # and a checkout in flight (its units taken, its statement not yet sent)
        buying, outcome = run_in_thread(
            lambda: flood(url, sku, attempts=1, concurrency=1, timeout=60)
        )
        assert wait_until(lambda: audit_sale(sku)["redis_stock"] < 10, timeout=30)

        # When the supervisor is told to stop
        serve.send_signal(signal.SIGTERM)

        # Then the checkout is answered 201 with its order, and the supervisor stops cleanly
        buying.join(60)
        assert "error" not in outcome, outcome.get("error")
        result = outcome["result"]
        assert result.statuses == {201: 1}, (result.statuses, (tmp_path / "serve.log").read_text())
        assert Order.objects.filter(public_id__in=result.order_ids).count() == 1
        assert serve.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        assert "did not stop within" not in (tmp_path / "serve.log").read_text()
    finally:
        stop_group(serve, timeout=60)
    assert audit_sale(sku)["consistent"]
