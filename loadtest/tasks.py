"""Celery task behind the admin's "start a load run" button."""

from __future__ import annotations

import logging

from celery import shared_task

from .runs import LoadRunSettings, run_batch

logger = logging.getLogger(__name__)


@shared_task
def run_load_batch_task(settings: dict, batch: str) -> str:
    """Run a batch of load runs as `manage.py loadtest` would; progress goes to the log and
    to the SaleRun rows the compare page shows."""
    config = LoadRunSettings(**settings)
    result = run_batch(config, batch=batch, progress=lambda line: logger.info("%s", line))
    return str(result.out)
