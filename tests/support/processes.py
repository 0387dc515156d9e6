"""Which processes of this machine a test started, found by what they carry."""

from __future__ import annotations

from pathlib import Path


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
    """The processes started for a load-run batch: its server, sale writer and order worker."""
    return processes_carrying(f"-loadtest-{batch}")
