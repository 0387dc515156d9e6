"""Units held ahead: a registry of the processes that took units out of stock counters for
their next takers, kept beside the counters (docs/decisions/0035-units-taken-ahead.md).

Each sale has a hash of holders, each with when its lease ends (Redis's clock), and a
generation of its counters, raised whenever they are set from the system of record and started
afresh when Redis lost it. A holder is registered by the very script that takes units ahead
(`locking.counter.Registration`), learning the generation; it gives them back naming that
generation, and the give-back adds nothing if the counters were set since (the system of record
counted them). Framework-free: depends on redis-py only, like the rest of `locking`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .counter import positive_qty, stock_value
from .scripts import holders as holder_scripts
from .scripts import script_for


class Holders:
    """The holders registered against a client's counters. On a Redis Cluster, what one call
    names (the hash, the generation, the counters) must share a slot (a hash tag)."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._register = script_for(redis, holder_scripts.HOLDER_REGISTER)
        self._count = script_for(redis, holder_scripts.HOLDERS_COUNT)
        self._give_back = script_for(redis, holder_scripts.STOCK_GIVE_BACK_HELD)
        self._set_over = script_for(redis, holder_scripts.STOCK_SET_OVER_HOLDERS)

    def register(
        self, holders: str, generation: str, holder: str, *, lease_ms: int, keep_ms: int
    ) -> str:
        """Register ``holder`` in the hash ``holders`` for ``lease_ms`` (renewed by registering
        again); the hash is kept ``keep_ms`` after the last registration, so that a lease that
        ran out is seen. Returns the counters' generation (started when unset). A holder that
        takes units registers with the take instead, in its script (`Take.holder`)."""
        reply = self._register(
            keys=[holders, generation], args=[holder, lease_ms, keep_ms], client=self.redis
        )
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def count(
        self, holders: str, *, besides: str = "", remove_ended: bool = False
    ) -> tuple[int, int]:
        """How many holders (``besides`` left out) have a lease running, and how many a lease
        that ran out (removed with ``remove_ended``)."""
        live, ended = self._count(
            keys=[holders], args=[besides, "1" if remove_ended else "0"], client=self.redis
        )
        return int(live), int(ended)

    def give_back(
        self,
        holders: str,
        generation: str,
        holder: str,
        seen: str,
        amounts: Mapping[str, int],
    ) -> bool:
        """End ``holder``'s registration and give its units back to the counters, in one
        script. Returns False, adding nothing, when the generation is no longer ``seen`` (the
        one they were taken in): the counters were set since, or Redis lost them. Missing
        counters stay missing."""
        keys = [holders, generation, *amounts]
        args: list[str | int] = [holder, seen, *(positive_qty(q) for q in amounts.values())]
        return bool(self._give_back(keys=keys, args=args, client=self.redis))

    def set_counters(self, holders: str, generation: str, mapping: Mapping[str, int]) -> None:
        """Set the counters to ``mapping`` (from the system of record, which counts the units
        holders took ahead), ending every registration and raising the generation in the same
        script: no held unit is then given back on top."""
        values = [stock_value(value) for value in mapping.values()]
        self._set_over(keys=[holders, generation, *mapping], args=values, client=self.redis)
