"""Behaviour of locking.holders.Holders against the shared Redis (uuid key prefix, cleaned
up): units held ahead are given back once, never on top of counters set since."""

from __future__ import annotations

import time

import redis

from locking import StockCounter
from locking.holders import Holders


def test_a_holder_gives_back_in_its_generation_and_adds_nothing_once_the_counters_were_set(
    r: redis.Redis, prefix: str
) -> None:
    # Given two counters and a holder that took 5 units from them under its registration
    counter, registry = StockCounter(r), Holders(r)
    holders, generation = prefix + "holders", prefix + "generation"
    rows = [prefix + "row:0", prefix + "row:1"]
    counter.set_many({rows[0]: 10, rows[1]: 10})
    seen = registry.register(holders, generation, "one", lease_ms=10_000, keep_ms=60_000)
    assert seen == "0"
    taken = counter.take_spread(prefix + "turn", rows, 5)
    assert taken and sum(taken.values()) == 5 and sum(counter.get_many(rows)) == 15
    held = {rows[index]: units for index, units in taken.items()}

    # When it gives them back: they are in the counters again, its registration ended
    assert registry.give_back(holders, generation, "one", seen, held) is True
    assert counter.get_many(rows) == [10, 10]
    assert registry.count(holders) == (0, 0)

    # And once the counters were set (from a source that counts units held) after a take,
    # a give-back of that take adds nothing, and the registrations are gone
    seen = registry.register(holders, generation, "one", lease_ms=10_000, keep_ms=60_000)
    assert counter.take_spread(prefix + "turn", rows, 5)
    registry.set_counters(holders, generation, {rows[0]: 10, rows[1]: 10})
    assert registry.count(holders) == (0, 0)
    assert registry.give_back(holders, generation, "one", seen, held) is False
    assert counter.get_many(rows) == [10, 10]
    assert registry.register(holders, generation, "one", lease_ms=10_000, keep_ms=60_000) == str(
        int(seen) + 1
    )


def test_holders_count_live_leases_and_those_that_ran_out(r: redis.Redis, prefix: str) -> None:
    registry = Holders(r)
    holders, generation = prefix + "holders", prefix + "generation"
    registry.register(holders, generation, "live", lease_ms=10_000, keep_ms=60_000)
    registry.register(holders, generation, "dead", lease_ms=1, keep_ms=60_000)
    assert deadline_passes(lambda: registry.count(holders) == (1, 1))

    assert registry.count(holders, besides="live") == (0, 1)
    # a lease that ran out is counted until removed
    assert registry.count(holders, remove_ended=True) == (1, 1)
    assert registry.count(holders) == (1, 0)
    assert r.hkeys(holders) == [b"live"]
    # the hash is kept as long as asked after the last registration
    assert 10_000 < r.pttl(holders) <= 60_000


def deadline_passes(condition, timeout: float = 5.0) -> bool:
    """Poll `condition` until true or `timeout` seconds pass."""
    ends = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > ends:
            return False
        time.sleep(0.005)
    return True
