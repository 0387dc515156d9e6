"""Runs scenarios: each variant on a Redis server of its own, started and thrown away, never the
shop's; then the verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shop.processes.redis_server import RedisServer

from .scenarios import ARTICLES, SCENARIOS, Outcome, Scenario, Variant

#: A cost scenario passes when the fixed variant costs at most this share of the naive one.
COST_SHARE = 1 / 3


@dataclass
class Result:
    scenario: Scenario
    naive: Outcome
    fixed: Outcome

    @property
    def verdict(self) -> str:
        """`pass`, or what went wrong: the fix did not hold, or the damage did not show."""
        if self.scenario.kind == "cost":
            if self.fixed.damage > self.naive.damage * COST_SHARE:
                return "FAIL: the fix is not 3x cheaper"
            return "pass"
        if self.fixed.damage > 0:
            return "FAIL: the fixed run shows damage"
        if self.naive.damage <= 0:
            return "FAIL: the naive run showed no damage"
        return "pass"

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def as_dict(self) -> dict[str, Any]:
        scenario = self.scenario
        return {
            "scenario": scenario.name,
            "kind": scenario.kind,
            "measure": scenario.measure,
            "article": ARTICLES[scenario.article],
            "warning": scenario.warning,
            "explanation": scenario.explanation,
            "naive": self.naive.as_dict(),
            "fixed": self.fixed.as_dict(),
            "verdict": self.verdict,
        }


def run_variant(scenario: Scenario, variant: Variant) -> Outcome:
    with RedisServer() as server:
        return scenario.run(variant, server)


def run(name: str) -> Result:
    """Run scenario `name` both ways. Raises KeyError for an unknown name."""
    scenario = SCENARIOS[name]
    return Result(scenario, run_variant(scenario, "naive"), run_variant(scenario, "fixed"))
