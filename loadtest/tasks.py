"""Celery task behind the admin's "start a load run" button."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from celery import shared_task
from django.conf import settings as django_settings

from loadtest.models import SaleRun

from .runs.config import LoadRunRequest, LoadRunSettings

logger = logging.getLogger(__name__)


# Acknowledged on receipt, not after: a batch is minutes of load, not something to run again
# because a worker stopped half-way.
@shared_task(acks_late=False, reject_on_worker_lost=False)
def run_load_batch_task(requested: LoadRunRequest, batch: str) -> str:
    """Run the batch of load runs `requested` with `manage.py loadtest` (in its sandbox: its
    sales never touch the shop's database); its output goes to the log, its progress to the
    SaleRun rows the compare page shows. A batch that already has runs is not run again.
    Returns the report folder."""
    if SaleRun.objects.filter(batch=batch).exists():
        logger.warning("load run batch %s already exists: not running it again", batch)
        return ""
    config = LoadRunSettings(**requested)
    manage = Path(django_settings.BASE_DIR) / "manage.py"
    command = [sys.executable, str(manage), "loadtest", *config.command_line(), "--batch", batch]
    with subprocess.Popen(
        command,
        cwd=manage.parent,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            logger.info("%s", line.rstrip())
    if process.returncode:
        logger.warning("load run batch %s ended with exit code %s", batch, process.returncode)
    return str(config.out or django_settings.FLASHSALE_REPORTS_DIR / batch)
