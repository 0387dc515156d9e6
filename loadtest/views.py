"""The admin's "Compare strategies" page: recorded load runs side by side, and a form that
starts a new batch on a Celery worker."""

from __future__ import annotations

import re
from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone

from inventory.exceptions import InvalidRequest
from inventory.strategies import strategy_names
from loadtest.models import SaleRun

from .report.charts import charts
from .report.columns import BASELINE, COLUMNS, CPU_HEADER, CPU_LEGEND, LEGEND, cell, cpu_rows, notes
from .report.ratios import comparisons
from .runs.batch import new_batch_id
from .runs.config import LoadRunRequest, LoadRunSettings
from .runs.recording import end_orphaned_runs

RECENT_RUNS = 60
#: The largest crowd the page starts (the command takes up to 10,000).
MAX_PAGE_USERS = 500
#: Who may start a load run from the page (staff see the comparison; this starts load).
START_PERMISSION = "loadtest.start_load_run"
#: A batch whose runs are still `running` after this long is taken for dead (a worker killed
#: mid-batch) and no longer blocks a new one.
STALE_BATCH = timedelta(hours=1)


class StartRunForm(forms.Form):
    strategies = forms.MultipleChoiceField(
        choices=[(name, name) for name in strategy_names()],
        initial=strategy_names(),
        widget=forms.CheckboxSelectMultiple,
    )
    stock = forms.IntegerField(
        min_value=1,
        max_value=100_000,
        required=False,
        help_text="Blank: sized by a probe, so that each sale sells through the window.",
    )
    # Bounded well below what the command allows: a load run from a browser is a few minutes
    # of load on the shop's own machine, not a soak.
    users = forms.IntegerField(min_value=1, max_value=MAX_PAGE_USERS, initial=40)
    spawn_rate = forms.FloatField(min_value=0.1, max_value=1_000, initial=100)
    window = forms.FloatField(
        min_value=1, max_value=60, required=False, initial=10.0, label="Window (s)"
    )
    duration = forms.IntegerField(
        min_value=3,
        max_value=300,
        required=False,
        label="At most (s)",
        help_text="Per sale, from its opening; blank: twice what a sized stock lasts.",
    )


class FilterForm(forms.Form):
    strategy = forms.ChoiceField(
        required=False, choices=[("", "any")] + [(n, n) for n in [BASELINE, *strategy_names()]]
    )
    stock = forms.IntegerField(required=False, min_value=1)
    users = forms.IntegerField(required=False, min_value=1)
    duration = forms.IntegerField(required=False, min_value=1)
    batch = forms.CharField(required=False, max_length=32)


def _filtered(form: FilterForm):
    runs = SaleRun.objects.all()
    if not form.is_valid():
        return runs
    data = form.cleaned_data
    if data["strategy"]:
        runs = runs.filter(strategy=data["strategy"])
    for key in ("stock", "users", "duration"):
        if data[key]:
            runs = runs.filter(**{f"parameters__{key}": data[key]})
    if data["batch"]:
        runs = runs.filter(batch=data["batch"])
    return runs


#: A run id as the `run` parameter gives it: ASCII digits that fit PostgreSQL's bigint.
RUN_ID = re.compile(r"[0-9]{1,18}")


def _chosen(request: HttpRequest) -> list[int]:
    """The `run` ids asked for; InvalidRequest when one is not a run id."""
    chosen = request.GET.getlist("run")
    wrong = [pk for pk in chosen if not RUN_ID.fullmatch(pk)]
    if wrong:
        raise InvalidRequest(f"run must be a load run's id (digits 0-9), got {wrong[0][:40]!r}")
    return [int(pk) for pk in chosen]


def _selected(request: HttpRequest, candidates) -> list[SaleRun]:
    chosen = _chosen(request)
    if chosen:
        return list(SaleRun.objects.filter(pk__in=chosen).order_by("started_at", "pk"))
    latest = candidates.first()
    if latest is None:
        return []
    return list(SaleRun.objects.filter(batch=latest.batch).order_by("started_at", "pk"))


def _label(run: SaleRun, runs: list[SaleRun]) -> str:
    same_strategy = sum(1 for other in runs if other.strategy == run.strategy) > 1
    return f"{run.strategy} #{run.pk}" if same_strategy else run.strategy


