"""What a load run records: one SaleRun per strategy flooded (the compare page shows them)."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class SaleRun(models.Model):
    """One strategy flooded in one load run: its parameters, what it achieved, its audit."""

    class Status(models.TextChoices):
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    batch = models.CharField(
        max_length=32, db_index=True, help_text="Runs made together share a batch id."
    )
    strategy = models.CharField(max_length=16, help_text="A strategy name, or `baseline`.")
    sku = models.CharField(max_length=64, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    parameters = models.JSONField(default=dict, help_text="stock, users, spawn rate, duration...")
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    requests = models.PositiveIntegerField(default=0)
    failures = models.PositiveIntegerField(default=0)
    requests_per_second = models.FloatField(null=True, blank=True)
    goodput = models.FloatField(null=True, blank=True, help_text="Accepted units per second.")
    p50_ms = models.FloatField(null=True, blank=True)
    p95_ms = models.FloatField(null=True, blank=True)
    p99_ms = models.FloatField(null=True, blank=True)
    baseline_requests_per_second = models.FloatField(null=True, blank=True)
    initial_stock = models.PositiveIntegerField(null=True, blank=True)
    accepted_units = models.PositiveIntegerField(null=True, blank=True)
    oversold = models.PositiveIntegerField(null=True, blank=True)
    remaining = models.PositiveIntegerField(null=True, blank=True)
    sold_out_after_seconds = models.FloatField(null=True, blank=True)
    fallback_activations = models.PositiveIntegerField(null=True, blank=True)
    lock_wait_p99_ms = models.FloatField(null=True, blank=True)
    settle_p50_ms = models.FloatField(
        null=True, blank=True, help_text="Time from an order's 201 to its final status: median."
    )
    settle_p99_ms = models.FloatField(
        null=True, blank=True, help_text="Time from an order's 201 to its final status: 99th pct."
    )
    audit = models.JSONField(default=dict, blank=True)
    history = models.JSONField(
        default=list, blank=True, help_text="Per-second samples: requests/s, p95, units sold."
    )
    report_dir = models.CharField(max_length=500, blank=True)
    runner = models.JSONField(
        default=dict,
        blank=True,
        help_text="The load run process recording it (host, pid, its start time) and its "
        "worker's task queue: a run it left running once it is gone is ended as interrupted.",
    )
    error = models.TextField(blank=True)

    class Meta:
        # Its table kept the name it had when the model lived in `inventory`.
        db_table = "inventory_salerun"
        ordering = ["-started_at", "-pk"]
        permissions = [("start_load_run", "Can start a load run from the compare page")]

    def __str__(self) -> str:
        return f"{self.strategy} run {self.pk} ({self.batch})"

    @property
    def ratio_to_baseline(self) -> float | None:
        if not self.requests_per_second or not self.baseline_requests_per_second:
            return None
        return self.requests_per_second / self.baseline_requests_per_second
