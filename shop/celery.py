"""The Celery app `shop`, wired as in Celery's Django example."""

import logging
import os

from celery import Celery
from celery.signals import task_postrun, task_prerun, task_retry, worker_ready
from django.db import close_old_connections

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@task_prerun.connect
@task_postrun.connect
def _close_old_connections(sender=None, **_kwargs) -> None:
    """Around each task, what Django does around each request: close a database connection
    that is past CONN_MAX_AGE or broken, keep the others (CELERY_DB_REUSE_MAX turns off the
    fixup's close-every-time)."""
    if not getattr(getattr(sender, "request", None), "is_eager", False):
        close_old_connections()


@task_retry.connect
def _count_retry(sender=None, **_kwargs) -> None:
    from inventory.metrics import TASK_RETRIES

    TASK_RETRIES.labels(getattr(sender, "name", "unknown")).inc()


@worker_ready.connect
def _serve_metrics(sender=None, **_kwargs) -> None:
    """The worker's metrics on FLASHSALE_WORKER_METRICS_PORT, when set: its pool's threads all
    count in this process (the default `threads` pool; a `prefork` pool's children would each
    count their own)."""
    from django.conf import settings
    from prometheus_client import start_http_server

    port, host = settings.FLASHSALE_WORKER_METRICS_PORT, settings.FLASHSALE_WORKER_METRICS_HOST
    if port:
        try:
            start_http_server(port, addr=host)
        except OSError as exc:
            logging.getLogger(__name__).warning(
                "the worker's metrics are not served: %s:%s is not free (%s)", host, port, exc
            )
