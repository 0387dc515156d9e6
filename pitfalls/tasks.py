"""Celery task behind the "Pitfall lab" page's run buttons."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from .models import PitfallRun

logger = logging.getLogger(__name__)

#: A scenario takes seconds; one that runs this long is stuck, and its run is failed.
RUN_TIMEOUT_SECONDS = 600


# Acknowledged on receipt: a run redelivered after a worker died stays failed rather than run
# twice (the page can start it again).
@shared_task(acks_late=False, reject_on_worker_lost=False)
def run_pitfall_task(run_id: int) -> str:
    """Run a queued PitfallRun's scenario with `manage.py pitfall run NAME --json` (a process of
    its own: the scenario starts and kills Redis servers, forks and stops processes, and sells
    in the load-run sandbox, never the shop's database), and record its result. A run that is
    not queued (run already, or unknown) is left alone. Returns the run's final status."""
    started = PitfallRun.objects.filter(pk=run_id, status=PitfallRun.Status.QUEUED).update(
        status=PitfallRun.Status.RUNNING, started_at=timezone.now()
    )
    if not started:
        logger.warning("pitfall run %s is not queued: not running it", run_id)
        return ""
    run = PitfallRun.objects.get(pk=run_id)
    manage = Path(settings.BASE_DIR) / "manage.py"
    command = [sys.executable, str(manage), "pitfall", "run", run.scenario, "--json"]
    result, error = None, ""
    try:
        finished = subprocess.run(
            command,
            cwd=manage.parent,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        error = f"the scenario ran longer than {RUN_TIMEOUT_SECONDS} s and was stopped"
    else:
        # Exit 1 with a result is a verdict that did not pass: still a result to show.
        try:
            (result,) = json.loads(finished.stdout)["results"]
        except (ValueError, KeyError, TypeError):
            tail = (finished.stderr or finished.stdout).strip()[-2000:]
            error = f"`pitfall run` exited {finished.returncode} without a result: {tail}"
    status = PitfallRun.Status.DONE if result is not None else PitfallRun.Status.FAILED
    PitfallRun.objects.filter(pk=run_id).update(
        status=status, result=result, error=error, finished_at=timezone.now()
    )
    if error:
        logger.warning("pitfall run %s (%s) failed: %s", run_id, run.scenario, error)
    return str(status)