def _live(run: SaleRun) -> dict:
    """How a run under way is going, from the history its command records as it runs."""
    latest = run.history[-1] if run.history else {}
    return {
        "strategy": run.strategy,
        "seconds": int(latest.get("t", 0)),
        "units_sold": int(latest.get("units_sold", 0)),
        "initial_stock": run.initial_stock,
        "requests_per_second": run.requests_per_second or 0,
        "failures": run.failures,
    }


def compare(request: HttpRequest) -> HttpResponse:
    """GET: compare runs (the latest batch, or the `run` ids chosen). POST: start a batch.

    Runs left running by a load run process of this host that was killed are ended first
    (`end_orphaned_runs`): they show as interrupted, and hold up no new batch."""
    end_orphaned_runs()
    if request.method == "POST":
        return _start(request)
    filters = FilterForm(request.GET or None)
    candidates = _filtered(filters)
    try:
        runs = _selected(request, candidates)
    except InvalidRequest as exc:
        return HttpResponseBadRequest(str(exc), content_type="text/plain; charset=utf-8")
    batch = request.GET.get("batch") or ""
    planned = len(runs[0].parameters.get("strategies", [])) + 1 if runs else 0
    running = bool(batch) and (
        not runs or len(runs) < planned or any(run.status == SaleRun.Status.RUNNING for run in runs)
    )
    context = {
        **admin.site.each_context(request),
        "title": "Compare strategies",
        "runs": runs,
        "rows": [[cell(run, key) for key, _ in COLUMNS] + [run.batch, run.status] for run in runs],
        "headers": [label for _, label in COLUMNS],
        "charts": charts([(_label(run, runs), run) for run in runs]) if runs else [],
        "comparisons": comparisons(runs),
        "notes": notes(runs),
        "legend": LEGEND,
        "cpu_rows": cpu_rows(runs),
        "cpu_headers": CPU_HEADER,
        "cpu_legend": CPU_LEGEND,
        "candidates": candidates[:RECENT_RUNS],
        "chosen": {run.pk for run in runs},
        "filters": filters,
        "start_form": StartRunForm() if request.user.has_perm(START_PERMISSION) else None,
        "watching": batch,
        "running": running,
        "planned": planned,
        "live_runs": [_live(run) for run in runs if run.status == SaleRun.Status.RUNNING],
    }
    return TemplateResponse(request, "admin/loadtest/compare.html", context)


def _start(request: HttpRequest) -> HttpResponse:
    from .tasks import run_load_batch_task

    if not request.user.has_perm(START_PERMISSION):
        raise PermissionDenied("starting a load run needs the permission 'start load run'")
    busy = SaleRun.objects.filter(
        status=SaleRun.Status.RUNNING, started_at__gte=timezone.now() - STALE_BATCH
    ).first()
    if busy is not None:
        messages.error(request, f"Not started: batch {busy.batch} is still running.")
        return redirect(f"{reverse('admin-compare')}?batch={busy.batch}")
    form = StartRunForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Not started: {form.errors.as_text()}")
        return redirect(reverse("admin-compare"))
    requested = _load_run_request(form.cleaned_data)
    config = LoadRunSettings(**requested)
    try:
        config.validate()
    except InvalidRequest as error:
        messages.error(request, f"Not started: {error.detail}")
        return redirect(reverse("admin-compare"))
    batch = new_batch_id()
    run_load_batch_task.delay(requested, batch)
    messages.info(request, f"Load run {batch} queued: a Celery worker runs it now.")
    return redirect(f"{reverse('admin-compare')}?batch={batch}")


def _load_run_request(fields: dict) -> LoadRunRequest:
    """The start form's fields as the worker's task takes them. A blank field leaves the
    command's default (a probe-sized stock, the default cap)."""
    requested = LoadRunRequest(
        strategies=fields["strategies"], users=fields["users"], spawn_rate=fields["spawn_rate"]
    )
    if fields["stock"] is not None:
        requested["stock"] = fields["stock"]
    if fields["window"] is not None:
        requested["window"] = fields["window"]
    if fields["duration"] is not None:
        requested["duration"] = fields["duration"]
    return requested


compare_view = admin.site.admin_view(compare)
