"""The Celery app `shop`, wired as in Celery's Django example."""

import os

from celery import Celery
from celery.signals import task_postrun, task_prerun
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
