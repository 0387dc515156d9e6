"""Which gunicorn worker classes the shop runs on: gunicorn's sync (the default) and gthread
serve it, gevent is refused at start with a clear error (docs/operations.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests

from shop.processes.ports import free_port
from shop.processes.servers import PROJECT_DIR as ROOT
from shop.processes.servers import stop_group
from tests.conftest import answers_ok, server_env, wait_until


def _gunicorn(port: int, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "gunicorn", "shop.wsgi:application",
        "--config", "python:shop.gunicorn_conf", "--bind", f"127.0.0.1:{port}",
        "--graceful-timeout", "5", *options,
    ]  # fmt: skip


def test_gevent_workers_are_refused_before_any_worker_starts(tmp_path):
    # Given the shop's gunicorn config asked for gevent's workers
    port = free_port()
    env = {**os.environ, **server_env(), "TMPDIR": str(tmp_path)}
    # When it starts
    result = subprocess.run(
        _gunicorn(port, "--worker-class", "gevent", "--workers", "1"),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # Then it exits at once with an error that says why and what to run instead
    assert result.returncode == 1, result.stderr[-2000:]
    assert "GeventWorker is not supported" in result.stderr
    assert "sync workers" in result.stderr and "gthread" in result.stderr
    # and it served nothing and left nothing behind
    assert not answers_ok(f"http://127.0.0.1:{port}/healthz")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "options",
    [(), ("--worker-class", "sync"), ("--worker-class", "gthread", "--threads", "2")],
)
def test_sync_and_gthread_workers_serve_the_shop(options):
    # Given the shop's gunicorn with its default workers, sync named, or gthread
    port = free_port()
    process = subprocess.Popen(
        _gunicorn(port, "--workers", "1", *options),
        cwd=ROOT, env={**os.environ, **server_env()}, start_new_session=True,
    )  # fmt: skip
    try:
        # Then it answers /healthz, its database and Redis reachable
        assert wait_until(lambda: answers_ok(f"http://127.0.0.1:{port}/healthz"), timeout=30)
        health = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
        assert health["database"] == "ok" and health["redis"] == "ok"
    finally:
        stop_group(process, timeout=30)
