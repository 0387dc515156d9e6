"""The admin's "Pitfall lab" page: the scenarios with their explanations, a button that runs one
on a Celery worker, and a run's result drawn as a timeline beside its numbers."""

from __future__ import annotations

import re

from django.contrib import admin, messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import reverse

from .models import PitfallRun
from .scenarios import ARTICLES, SCENARIOS, VARIANTS
from .tasks import run_pitfall_task
from .timeline import build, draw

RECENT_RUNS = 20
#: A run id as the `run` parameter gives it: ASCII digits that fit PostgreSQL's bigint.
RUN_ID = re.compile(r"[0-9]{1,18}")
#: Refusals are a sentence, not a page.
PLAIN_TEXT = "text/plain; charset=utf-8"


def _bad_request(detail: str) -> HttpResponse:
    return HttpResponseBadRequest(detail, content_type=PLAIN_TEXT)


def lab(request: HttpRequest) -> HttpResponse:
    """GET: the scenarios, recent runs, and one run (`run`, or the latest) drawn. POST: run the
    scenario named `scenario` on a Celery worker; only a POST starts one."""
    if request.method == "POST":
        return _start(request)
    if request.method != "GET":
        return _not_allowed("GET the page, or POST a scenario to run it")
    if "scenario" in request.GET:
        return _bad_request("a GET runs nothing: POST the scenario (the page's Run button)")
    chosen = request.GET.get("run")
    if chosen is not None and not RUN_ID.fullmatch(chosen):
        return _bad_request(f"run must be a pitfall run's id (digits 0-9), got {chosen[:40]!r}")
    runs = PitfallRun.objects.all()
    shown = runs.filter(pk=int(chosen)).first() if chosen else runs.first()
    if chosen and shown is None:
        return _bad_request(f"no pitfall run {chosen}")
    context = {
        **admin.site.each_context(request),
        "title": "Pitfall lab",
        "scenarios": [
            {
                "name": scenario.name,
                "kind": scenario.kind,
                "measure": scenario.measure,
                "article": ARTICLES[scenario.article],
                "warning": scenario.warning,
                "explanation": scenario.explanation,
            }
            for scenario in SCENARIOS.values()
        ],
        "runs": runs[:RECENT_RUNS],
        "shown": shown,
        "variants": _variants(shown),
        "waiting": shown is not None and not shown.finished,
    }
    return TemplateResponse(request, "admin/pitfalls/lab.html", context)


def _variants(run: PitfallRun | None) -> list[dict]:
    """Per variant of a finished run: its damage, figures and timeline drawing."""
    if run is None or not run.result:
        return []
    variants = []
    for variant in VARIANTS:
        outcome = run.result[variant]
        variants.append(
            {
                "name": variant,
                "damage": outcome["damage"],
                "details": sorted(outcome["details"].items()),
                "drawing": draw(build(outcome["timeline"])),
            }
        )
    return variants


def _not_allowed(detail: str) -> HttpResponse:
    return HttpResponseNotAllowed(["GET", "POST"], detail, content_type=PLAIN_TEXT)


def _start(request: HttpRequest) -> HttpResponse:
    name = request.POST.get("scenario", "")
    if name not in SCENARIOS:
        return _bad_request(f"no scenario {name[:64]!r}: choose one of {', '.join(SCENARIOS)}")
    run = PitfallRun.objects.create(scenario=name)
    transaction.on_commit(lambda: run_pitfall_task.delay(run.pk))
    messages.info(request, f"{name} queued: a Celery worker runs it now.")
    return redirect(f"{reverse('admin-pitfalls')}?run={run.pk}")


lab_view = admin.site.admin_view(lab)
