"""`python -m shop.devservices`: real processes, no mocks.

Each test runs the runner as a subprocess with DATABASE_URL/REDIS_URL removed and
DEVSERVICES_DATA_DIR pointing at a private folder (so a `make serve` running in this checkout is
never touched), then checks what it started is gone once it exits. Needs no Django.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="uses /proc and PR_SET_PDEATHSIG")

# Prints the runner's environment as the child sees it after using both services.
CONNECT_BOTH = r"""
import os, sys
import environ, psycopg, redis
url = os.environ["DATABASE_URL"]
cfg = environ.Env.db_url_config(url)
socket_dir = cfg["HOST"] or cfg["OPTIONS"]["host"]
assert os.path.exists(os.path.join(socket_dir, ".s.PGSQL.%s" % (cfg["PORT"] or 5432))), cfg
assert os.environ["PGHOST"] == socket_dir and os.environ["PGPORT"] == str(cfg["PORT"])
with psycopg.connect(url) as conn:
    assert conn.execute("SELECT current_database()").fetchone()[0] == cfg["NAME"] == "flashsale"
client = redis.Redis.from_url(os.environ["REDIS_URL"])
client.set("devservices-test", "1")
assert client.get("devservices-test") == b"1"
print("OK", os.getpid(), client.connection_pool.connection_kwargs["port"], flush=True)
"""

SLEEP = r"""
import os, time
print("READY", os.getpid(), os.environ["REDIS_URL"].rsplit(":", 1)[1].split("/")[0], flush=True)
time.sleep(60)
"""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("devservices")


def runner_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL")
    }
    env["DEVSERVICES_DATA_DIR"] = str(data_dir)
    env.update(extra)
    return env


def _default_sigint() -> None:
    # A job started in the background of a non-interactive shell inherits SIGINT ignored;
    # these tests need the ordinary disposition whatever started pytest.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_runner(code: str, env: dict[str, str], **kwargs) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "shop.devservices", "--", sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_default_sigint,
        **kwargs,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"runner did not exit within {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def processes_mentioning(*needles: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(needle in cmdline for needle in needles) and alive(int(entry.name)):
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found


def port_refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except OSError:
        return True


def assert_all_gone(data_dir: Path, child_pid: int, redis_port: int | None) -> None:
    needles = [str(data_dir)]
    if redis_port is not None:
        needles.append(f"redis-server 127.0.0.1:{redis_port}")
        assert port_refuses(redis_port), f"embedded Redis still answers on port {redis_port}"
    deadline = time.monotonic() + 5  # the postmaster is reparented to init and reaped by it
    while (left := processes_mentioning(*needles)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"
    assert not alive(child_pid), f"command (pid {child_pid}) still running"
    assert not (data_dir / "postgres" / "postmaster.pid").exists(), "PostgreSQL not stopped"


@pytest.mark.embedded_smoke
def test_command_gets_working_embedded_postgres_and_redis(data_dir):
    code, out, err = finish(start_runner(CONNECT_BOTH, runner_env(data_dir)), timeout=60)

    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert out.startswith("OK "), out
    _, child_pid, redis_port = out.split()
    assert f"devservices: embedded PostgreSQL at {data_dir / 'postgres'}" in err
    assert f"devservices: embedded Redis at redis://127.0.0.1:{redis_port}/0" in err
    assert_all_gone(data_dir, int(child_pid), int(redis_port))


@pytest.mark.embedded_smoke
@pytest.mark.parametrize(
    ("signum", "services"),
    [(signal.SIGINT, "both"), (signal.SIGTERM, "redis")],
    ids=["SIGINT-both-services", "SIGTERM-redis-only"],
)
def test_signal_to_runner_stops_command_and_services(data_dir, signum, services):
    extra = {"DATABASE_URL": "postgres://unused@127.0.0.1:1/unused"} if services == "redis" else {}
    proc = start_runner(SLEEP, runner_env(data_dir, **extra))
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY "), line + proc.stderr.read()
        _, child_pid, redis_port = line.split()
        assert not port_refuses(int(redis_port))
        assert alive(int(child_pid))
        proc.send_signal(signum)
        code, _, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    assert code == 128 + signum, err  # the command died of the forwarded signal
    assert_all_gone(data_dir, int(child_pid), int(redis_port))


@pytest.mark.embedded_smoke
@pytest.mark.parametrize(
    ("code", "expected"),
    [("raise SystemExit(3)", 3), ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137)],
    ids=["exit-3", "killed"],
)
def test_exit_status_of_command_is_propagated(data_dir, code, expected):
    # Only Redis is embedded here (fast); the runner path is the same as with PostgreSQL.
    env = runner_env(data_dir, DATABASE_URL="postgres://unused@127.0.0.1:1/unused")
    status, _, err = finish(start_runner(code, env))
    assert status == expected, err
    assert "devservices: embedded Redis at" in err
    assert not processes_mentioning(str(data_dir))


@pytest.mark.embedded_smoke
def test_nothing_is_started_when_environment_names_the_services(tmp_path):
    env = runner_env(
        tmp_path / "unused",
        DATABASE_URL="postgres://someone@db.example.invalid:5432/shop",
        REDIS_URL="redis://cache.example.invalid:6379/0",
        DJANGO_SECRET_KEY="given",  # (without one, a key is made: see the test below)
    )
    show = 'import os; print(os.environ["DATABASE_URL"], os.environ["REDIS_URL"]); exit(4)'
    code, out, err = finish(start_runner(show, env))

    assert code == 4
    assert out.split() == [env["DATABASE_URL"], env["REDIS_URL"]]
    assert "devservices:" not in err
    assert not (tmp_path / "unused").exists()


@pytest.mark.embedded_smoke
def test_a_secret_key_is_made_once_per_checkout_and_one_given_wins(tmp_path):
    env = runner_env(
        tmp_path,
        DATABASE_URL="postgres://someone@db.example.invalid:5432/shop",
        REDIS_URL="redis://cache.example.invalid:6379/0",
    )
    env.pop("DJANGO_SECRET_KEY", None)
    show = 'import os; print(os.environ["DJANGO_SECRET_KEY"])'
    keys = [finish(start_runner(show, env))[1].strip() for _ in range(2)]
    assert keys[0] == keys[1] and len(keys[0]) >= 50
    stored = tmp_path / "secret_key"
    assert stored.read_text().strip() == keys[0]
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    given = finish(start_runner(show, {**env, "DJANGO_SECRET_KEY": "given-key"}))[1].strip()
    assert given == "given-key"


@pytest.mark.embedded_smoke
def test_runners_share_one_postgres_and_the_last_one_stops_it(data_dir):
    # A holds the server while B comes and goes; A must still reach it after B exits.
    wait_then_connect = r"""
