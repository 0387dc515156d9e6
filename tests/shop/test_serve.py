"""`make serve` (`python -m shop.serve`) survives the death of any one of its processes: it
starts the one that died again while the others go on, as compose's `restart:` does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from shop.processes.ports import free_port
from shop.processes.servers import PROJECT_DIR, stop_group
from tests.conftest import answers_ok, server_env, wait_until

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


@pytest.mark.parametrize(
    "marker", ["shop.wsgi:application", "celery -A shop worker", "celery -A shop beat"]
)
def test_serve_starts_a_process_that_died_again(tmp_path, marker):
    # Given `make serve`'s supervisor running the shop, its worker and beat
    port = free_port()
    env = {**os.environ, **server_env(), "FLASHSALE_WORKER_METRICS_PORT": str(free_port())}
    serve = subprocess.Popen(
        [sys.executable, "-m", "shop.serve", "--port", str(port), "--workers", "2"],
        cwd=PROJECT_DIR,
        env=env,
        start_new_session=True,
        stderr=open(tmp_path / "serve.log", "wb"),  # noqa: SIM115 - the child keeps it
    )
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
