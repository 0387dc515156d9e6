"""Which processes of this machine a test started, found by what they carry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def processes_carrying(marker: str) -> list[int]:
    """The live processes whose command line or environment holds `marker` (a load-run
    batch's task queue is in the environment of every process started for it; a report
    folder is on its crowd's command line)."""
    needle = marker.encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.joinpath("stat").read_text().split(")")[-1].split()[0] == "Z":
                continue  # exited, not yet reaped by its parent
            if (
                needle in proc.joinpath("cmdline").read_bytes()
                or needle in proc.joinpath("environ").read_bytes()
            ):
                found.append(int(proc.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def started_for_batch(batch: str) -> list[int]:
    """The processes started for a load-run batch: its server and order worker."""
    return processes_carrying(f"-loadtest-{batch}")


def runner_of(pid: int, **changes: Any) -> dict[str, Any]:
    """A load run's `SaleRun.runner` as process `pid` of this host records it."""
    from loadtest.runs.recording import runner_record

    return {**runner_record(pid), **changes}


def gone_runner(**changes: Any) -> dict[str, Any]:
    """The runner of a process of this host that has since died (killed outright)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        return runner_of(process.pid, **changes)
    finally:
        process.kill()
        process.wait()


def this_runner(**changes: Any) -> dict[str, Any]:
    """The runner of this (live) process."""
    return runner_of(os.getpid(), **changes)