import os, sys, psycopg
print("READY", os.getpid(), flush=True)
sys.stdin.readline()
with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
    conn.execute("SELECT 1")
print("A OK", flush=True)
"""
    env = runner_env(data_dir)
    first = start_runner(wait_then_connect, env, stdin=subprocess.PIPE)
    try:
        line = first.stdout.readline()
        assert line.startswith("READY "), line + first.stderr.read()
        first_child = int(line.split()[1])
        postmaster = (data_dir / "postgres" / "postmaster.pid").read_text().split()[0]

        code, out, err = finish(start_runner(CONNECT_BOTH, env))
        assert code == 0, err
        assert f"shared with the running server pid {postmaster}" in err
        assert alive(int(postmaster)), "the second runner's exit stopped the shared server"

        first.stdin.write("go\n")
        first.stdin.flush()
        code, out, err = finish(first)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert code == 0, err
    assert "A OK" in out
    assert_all_gone(data_dir, first_child, None)


@pytest.mark.embedded_smoke
def test_unknown_command_exits_127(data_dir):
    # Both named (the runner execs the command), then Redis embedded (it runs it as a child).
    for extra in ({"REDIS_URL": "redis://unused.invalid:6379/0"}, {}):
        env = runner_env(data_dir, DATABASE_URL="postgres://unused@127.0.0.1:1/unused", **extra)
        proc = subprocess.run(
            [sys.executable, "-m", "shop.devservices", "--", "no-such-command-flashsale"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 127
        assert "command not found: no-such-command-flashsale" in proc.stderr
    assert not processes_mentioning(str(data_dir))


def test_postgres_that_cannot_start_is_reported_with_its_log(tmp_path):
    env = runner_env(tmp_path, REDIS_URL="redis://unused.invalid:6379/0")
    code, _, err = finish(start_runner("pass", env), timeout=60)  # initdb, start, stop
    assert code == 0, err
    with open(tmp_path / "postgres" / "postgresql.conf", "a") as conf:
        conf.write("\nflashsale_no_such_setting = on\n")

    code, out, err = finish(start_runner("print('should not run')", env), timeout=60)

    assert code == 1
    assert "should not run" not in out
    assert "embedded PostgreSQL (pgserver) failed to start" in err
    assert "last lines of" in err
    assert "flashsale_no_such_setting" in err  # postgres' own complaint, from its log
    assert not processes_mentioning(str(tmp_path))


def test_a_data_folder_initdb_refuses_is_reported_with_initdbs_own_words(tmp_path):
    # Given a data folder holding something that is not a database (initdb will not touch it)
    (tmp_path / "postgres").mkdir()
    (tmp_path / "postgres" / "notes.txt").write_text("not a database")
    env = runner_env(tmp_path, REDIS_URL="redis://unused.invalid:6379/0")

    # When a runner starts
    code, out, err = finish(start_runner("print('should not run')", env), timeout=60)

    # Then it refuses, naming the command and quoting what initdb said, and leaves nothing
    assert code == 1 and "should not run" not in out
    assert "initdb postgres exited with status 1" in err
    assert "exists but is not empty" in err, err
    assert (tmp_path / "postgres" / "notes.txt").read_text() == "not a database"
    assert not processes_mentioning(str(tmp_path))


@pytest.mark.embedded_smoke
def test_runners_share_one_redis_and_the_last_one_stops_it(data_dir):
    # A holds the server while B comes and goes: B sees A's keys, A sees B's after B left.
    hold = r"""
