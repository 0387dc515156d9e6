"""Start and stop a real gunicorn serving the shop, its Celery worker and its sale writer, for
floods, the demo and tests.

Each runs in a session of its own (a Ctrl-C typed at the terminal reaches the process that
started it, which stops them in order), and is sent SIGTERM by the kernel if that process dies
without stopping it (killed, or crashed): none outlives its starter."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from .devservices import die_with_parent
from .ports import free_port

PROJECT_DIR = Path(__file__).resolve().parents[2]


def kill_group(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL a child started in a session of its own, and whatever it started, at once."""
    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def stop_group(process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM a child started in a session of its own; SIGKILL it after `timeout` seconds."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)


class ShopServer:
    """gunicorn `shop.wsgi:application` on 127.0.0.1, sync workers, in its own process group."""

    def __init__(
        self,
        *,
        env: dict[str, str] | None = None,
        workers: int = 8,
        port: int | None = None,
        log_path: Path | None = None,
        preload: bool = False,
    ) -> None:
        """preload: import the app once, before the workers fork, so that every worker answers
        as soon as the first does (a measurement must not start while workers still boot)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {})}
        if not self.env.get("DJANGO_SECRET_KEY"):
            # A load run's own server: its sessions live as long as it does.
            self.env["DJANGO_SECRET_KEY"] = secrets.token_urlsafe(50)
        self.workers = workers
        self.log_path = log_path
        self.preload = preload
        self.process: subprocess.Popen[bytes] | None = None
        # Its workers' metrics, summed at each scrape (`shop.gunicorn_conf`): in a directory this
        # object makes and removes, whatever becomes of the server, unless one is given.
        self.metrics_dir: Path | None = None
        if not self.env.get("PROMETHEUS_MULTIPROC_DIR"):
            self.metrics_dir = Path(tempfile.mkdtemp(prefix="flashsale-metrics-"))
            self.env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)

    def start(self, timeout: float = 30.0) -> ShopServer:
        command = [
            sys.executable,
            "-m",
            "gunicorn",
            "shop.wsgi:application",
            "--config",
            "python:shop.gunicorn_conf",
            "--bind",
            f"127.0.0.1:{self.port}",
            "--workers",
            str(self.workers),
            "--timeout",
            "60",
            "--graceful-timeout",
            "5",
            "--log-level",
            "warning",
            *(["--preload"] if self.preload else []),
        ]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            command,
            cwd=PROJECT_DIR,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT if self.log_path else None,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.process.returncode} at start")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gunicorn did not answer /healthz within {timeout} s")

    def stop(self) -> None:
        stop_group(self.process, timeout=10)
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def __enter__(self) -> ShopServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class CeleryWorker:
    """A real `celery -A shop worker` process, in its own process group."""

    def __init__(
        self,
        env: dict[str, str],
        concurrency: int | None = None,
        log_path: Path | None = None,
        loglevel: str = "warning",
    ) -> None:
        self.loglevel = loglevel
        self.env = {**os.environ, **env}
        self.concurrency = concurrency
        self.log_path = log_path
        self.hostname = f"flashsale-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> CeleryWorker:
        command = [
            sys.executable, "-m", "celery", "-A", "shop", "worker",
            "--loglevel", self.loglevel,
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--hostname", self.hostname,
        ]  # fmt: skip
        if self.concurrency is not None:
            # The pool and its size come from settings (CELERY_WORKER_POOL/_CONCURRENCY).
            command += ["--concurrency", str(self.concurrency)]
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self.process = subprocess.Popen(
            command,
            cwd=PROJECT_DIR,
            env=self.env,
            start_new_session=True,
            preexec_fn=die_with_parent,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
        )
        from celery import Celery

        # A bare app on the worker's broker: the project's app may be on another one.
        broker = self.env.get("CELERY_BROKER_URL") or self.env.get("REDIS_URL")
        probe = Celery(broker=broker or "redis://127.0.0.1:6379/0", set_as_current=False)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"celery worker exited with {self.process.returncode}")
                replies = probe.control.ping(destination=[self.hostname], timeout=0.5)
                if any(self.hostname in reply for reply in replies):
                    return self
        finally:
            probe.close()
        self.kill()
        raise RuntimeError("celery worker did not answer a ping in time")

    def kill(self) -> None:
        """SIGKILL the worker and its pool processes at once, as a crash would."""
        kill_group(self.process)

    def stop(self) -> None:
        stop_group(self.process, timeout=15)


class SaleWriter:
    """A real `manage.py sale writer` process on a unix socket of its own, in its own process
    group: give `env()` to the web processes that are to send it their `lua` sales."""

    def __init__(self, env: dict[str, str], log_path: Path | None = None) -> None:
        self.path = os.path.join(tempfile.gettempdir(), f"flashsale-writer-{uuid.uuid4().hex}.sock")
        self.env_vars = {**os.environ, **env, "FLASHSALE_SALE_WRITER": self.path}
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """What the web processes need to send their sales here."""
        return {"FLASHSALE_SALE_WRITER": self.path}

    def start(self, timeout: float = 30.0) -> SaleWriter:
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", "sale", "writer", "--socket", self.path],
            cwd=PROJECT_DIR,
            env=self.env_vars,
            start_new_session=True,
            preexec_fn=die_with_parent,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the sale writer exited with {self.process.returncode}")
            if self.answers():
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"the sale writer did not answer on {self.path} in time")

    def answers(self) -> bool:
        """Whether it answers on its socket (with its database connection open)."""
        from inventory.writer import writer_stats

        try:
            return writer_stats(self.path, timeout=2)["backend_pid"] is not None
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL it, as a crash would: what it took and had not written stays taken."""
        kill_group(self.process)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def stop(self) -> None:
        """SIGTERM: it writes what it has taken, answers, and exits."""
        stop_group(self.process, timeout=15)
