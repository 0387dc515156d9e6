"""Stock strategies, picked by name per item (STRATEGIES maps names to the dotted paths of
their classes, imported on first use).

Callers ask `get_strategy(name)` and never branch on the name: a strategy that needs Redis comes
wrapped in the database fallback.
"""

from __future__ import annotations

from functools import cache

from django.utils.module_loading import import_string

from ..breaker import breaker
from ..sale_values import Allocation
from .base import RecordOrder, StockStrategy
from .fallback import RedisWithFallback

__all__ = [
    "Allocation",
    "RecordOrder",
    "STRATEGIES",
    "StockStrategy",
    "get_strategy",
    "oversells",
    "safe_strategy_names",
    "strategy_label",
    "strategy_names",
]

#: Every strategy by the name the CLI, the API, the admin and reports use: dotted paths, each
#: module imported on its first use, as Django names a backend.
STRATEGIES = {
    "lock": "inventory.strategies.lock.LockStrategy",
    "segmented": "inventory.strategies.segmented.SegmentedStrategy",
    "lua": "inventory.strategies.lua.LuaStrategy",
    "optimistic": "inventory.strategies.optimistic.OptimisticStrategy",
    "unsafe": "inventory.strategies.unsafe.UnsafeStrategy",
}
FALLBACK_STRATEGY = "optimistic"


def strategy_names() -> list[str]:
    return list(STRATEGIES)


def safe_strategy_names() -> list[str]:
    """The strategies that must never oversell (all but the `oversells` baseline)."""
    return [name for name in strategy_names() if not _bare_strategy(name).oversells]


def oversells(name: str) -> bool:
    """Whether `name` may oversell by design; False for anything that is no strategy."""
    return name in STRATEGIES and _bare_strategy(name).oversells


def strategy_label(name: str) -> str:
    return _bare_strategy(name).label


@cache
def _bare_strategy(name: str) -> StockStrategy:
    try:
        path = STRATEGIES[name]
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
