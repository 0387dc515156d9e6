"""Every command the docs show runs as written on a fresh clone: each shell line of the README and
docs/ is a make target (which makes `.venv` and starts what is missing) or compose; the lab's
target runs; `pitfall list` needs no database; a command that needs a database it cannot find
says so in one line, not a traceback."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from inventory.services import start_sale
from pitfalls.scenarios import SCENARIOS
from shop.processes.servers import PROJECT_DIR as ROOT
from tests.conftest import server_env

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:sh|bash|shell|console)\n(.*?)^```", re.MULTILINE | re.DOTALL)
#: What a shell line of the docs may start with, besides a make target: compose and the lines
#: that prepare its .env.
OTHER_PROGRAMS = {"docker", "echo", "export", "curl"}


def _shell_lines(path: Path) -> list[list[str]]:
    """The commands of each shell block of a doc, continuations joined, comments dropped."""
    blocks = []
    for block in SHELL_BLOCK.findall(path.read_text()):
        joined = block.replace("\\\n", " ")
        blocks.append([line for line in joined.splitlines() if line.strip() and line[0] != "#"])
    return blocks


def _makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", text, re.MULTILINE))
    variables = set(re.findall(r"\$\(([A-Z_]+)\)", text)) | set(
        re.findall(r"^([A-Z_]+) \?=", text, re.MULTILINE)
    )
    return targets, variables


def test_every_shell_line_of_the_docs_is_a_make_target_or_compose():
    targets, variables = _makefile()
    wrong = []
    for path in DOCS:
        for block in _shell_lines(path):
            venv_made = False
            for line in block:
                words = shlex.split(line, comments=True)
                settings = [word.split("=", 1)[0] for word in words if re.match(r"[A-Z_]+=", word)]
                program = next(word for word in words if not re.match(r"[A-Z_]+=", word))
                where = f"{path.name}: {line}"
                if program == "make":
                    target = words[words.index("make") + 1]
                    venv_made |= target == "venv"
                    if target not in targets:
                        wrong.append(f"{where}  (no make target {target!r})")
                    unread = [name for name in settings if name not in variables]
                    if words.index("make") == 0 and unread:
                        wrong.append(f"{where}  (the Makefile reads no {', '.join(unread)})")
                elif program.startswith(".venv/bin/") and not venv_made:
                    wrong.append(f"{where}  (.venv does not exist yet: `make venv` first)")
                elif program not in OTHER_PROGRAMS and not program.startswith(".venv/bin/"):
                    wrong.append(f"{where}  ({program} is not there on a fresh clone)")
                if "[" in line.split("#")[0]:
                    wrong.append(f"{where}  (a placeholder, not a command)")
    assert wrong == []


def _without(*names: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, **server_env(), **extra}
    for name in names:
        env.pop(name, None)
    return env


def _run(command: list[str], env: dict[str, str], timeout: float = 120):
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_pitfall_list_needs_no_database():
    # Given no database named, and none for make to start either
    env = _without("DATABASE_URL", "REDIS_URL")

    # When the scenarios are listed, directly and through make
    for command in (
        [sys.executable, "manage.py", "pitfall", "list"],
        ["make", "--no-print-directory", "pitfall", "ARGS=list"],
    ):
        listed = _run(command, env)

        # Then every scenario is listed, and no embedded service was started for it
        assert listed.returncode == 0, listed.stderr
        for name in SCENARIOS:
            assert f"{name}  (" in listed.stdout
        assert "devservices:" not in listed.stderr


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("arguments", "database", "says"),
    [
        (["sale", "audit", "phone"], None, "DATABASE_URL is not set"),
        (["pitfall", "run", "--all"], None, "DATABASE_URL is not set"),
        (["migrate"], None, "DATABASE_URL is not set"),
        (["sale", "audit", "phone"], "closed", "cannot use the database nowhere on 127.0.0.1:"),
    ],
    ids=["sale audit, no database", "pitfall run, no database", "migrate", "database away"],
)
def test_a_command_that_needs_a_database_it_cannot_find_says_so_in_one_line(
    arguments, database, says
):
    env = _without("DATABASE_URL")
    if database == "closed":
        env["DATABASE_URL"] = f"postgres://shop:secret-pw@127.0.0.1:{_closed_port()}/nowhere"

    done = _run([sys.executable, "manage.py", *arguments], env)

    assert done.returncode == 1, done.stdout + done.stderr
    assert says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr and "secret-pw" not in done.stderr
    if database is None:
        assert "make" in done.stderr  # and how to get one


@pytest.mark.django_db(transaction=True)
def test_make_pitfall_and_make_manage_run_as_the_docs_show():
    env = {**os.environ, **server_env()}

    # make pitfall runs every scenario; ARGS picks what it runs
    dry = _run(["make", "--no-print-directory", "-n", "pitfall"], env)
    assert "manage.py pitfall run --all" in dry.stdout, dry.stdout + dry.stderr
    one = _run(["make", "--no-print-directory", "pitfall", "ARGS=run get-del-race"], env)
    assert one.returncode == 0, one.stderr
    assert re.search(r"^get-del-race +locks released by a non-owner +1 +0 +pass", one.stdout, re.M)

    # make manage runs any command, its arguments as given
    sku = f"doc-{uuid.uuid4().hex[:6]}"
    start_sale(sku=sku, stock=4, strategy="lua")
    audit = _run(["make", "--no-print-directory", "manage", f"ARGS=sale audit {sku} --json"], env)
    assert audit.returncode == 0, audit.stderr
    assert f'"sku": "{sku}"' in audit.stdout and '"initial_stock": 4' in audit.stdout


def test_the_web_app_refuses_to_start_without_its_database():
    started = _run(
        [sys.executable, "-c", "import shop.wsgi"], _without("DATABASE_URL", "DJANGO_DEBUG")
    )

    assert started.returncode != 0
    assert "DATABASE_URL is not set: the shop will not serve without its database" in (
        started.stderr
    )
