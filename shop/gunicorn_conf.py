"""gunicorn settings every server of the shop starts with (`--config python:shop.gunicorn_conf`);
the command line gives the rest (bind, workers).

The workers' metrics (`shop.metrics`) are summed over all of them at each scrape: they report
into one directory (prometheus_client's multiprocess mode), PROMETHEUS_MULTIPROC_DIR when it is
set, else one this server makes for itself under the temporary directory and removes when it
stops. gunicorn puts `raw_env` into the master's environment before it loads the app (and
prometheus_client) and forks the workers, so every worker inherits it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

_owned: Path | None = None
raw_env: list[str] = []
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _owned = Path(tempfile.gettempdir()) / f"flashsale-metrics-{os.getpid()}"
    raw_env.append(f"PROMETHEUS_MULTIPROC_DIR={_owned}")


def on_starting(server: Any) -> None:
    """Before any worker starts: the directory, there and empty (files an earlier server left
    would be counted with this one's)."""
    directory = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)


def child_exit(server: Any, worker: Any) -> None:
    """A worker exited: its gauges are dropped from the sums."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server: Any) -> None:
    if _owned is not None:
        shutil.rmtree(_owned, ignore_errors=True)
