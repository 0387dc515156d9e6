"""Celery task behind the admin's "start a load run" button."""

from __future__ import annotations

import logging

from celery import shared_task

from inventory.models import SaleRun

from .runs import LoadRunSettings, run_batch

logger = logging.getLogger(__name__)


# Acknowledged on receipt, not after: a batch is minutes of load, not something to run again
# because a worker stopped half-way.
@shared_task(acks_late=False, reject_on_worker_lost=False)
def run_load_batch_task(settings: dict, batch: str) -> str:
    """Run a batch of load runs as `manage.py loadtest` would; progress goes to the log and
    to the SaleRun rows the compare page shows. A batch that already has runs is not run again."""
    if SaleRun.objects.filter(batch=batch).exists():
        logger.warning("load run batch %s already exists: not running it again", batch)
        return ""
    config = LoadRunSettings(**settings)
    result = run_batch(config, batch=batch, progress=lambda line: logger.info("%s", line))
    return str(result.out)
