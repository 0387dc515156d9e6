"""What `make serve` runs (inside shop.devservices): migrate, then the web server (granian, as
docs/decisions/0001 chose it), a Celery worker and Celery beat (the order sweeper and
reconciler). With --web-only, the web server alone (compose's `web`, beside its own worker and
beat services); with --uds, on a unix socket its workers share, behind a proxy.

Usage: python -m shop.serve [--host 127.0.0.1] [--port 8000 | --uds PATH] [--workers 2]
                            [--web-only]

Only one may run per checkout: it holds an exclusive lock on .data/serve.lock (which names its
pid and address) and checks the port is free before starting anything. Ctrl-C or SIGTERM stops
them all and exits 0. A process that dies on its own is started again while the others go on;
one that keeps dying (more than RESTART_LIMIT times in RESTART_WINDOW seconds) stops them all,
with a non-zero exit status. A dead granian's workers serve until the new server answers, then
answer what they hold and exit (`Retiring`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil
from django.core.exceptions import ImproperlyConfigured

from .children import die_with_parent, exit_status, group_alive, signal_group
from .embedded import ROOT
from .servers import (
    GRANIAN_THREADS,
    GRANIAN_WORKERS,
    granian_command,
    granian_kill_timeout,
    unix_healthz_status,
)

LOCK_PATH = ROOT / ".data" / "serve.lock"
METRICS_DIR = ROOT / ".data" / "metrics"
#: How long a stop waits for the children before killing them, at least (`stop_timeout`).
STOP_TIMEOUT_SECONDS = 15.0
READY_TIMEOUT_SECONDS = 60.0
#: A child that exits more than RESTART_LIMIT times in RESTART_WINDOW seconds is not started
#: again: the whole server stops, with its exit status.
RESTART_LIMIT = 5
RESTART_WINDOW = 60.0
WEB_SERVER = "the web server (granian)"


def stop_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """How long a stop waits for the children before killing them: STOP_TIMEOUT_SECONDS, or,
    with a checkout deadline above 10 s, long enough for granian's workers to answer the
    checkouts they hold first (its kill timeout and 3 s more)."""
    return max(STOP_TIMEOUT_SECONDS, granian_kill_timeout(environ) + 3.0)


def say(message: str) -> None:
    print(f"flashsale: {message}", file=sys.stderr, flush=True)


def display_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def take_lock(url: str) -> IO[str] | None:
    """Lock .data/serve.lock for the life of this process, or say who holds it."""
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    handle = open(LOCK_PATH, "a+")  # kept open, and locked, until exit
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        pid, _, other_url = handle.read().strip().partition(" ")
        handle.close()
        print(
            f"flashsale is already serving at {other_url or '?'} (pid {pid or '?'}): "
            "stop it with Ctrl-C first",
            file=sys.stderr,
        )
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()} {url}\n")
    handle.flush()
    return handle


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_accepts(host: str, port: int) -> bool:
    target = "127.0.0.1" if host in ("", "0.0.0.0") else ("::1" if host == "::" else host)
    try:
        with socket.create_connection((target, port), timeout=0.5):
            return True
    except OSError:
        return False


def socket_answers(path: Path) -> bool:
    """Whether a worker answers /healthz on the unix socket `path` within 2 s (the kernel
    queues a connection to a socket that listens before any worker takes it)."""
    try:
        unix_healthz_status(path)
    except (OSError, IndexError, ValueError):
        return False
    return True


def listening(main: int, port: int) -> int:
    """How many children of process `main` listen on TCP `port` (granian's workers, each on a
    socket of its own)."""
    count = 0
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(main).children():
            with contextlib.suppress(psutil.Error):
                if any(
                    held.status == psutil.CONN_LISTEN and held.laddr.port == port
                    for held in child.net_connections("tcp")
                ):
                    count += 1
    return count


@dataclass
class Retiring:
    """The workers a dead granian main process left in its process group `group`, serving on
    the port beside the new server's (each worker's socket is its own, SO_REUSEPORT), or on
    the unix socket the new server's takes the place of once it answers. They are asked to
    stop (SIGTERM: granian's workers finish the requests they hold) once the new server's
    workers listen, or READY_TIMEOUT_SECONDS after it was started, and killed `stop_timeout()`
    after that."""

    group: int
    since: float
    stopping_since: float | None = None


class Server:
    def __init__(
        self,
        host: str,
        port: int,
        workers: int,
        *,
        uds: Path | None = None,
        web_only: bool = False,
    ) -> None:
        self.host, self.port, self.workers = host, port, workers
        #: The unix socket the web server serves (None: the port).
        self.uds = uds
        self.web_only = web_only
        self.url = f"unix:{uds}" if uds is not None else display_url(host, port)
        self.stop_requested: int | None = None
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.commands: dict[str, list[str]] = {}
        #: When each child exited, lately (`_restart`).
        self.exits: dict[str, list[float]] = {}
        self.retiring: list[Retiring] = []
        #: Where a web server started beside a dead one's workers binds its unix socket, until
        #: it answers and the file takes the served path's place (`_new_server_answers`).
        self.beside: Path | None = None
        #: How long a stop waits for the children before killing them (`stop_timeout`).
        self.stop_timeout = stop_timeout()

    def _on_signal(self, signum: int, _frame) -> None:
        self.stop_requested = signum

    def run(self) -> int:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        try:
            return self._run()
        finally:
            self._stop_all()

    def _run(self) -> int:
        migrate = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, check=False
        )
        if self.stop_requested is not None:
            say("interrupted during migrate")
            return 128 + self.stop_requested
        if migrate.returncode != 0:
            say(f"`manage.py migrate` failed (exit {exit_status(migrate.returncode)}); not serving")
            return 1

        if not self.web_only:
            # `/metrics` open to this machine, without the token; the worker's on the next port.
            os.environ.setdefault("FLASHSALE_METRICS_LOOPBACK", "true")
            os.environ.setdefault("FLASHSALE_WORKER_METRICS_PORT", str(self.port + 1))
        # The web workers' metrics, summed at each scrape: a directory of this server's own,
        # emptied first (files an earlier server left would be counted with this one's).
        metrics = Path(os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(METRICS_DIR)))
        shutil.rmtree(metrics, ignore_errors=True)
        metrics.mkdir(parents=True)
        self._start_web(beside_workers=False)
        if not self.web_only:
            # The worker and beat log warnings and errors: at info, the sweeper's and
            # reconciler's tasks, every few seconds, would bury the requests and problems a
            # reader looks for.
            self._spawn(
                "the Celery worker",
                [sys.executable, "-m", "celery", "-A", "shop", "worker", "-l", "warning"],
            )
            # beat: the order sweeper and the reconciler, on the schedule in settings.
            self._spawn(
                "Celery beat",
                [sys.executable, "-m", "celery", "-A", "shop", "beat", "-l", "warning"]
                + ["--schedule", str(ROOT / ".data" / "celerybeat-schedule")],
            )

        ready_by = time.monotonic() + READY_TIMEOUT_SECONDS
        announced = False
        while self.stop_requested is None:
            died = self._first_dead()
            if died is not None:
                name, code = died
                if not self._restart(name, code):
                    others = [other for other in self.children if other != name]
                    say(
                        f"{name} keeps exiting (code {code}); stopping "
                        + (", ".join(others) if others else "the rest")
                    )
                    return code or 1
            self._retire()
            if not announced:
                if self._accepts():
                    print(
                        f"flashsale is serving at {self.url} (admin at /admin/)",
                        flush=True,
                    )
                    announced = True
                elif time.monotonic() > ready_by:
                    say(f"the web server did not accept connections on {self.url} within 60 s")
                    return 1
            time.sleep(0.2)
        say(
            "stopping the web server"
            if self.web_only
            else "stopping the web server, the Celery worker and beat"
        )
        return 0

    def _restart(self, name: str, code: int) -> bool:
        """Start `name` again after it exited with `code`, as compose's `restart:` does (the
        rest go on meanwhile); False once it has exited RESTART_LIMIT times in RESTART_WINDOW
        seconds (something is wrong that a restart does not mend)."""
        now = time.monotonic()
        recent = [at for at in self.exits.get(name, []) if at > now - RESTART_WINDOW] + [now]
        self.exits[name] = recent
        if len(recent) > RESTART_LIMIT:
            return False
        group = self.children[name].pid
        if name == WEB_SERVER and group_alive(group):
            # Its workers serve on: they stop once the new server's workers listen.
            self.retiring.append(Retiring(group, since=now))
            say(f"{name} exited with code {code}; starting it again (its workers serve meanwhile)")
            self._start_web(beside_workers=True)
            return True
        # Whatever it left in its process group (a killed Celery main's children) goes.
        signal_group(group, signal.SIGKILL)
        say(f"{name} exited with code {code}; starting it again")
        if name == WEB_SERVER:
            self._start_web(beside_workers=False)
        else:
            self._spawn(name, self.commands[name])
        return True

    def _start_web(self, *, beside_workers: bool) -> None:
        """Start granian on the port, or on the unix socket: at its path, or, while a dead
        server's workers still serve it, at a path beside it (`beside`), which takes the
        served path's place once the new server answers: a proxy connecting meanwhile finds
        the old workers, then the new, and never no socket at all."""
        uds = self.uds
        if uds is not None:
            self.beside = uds.with_name(uds.name + ".next") if beside_workers else None
            uds = self.beside or uds
            # A socket file a server that died left behind: granian binds a path of its own.
            uds.unlink(missing_ok=True)
        command = granian_command(
            host=self.host, port=self.port, workers=self.workers, threads=GRANIAN_THREADS, uds=uds
        )
        self._spawn(WEB_SERVER, [*command, "--access-log"])

    def _accepts(self) -> bool:
        """Whether the web server takes connections where it serves."""
        if self.uds is not None:
            return socket_answers(self.uds)
        return port_accepts(self.host, self.port)

    def _new_server_answers(self) -> bool:
        """Whether the web server started beside a dead one's workers serves: its workers
        listen on the port, or it answers on its unix socket, whose file then takes the served
        path's place."""
        if self.uds is None:
            return listening(self.children[WEB_SERVER].pid, self.port) >= self.workers
        if self.beside is None:
            return socket_answers(self.uds)
        if not socket_answers(self.beside):
            return False
        os.replace(self.beside, self.uds)
        self.beside = None
        return True

    def _retire(self) -> None:
        """Stop the workers of a dead web server once the new one's listen (`Retiring`)."""
        now = time.monotonic()
        for retiring in list(self.retiring):
            if not group_alive(retiring.group):
                self.retiring.remove(retiring)
            elif retiring.stopping_since is None:
                if self._new_server_answers() or now > retiring.since + READY_TIMEOUT_SECONDS:
                    signal_group(retiring.group, signal.SIGTERM)
                    retiring.stopping_since = now
            elif now > retiring.stopping_since + self.stop_timeout:
                signal_group(retiring.group, signal.SIGKILL)
                self.retiring.remove(retiring)

    def _spawn(self, name: str, argv: list[str]) -> None:
        # Sessions of their own: a Ctrl-C reaches this process only, which then stops both in
        # order (gunicorn graceful, Celery warm shutdown) instead of each getting the signal.
        self.commands[name] = argv
        self.children[name] = subprocess.Popen(
            argv, cwd=ROOT, start_new_session=True, preexec_fn=die_with_parent
        )

    def _first_dead(self) -> tuple[str, int] | None:
        for name, proc in self.children.items():
            if proc.poll() is not None:
                return name, exit_status(proc.returncode)
        return None

    def _stop_all(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.terminate()
        for retiring in self.retiring:
            signal_group(retiring.group, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for name, proc in self.children.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                waited = f"{self.stop_timeout:g} s"
                say(f"{name} (pid {proc.pid}) did not stop within {waited}; killing it")
                proc.kill()
                proc.wait()
            # Whatever the child left in its process group (workers) goes with it.
            signal_group(proc.pid, signal.SIGKILL)
        self.children.clear()
        for retiring in self.retiring:
            while group_alive(retiring.group) and time.monotonic() < deadline:
                time.sleep(0.1)
            signal_group(retiring.group, signal.SIGKILL)
        self.retiring.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shop.serve", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--uds",
        type=Path,
        help="serve on this unix socket, shared by the workers, instead of the port (behind a "
        "proxy on the same host, as compose runs it)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=GRANIAN_WORKERS,
        help=f"granian workers, of {GRANIAN_THREADS} threads each (default {GRANIAN_WORKERS})",
    )
    parser.add_argument(
        "--web-only",
        action="store_true",
        help="the web server alone: no Celery worker or beat (which run elsewhere)",
    )
    args = parser.parse_args(argv)
    if args.uds is not None:
        args.uds = args.uds.resolve()  # the server starts in the checkout, maybe elsewhere

    try:
        server = Server(args.host, args.port, args.workers, uds=args.uds, web_only=args.web_only)
    except ImproperlyConfigured as exc:  # a setting out of its bounds
        print(f"flashsale cannot serve: {exc}", file=sys.stderr)
        return 2
    url = server.url
    lock = take_lock(url)
    if lock is None:
        return 1
    try:
        if args.uds is None and not port_is_free(args.host, args.port):
            print(
                f"flashsale cannot serve at {url}: port {args.port} on {args.host} is in use by "
                f"another program; stop it or pick another port (make serve PORT={args.port + 1})",
                file=sys.stderr,
            )
            return 1
        if not os.environ.get("DATABASE_URL"):
            say("DATABASE_URL is not set: run `make serve` (or python -m shop.devservices -- ...)")
            return 1
        return server.run()
    finally:
        with contextlib.suppress(OSError):
            lock.seek(0)
            lock.truncate()
        lock.close()


if __name__ == "__main__":
    sys.exit(main())
