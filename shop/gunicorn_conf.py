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

#: The access log without the health checks' polls, unless `--log-level debug`.
logger_class = "shop.access_log.AccessLog"

_owned: Path | None = None
raw_env: list[str] = []
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    _owned = Path(tempfile.gettempdir()) / f"flashsale-metrics-{os.getpid()}"
    raw_env.append(f"PROMETHEUS_MULTIPROC_DIR={_owned}")


def on_starting(server: Any) -> None:
    """Before any worker starts: refuse a worker class the shop cannot run on; then the
    directory, there and empty (files an earlier server left would be counted with this one's)."""
    refuse_cooperative_workers(server.cfg.worker_class)
    directory = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)


def post_fork(server: Any, worker: Any) -> None:
    """A worker forked from a master that loaded the app (`--preload`): its alerting series,
    at 0, under its own pid (the master's files went when `on_starting` emptied the directory).
    Otherwise the worker loads the app, which exports them, itself."""
    from django.apps import apps

    if apps.ready:
        from inventory.apps import export_metrics_before_use

        export_metrics_before_use()


def child_exit(server: Any, worker: Any) -> None:
    """A worker exited: its gauges are dropped from the sums."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server: Any) -> None:
    if _owned is not None:
        shutil.rmtree(_owned, ignore_errors=True)


def refuse_cooperative_workers(worker_class: type) -> None:
    """Raise RuntimeError (gunicorn prints it and exits 1) for gevent's and eventlet's workers.

    They patch the standard library when a worker starts, and this package has imported Django
    long before (loading this file imports `shop`, which imports the Celery app): Django's
    connections are then per thread, not per greenlet, so every request of a worker would share
    one database connection, and Django refuses that on the first query. Sync workers (the
    default) and gthread serve the shop.
    """
    from gunicorn.workers.base_async import AsyncWorker

    if issubclass(worker_class, AsyncWorker):
        raise RuntimeError(
            f"gunicorn's {worker_class.__name__} is not supported: Django is imported before "
            "it could patch the standard library, so its greenlets would share one database "
            "connection. Run sync workers (the default) or gthread "
            "(--worker-class gthread --threads N)."
        )
