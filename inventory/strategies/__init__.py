"""Stock strategies, picked by name per item (settings.FLASHSALE_STRATEGIES maps names to classes).

Callers ask `get_strategy(name)` and never branch on the name: a strategy that needs Redis comes
wrapped in the database fallback.
"""

from __future__ import annotations

from functools import cache

from django.conf import settings
from django.utils.module_loading import import_string

from ..breaker import breaker
from ..sale_values import Allocation
from .base import RecordOrder, StockStrategy
from .fallback import RedisWithFallback

__all__ = [
    "Allocation",
    "RecordOrder",
    "StockStrategy",
    "get_strategy",
    "oversells",
    "safe_strategy_names",
    "strategy_label",
    "strategy_names",
]

FALLBACK_STRATEGY = "optimistic"


def strategy_names() -> list[str]:
    return list(settings.FLASHSALE_STRATEGIES)


def safe_strategy_names() -> list[str]:
    """The strategies that must never oversell (all but the `oversells` baseline)."""
    return [name for name in strategy_names() if not _bare_strategy(name).oversells]


def oversells(name: str) -> bool:
    """Whether `name` may oversell by design; False for anything that is no strategy."""
    return name in settings.FLASHSALE_STRATEGIES and _bare_strategy(name).oversells


def strategy_label(name: str) -> str:
    return _bare_strategy(name).label


@cache
def _bare_strategy(name: str) -> StockStrategy:
    try:
        path = settings.FLASHSALE_STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r}; choose one of {', '.join(strategy_names())}"
        ) from None
    return import_string(path)()


@cache
def get_strategy(name: str) -> StockStrategy:
    """The strategy called `name`, behind the database fallback if it needs Redis."""
    strategy = _bare_strategy(name)
    if strategy.uses_redis:
        return RedisWithFallback(strategy, _bare_strategy(FALLBACK_STRATEGY), breaker)
    return strategy
