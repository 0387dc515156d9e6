"""A PostgreSQL of a test's own, for the tests that stop, restart or pause the database: never
the shared one. Its binaries are pgserver's (a dependency of the project), run as pgserver's
system user when the tests run as root (PostgreSQL refuses to run as root).

    with PostgresServer() as server:
        server.url            # postgres://postgres@127.0.0.1:<port>/flashsale
        server.restart(down=3.0)   # fast shutdown, 3 s away, back on the same port
        server.pause()/resume()    # SIGSTOP / SIGCONT of the postmaster and its backends
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
import psycopg

from shop.processes.embedded_postgres import import_pgserver
from shop.processes.ports import free_port

DATABASE = "flashsale"


def _binaries() -> Path:
    # pgserver imported as the shop's embedded start imports it: without its warnings.
    return Path(import_pgserver()._commands.POSTGRES_BIN_PATH)


class PostgresServer:
    """One postgres on 127.0.0.1, trust auth, restartable on the same port."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="flashsale-test-postgres-"))
        self.pgdata = self.directory / "data"
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/{DATABASE}"
        self.process: subprocess.Popen[bytes] | None = None
        self.user: str | None = None
        if os.geteuid() == 0:
            utils = import_pgserver().utils

            self.user = "pgserver"
            utils.ensure_user_exists(self.user)
            # The binaries readable and runnable by that user (as pgserver does).
            utils.ensure_folder_permissions(_binaries(), 0o055)
            utils.ensure_folder_permissions(_binaries().parent / "lib", 0o044)
            os.chmod(self.directory, 0o777)

    def _run(self, *argv: str) -> None:
        subprocess.run(
            [str(_binaries() / argv[0]), *argv[1:]],
            check=True,
            capture_output=True,
            user=self.user,
            timeout=120,
        )

    def start(self) -> PostgresServer:
        if not (self.pgdata / "PG_VERSION").exists():
            self._run(
                "initdb", "-D", str(self.pgdata), "--auth=trust", "-U", "postgres", "-E", "utf8"
            )
        self.process = subprocess.Popen(
            [
                str(_binaries() / "postgres"),
                *("-D", str(self.pgdata), "-p", str(self.port), "-k", str(self.directory)),
                *("-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"),
                *("-c", "max_connections=200"),
            ],
            user=self.user,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=open(self.directory / "log", "ab"),  # noqa: SIM115 - the child keeps it
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"postgres exited: {(self.directory / 'log').read_text()[-2000:]}"
                )
            try:
                with psycopg.connect(
                    f"postgresql://postgres@127.0.0.1:{self.port}/postgres", connect_timeout=2
                ) as admin:
                    admin.autocommit = True
                    if not admin.execute(
                        "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE]
                    ).fetchone():
                        admin.execute(f'CREATE DATABASE "{DATABASE}"')
                return self
            except psycopg.OperationalError:
                time.sleep(0.05)
        raise RuntimeError("postgres did not accept connections within 60 s")

    def stop(self, *, mode: signal.Signals = signal.SIGINT) -> None:
        """Shut it down (SIGINT: a fast shutdown, as `pg_ctl stop -m fast`) and wait."""
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.process.send_signal(mode)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def restart(self, *, down: float) -> None:
        """Stop it (fast shutdown: every connection is cut), keep it away `down` seconds, start
        it again on the same port."""
        self.stop()
        time.sleep(down)
        self.start()

    def _group(self) -> list[psutil.Process]:
        if self.process is None:
            return []
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def pause(self) -> None:
        """Every process of it stopped (SIGSTOP): connections stay open, nothing answers."""
        self._signal_each(psutil.Process.suspend)

    def resume(self) -> None:
        self._signal_each(psutil.Process.resume)

    def _signal_each(self, send: Callable[[psutil.Process], None]) -> None:
        for process in self._group():
            try:
                send(process)
            except psutil.NoSuchProcess:
                pass  # a session's process that ended meanwhile

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __del__(self) -> None:  # a test that forgot to stop it
        try:
            self.close()
        except Exception:  # noqa: S110 - at exit, nothing to tell
            pass

    def migrate(self, env: dict[str, Any]) -> None:
        """Apply the shop's migrations to its database."""
        import sys

        from shop.processes.servers import PROJECT_DIR

        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=PROJECT_DIR,
            env={**os.environ, **env, "DATABASE_URL": self.url},
            check=True,
            timeout=300,
        )
