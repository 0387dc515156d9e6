"""What the admin's "Pitfall lab" page records: one PitfallRun per scenario started from it."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class PitfallRun(models.Model):
    """One scenario run both ways on a Celery worker: its state, and the result the lab gave
    (`pitfalls.lab.Result.as_dict()`: verdict, damage, details and timeline per variant)."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    scenario = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, help_text="Why a failed run has no result.")

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.scenario} #{self.pk} ({self.status})"

    @property
    def finished(self) -> bool:
        return self.status in (self.Status.DONE, self.Status.FAILED)
