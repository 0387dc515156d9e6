"""granian told to stop while its workers still import the app stops: a worker there has no
handler for SIGTERM yet and loses the signal, and is killed once a checkout's deadline and 2 s
have passed (`granian_command`'s --workers-kill-timeout)."""

from __future__ import annotations

import os
import signal
import subprocess

import psutil

from shop.processes.children import signal_group
from shop.processes.ports import free_port
from shop.processes.servers import PROJECT_DIR, granian_command
from tests.conftest import wait_until
from tests.support import gone


def kill_timeout(command: list[str]) -> str:
    return command[command.index("--workers-kill-timeout") + 1]


def test_a_worker_is_given_a_checkouts_deadline_and_two_seconds_to_stop():
    def command(environ: dict[str, str]) -> list[str]:
        return granian_command(host="127.0.0.1", port=8000, workers=2, threads=8, environ=environ)

    assert kill_timeout(command({})) == "5"
    assert kill_timeout(command({"FLASHSALE_CHECKOUT_DEADLINE_MS": "30000"})) == "32"
    assert kill_timeout(command({"FLASHSALE_CHECKOUT_DEADLINE_MS": "2500"})) == "5"


def test_granian_told_to_stop_while_its_workers_load_the_app_stops(tmp_path):
    loading = tmp_path / "loading"
    loading.mkdir()
    env = {
        **os.environ,
        "HELD_APP_LOADING": str(loading),
        "FLASHSALE_CHECKOUT_DEADLINE_MS": "1000",
    }
    command = granian_command(
        host="127.0.0.1",
        port=free_port(),
        workers=2,
        threads=2,
        environ=env,
        app="tests.shop.held_app:application",
    )
    server = subprocess.Popen(command, cwd=PROJECT_DIR, env=env, start_new_session=True)
    try:
        # Given both of its workers inside the app's import
        assert wait_until(lambda: len(list(loading.iterdir())) == 2, timeout=60)
        workers = [psutil.Process(int(path.name)) for path in loading.iterdir()]

        # When the server is told to stop
        server.send_signal(signal.SIGTERM)

        # Then it stops, in order, and its workers with it (not stopped within a minute: a
        # TimeoutExpired)
        assert server.wait(timeout=60) == 0
        assert all(gone(worker) for worker in workers)
    finally:
        # (a server that did not stop, and its workers, go all the same)
        signal_group(server.pid, signal.SIGKILL)
        server.wait()
