"""Start and stop a real server of the shop (granian, or gunicorn), and its Celery worker, for
floods, the demo and tests.

Each runs in a session of its own (a Ctrl-C typed at the terminal reaches the process that
started it, which stops them in order), and is sent SIGTERM by the kernel if that process dies
without stopping it (killed, or crashed): none outlives its starter."""

from __future__ import annotations

import math
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
from collections.abc import Mapping
from pathlib import Path

from shop.environment import CHECKOUT_DEADLINE_MS, bounded

from .children import die_with_parent, signal_group
from .ports import free_port

PROJECT_DIR = Path(__file__).resolve().parents[2]


def kill_group(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL a child started in a session of its own, and whatever it started, at once: also
    what it left in its group if it died first (a killed server's workers go on serving)."""
    if process is None:
        return
    # While a process is left in the group, the kernel gives its number to no other process.
    signal_group(process.pid, signal.SIGKILL)
    process.wait()


def stop_group(process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM a child started in a session of its own; SIGKILL it after `timeout` seconds. Of
    a child that died first, what it left in its group is killed at once: nothing is left to
    stop it in order."""
    if process is None:
        return
    if process.poll() is not None:
        kill_group(process)
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)


#: The servers the shop can run under (`ShopServer.kind`): granian's WSGI workers (`threads`
#: blocking threads each: the shop's server, docs/decisions/0001), gunicorn's sync workers and
#: gunicorn's gthread workers (`threads` each).
SERVER_KINDS = ("granian", "sync", "gthread")


#: The shop's server as `make serve`, compose and the load runs start it (docs/decisions/0001):
#: granian's WSGI workers, of blocking threads each, so that a worker's checkouts in flight
#: are written together. Two of eight on two cores: fewer, wider workers gather larger batches
#: (docs/decisions/0023-two-workers-of-eight-threads.md).
GRANIAN_WORKERS = 2
GRANIAN_THREADS = 8
#: Where granian's logging is configured (the access log without the health polls).
GRANIAN_LOGGING = "shop/granian_logging.json"


def granian_kill_timeout(environ: Mapping[str, str] = os.environ) -> int:
    """Seconds a granian worker told to stop has to answer what it serves before it is killed:
    a checkout's deadline (FLASHSALE_CHECKOUT_DEADLINE_MS in `environ`) and 2 s more."""
    deadline_ms = bounded("FLASHSALE_CHECKOUT_DEADLINE_MS", *CHECKOUT_DEADLINE_MS, environ=environ)
    return math.ceil(deadline_ms / 1000) + 2


def granian_command(
    *,
    host: str,
    port: int,
    workers: int,
    threads: int,
    uds: Path | None = None,
    environ: Mapping[str, str] = os.environ,
    app: str = "shop.wsgi:application",
) -> list[str]:
    """granian serving `app`: WSGI, `workers` processes of `threads` blocking threads, a worker
    that dies started again at once. On `host`:`port` each worker listens on a socket of its
    own (SO_REUSEPORT); on the unix socket `uds` (behind a proxy) they share one, so a stopped
    worker leaves every new connection to the others
    (docs/decisions/0024-a-shared-socket-behind-the-proxy.md).

    A worker told to stop has a checkout's deadline (FLASHSALE_CHECKOUT_DEADLINE_MS, as
    `environ` sets it for the server) and 2 s more to answer what it serves, then it is killed:
    one still importing the app has no handler for SIGTERM yet and loses the signal, and would
    otherwise keep its server from ever stopping."""
    kill_timeout = granian_kill_timeout(environ)
    # On the shared socket a worker takes a connection only when one of its threads is free
    # (--backpressure), so that one whose threads all wait leaves new ones to the others; a
    # proxy of another user (compose's nginx) may connect to it.
    where = (
        ("--uds", str(uds), "--uds-permissions", "0666", "--backpressure", str(threads))
        if uds is not None
        else ("--host", host, "--port", str(port))
    )
    return [
        *(sys.executable, "-m", "granian", "--interface", "wsgi", "--no-ws"),
        *where,
        *("--workers", str(workers), "--blocking-threads", str(threads)),
        *("--respawn-failed-workers", "--respawn-interval", "0.5"),
        *("--workers-kill-timeout", str(kill_timeout)),
        *("--log-config", GRANIAN_LOGGING),
        app,
    ]


def unix_healthz_status(path: Path, timeout: float = 2) -> int:
    """The status /healthz answers on the unix socket `path` (OSError when nothing answers
    within `timeout` seconds; IndexError or ValueError for an answer that is not HTTP)."""
    with socket.socket(socket.AF_UNIX) as unix:
        unix.settimeout(timeout)
        unix.connect(str(path))
        unix.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        return int(unix.recv(64).split()[1])


class ShopServer:
    """The shop on 127.0.0.1 (by default under granian, as `make serve` runs it), in its own
    process group."""

    def __init__(
        self,
        *,
        env: dict[str, str] | None = None,
        workers: int = GRANIAN_WORKERS,
        port: int | None = None,
        log_path: Path | None = None,
        preload: bool = False,
        kind: str = "granian",
        threads: int = GRANIAN_THREADS,
        uds: Path | None = None,
    ) -> None:
        """preload: import the app once, before the workers fork, so that every worker answers
        as soon as the first does (a measurement must not start while workers still boot);
        gunicorn only. `kind`: one of SERVER_KINDS; `threads`: per worker, where it has any.
        `uds`: granian on this unix socket instead of a port, for a proxy in front of it (as
        compose runs it); `url` is then the proxy's to know."""
        if kind not in SERVER_KINDS:
            raise ValueError(f"unknown server {kind!r}; choose one of {', '.join(SERVER_KINDS)}")
        if uds is not None and kind != "granian":
            raise ValueError("a unix socket is for granian only")
        self.uds = uds
        self.kind = kind
        self.threads = threads
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

    def command(self) -> list[str]:
        """The command line that serves the shop on this server's port."""
        if self.kind == "granian":
            return granian_command(
                host="127.0.0.1",
                port=self.port,
                workers=self.workers,
                threads=self.threads,
                uds=self.uds,
                environ=self.env,
            )
        threaded = (
            ["--worker-class", "gthread", "--threads", str(self.threads)]
            if self.kind == "gthread"
            else []
        )
        return [
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
            *threaded,
            "--timeout",
            "60",
            "--graceful-timeout",
            "5",
            "--log-level",
            "warning",
            *(["--preload"] if self.preload else []),
        ]

    def start(self, timeout: float = 30.0) -> ShopServer:
        command = self.command()
        if self.uds is not None:
            # A socket file a server that died left behind (compose's command removes it too).
            self.uds.unlink(missing_ok=True)
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
                raise RuntimeError(f"{self.kind} exited with {self.process.returncode} at start")
            try:
                if self.healthz_status() == 200:
                    return self
            except (urllib.error.URLError, OSError, IndexError, ValueError):
                pass  # not listening yet, or closed before a whole status line
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.kind} did not answer /healthz within {timeout} s")

    def healthz_status(self) -> int:
        """The status /healthz answers, on the server's port or its unix socket."""
        if self.uds is None:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as response:
                return int(response.status)
        return unix_healthz_status(self.uds)

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
