"""The pitfall lab's runs in the admin, read-only: the "Pitfall lab" page starts and draws them."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from .models import PitfallRun


@admin.register(PitfallRun)
class PitfallRunAdmin(admin.ModelAdmin):
    list_display = ["id", "scenario", "status", "verdict", "created_at", "drawn"]
    list_filter = ["status", "scenario"]
    readonly_fields = [field.name for field in PitfallRun._meta.fields]

    @admin.display(description="verdict")
    def verdict(self, run: PitfallRun) -> str:
        return (run.result or {}).get("verdict", "")

    @admin.display(description="timeline")
    def drawn(self, run: PitfallRun) -> str:
        return format_html(
            '<a href="{}?run={}">on the lab page</a>', reverse("admin-pitfalls"), run.pk
        )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: PitfallRun | None = None) -> bool:
        return False
