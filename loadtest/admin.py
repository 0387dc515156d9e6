"""The admin's list of recorded load runs (read-only; old runs may be deleted)."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from inventory.admin import ReadOnlyAdminMixin

from .models import SaleRun


@admin.register(SaleRun)
class SaleRunAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = [
        "pk",
        "strategy",
        "batch",
        "status",
        "requests_per_second_display",
        "goodput_display",
        "p99_display",
        "oversold",
        "remaining",
        "started_at",
    ]
    list_filter = ["status", "strategy", "batch"]
    search_fields = ["batch", "sku", "strategy"]
    date_hierarchy = "started_at"

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        # Old runs may be cleared away; what a run recorded is never edited.
        return admin.ModelAdmin.has_delete_permission(self, request, obj)

    @admin.display(description="requests/s", ordering="requests_per_second")
    def requests_per_second_display(self, run: SaleRun) -> str | None:
        return _rounded(run.requests_per_second, 1)

    @admin.display(description="goodput (units/s)", ordering="goodput")
    def goodput_display(self, run: SaleRun) -> str | None:
        return _rounded(run.goodput, 1)

    @admin.display(description="p99 (ms)", ordering="p99_ms")
    def p99_display(self, run: SaleRun) -> str | None:
        return _rounded(run.p99_ms, 1)


def _rounded(value: float | None, digits: int) -> str | None:
    return None if value is None else f"{value:.{digits}f}"
