"""The ratios the strategies are judged by: each one's units/s as a multiple of `lock`'s and of
the baseline's requests/s, measured side by side in one batch, and the medians of several
rounds. See docs/load-runs.md#the-comparison.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from loadtest.models import SaleRun

from .columns import BASELINE

#: The strategy the others' units/s are held against (one lock per item, no shards).
REFERENCE = "lock"


def goodput_ratios(run: SaleRun, runs: Sequence[SaleRun]) -> dict[str, float | None]:
    """run's units/s as a multiple of the units/s of the `lock` run of its batch (among runs),
    and of its baseline's requests/s; None where a figure is missing (a baseline run, a run
    that failed, a batch without `lock` or without a baseline)."""
    ratios: dict[str, float | None] = {"goodput_to_lock": None, "goodput_to_baseline": None}
    if run.strategy == BASELINE or not run.goodput:
        return ratios
    reference = next(
        (other for other in runs if other.batch == run.batch and other.strategy == REFERENCE),
        None,
    )
    if reference is not None and reference.goodput:
        ratios["goodput_to_lock"] = run.goodput / reference.goodput
    if run.baseline_requests_per_second:
        ratios["goodput_to_baseline"] = run.goodput / run.baseline_requests_per_second
    return ratios


def comparisons(runs: Sequence[SaleRun]) -> list[str]:
    """One line per batch among runs: each strategy's units/s as a multiple of `lock`'s and of
    the baseline's requests/s, measured side by side in that batch (the ratios the strategies
    are judged by). The batch is named only when runs come from several."""
    batches = list(dict.fromkeys(run.batch for run in runs))
    lines = []
    for batch in batches:
        members = [run for run in runs if run.batch == batch]
        sales = [run for run in members if run.strategy != BASELINE and run.goodput]
        ratios = {run.strategy: goodput_ratios(run, members) for run in sales}
        to_lock = [
            f"{strategy} {ratio['goodput_to_lock']:.2f}x"
            for strategy, ratio in ratios.items()
            if strategy != REFERENCE and ratio["goodput_to_lock"] is not None
        ]
        to_baseline = [
            f"{strategy} {ratio['goodput_to_baseline']:.2f}x"
            for strategy, ratio in ratios.items()
            if ratio["goodput_to_baseline"] is not None
        ]
        parts = []
        if to_lock:
            reference = next(run for run in sales if run.strategy == REFERENCE)
            parts.append(
                f"units/s against {REFERENCE}'s {reference.goodput:.0f}: " + ", ".join(to_lock)
            )
        if to_baseline:
            baseline = next(
                run.baseline_requests_per_second
                for run in sales
                if run.baseline_requests_per_second
            )
            parts.append(
                f"against the baseline's {baseline:.0f} requests/s: " + ", ".join(to_baseline)
            )
        if parts:
            lines.append(("" if len(batches) == 1 else f"{batch}: ") + "; ".join(parts))
    return lines


def round_figures(rounds: Sequence[Sequence[SaleRun]]) -> dict[str, Any]:
    """The figures of several rounds of one load run, each round a batch of its own (the
    baseline and every strategy, in turn): per contender its median units/s (the baseline's:
    requests/s) and CPU per unit, and the ratios the strategies are judged by, each the ratio
    of two medians beside the ratio of every round. A run that failed counts in no median, and
    leaves its round's ratios out (None)."""

    def rate(run: SaleRun) -> float | None:
        if run.status != SaleRun.Status.DONE:
            return None
        return run.requests_per_second if run.strategy == BASELINE else run.goodput

    def cpu_all(run: SaleRun) -> float | None:
        cpu = run.audit.get("cpu") or {}
        costs = cpu.get("per_unit_ms") or cpu.get("per_request_ms") or {}
        return costs.get("all") if run.status == SaleRun.Status.DONE else None

    def median(values: list[float | None]) -> float | None:
        present = [value for value in values if value is not None]
        return statistics.median(present) if present else None

    names = list(dict.fromkeys(run.strategy for runs in rounds for run in runs))
    rates: dict[str, list[float | None]] = {}
    contenders: dict[str, dict[str, Any]] = {}
    for name in names:
        members = [next((run for run in runs if run.strategy == name), None) for runs in rounds]
        rates[name] = [None if run is None else rate(run) for run in members]
        contenders[name] = {
            "median": median(rates[name]),
            "rounds": rates[name],
            "cpu_ms_per_unit": median([None if run is None else cpu_all(run) for run in members]),
        }

    def against(reference: str, names: list[str]) -> dict[str, dict[str, Any]]:
        if reference not in rates:
            return {}
        ratios = {}
        for name in names:
            by_round = [
                mine / theirs if mine and theirs else None
                for mine, theirs in zip(rates[name], rates[reference], strict=True)
            ]
            mine, theirs = contenders[name]["median"], contenders[reference]["median"]
            ratios[name] = {
                "ratio": mine / theirs if mine and theirs else None,
                "rounds": by_round,
            }
        return ratios

    sales = [name for name in names if name != BASELINE]
    return {
        "batches": [runs[0].batch if runs else None for runs in rounds],
        "contenders": contenders,
        "against_lock": against(REFERENCE, [name for name in sales if name != REFERENCE]),
        "against_baseline": against(BASELINE, sales),
    }