import os, sys, redis
client = redis.Redis.from_url(os.environ["REDIS_URL"])
client.set("shared-by-a", "1")
print("READY", os.getpid(), os.environ["REDIS_URL"].rsplit(":", 1)[1].split("/")[0], flush=True)
sys.stdin.readline()
print("A", client.get("shared-by-b").decode(), flush=True)
"""
    visit = r"""
import os, redis
client = redis.Redis.from_url(os.environ["REDIS_URL"])
client.set("shared-by-b", "2")
print("B", client.get("shared-by-a").decode(), flush=True)
"""
    env = runner_env(data_dir, DATABASE_URL="postgres://unused@127.0.0.1:1/unused")
    first = start_runner(hold, env, stdin=subprocess.PIPE)
    try:
        line = first.stdout.readline()
        assert line.startswith("READY "), line + first.stderr.read()
        _, first_child, port = line.split()

        code, out, err = finish(start_runner(visit, env))
        assert code == 0, err
        assert out.split() == ["B", "1"]
        assert (
            f"embedded Redis at redis://127.0.0.1:{port}/0, shared with the running server" in err
        )
        assert not port_refuses(int(port)), "the second runner's exit stopped the shared Redis"

        first.stdin.write("go\n")
        first.stdin.flush()
        code, out, err = finish(first)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert code == 0, err
    assert out.split()[-2:] == ["A", "2"]
    assert_all_gone(data_dir, int(first_child), int(port))
    assert not (data_dir / "redis" / "server.json").exists()
