"""The embedded PostgreSQL of `devservices`: the server of the `pgserver` wheel.

Its data lives in .data/postgres; it listens on a unix socket only, and the database
`flashsale` is created if missing. Several runners share one server; pgserver stops it when
the last one leaves, and runners that died without leaving are forgotten.
See docs/operations.md#management-commands.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import warnings
from pathlib import Path
from types import ModuleType
from urllib.parse import quote

from .children import pid_alive
from .embedded import DevServicesError, say

DB_NAME = "flashsale"
PG_USER = "postgres"


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def import_pgserver() -> ModuleType:
    """The `pgserver` package, imported quietly, or a clear error if it is not installed."""
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

    def _prune_dead_handles(self, pgserver: ModuleType) -> None:
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
        pgserver = import_pgserver()
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
            self._prune_dead_handles(import_pgserver())
            server.cleanup()
        except Exception as exc:
            say(f"could not stop embedded PostgreSQL in {self.pgdata} cleanly: {exc}")
