"""Behaviour of locking.holders.Holders against the shared Redis (uuid key prefix, cleaned
up): units held ahead are given back once, never on top of counters set since, nor into
counters rebuilt after Redis lost its keys."""

from __future__ import annotations

import time

import redis

from locking import StockCounter
from locking.counter import Registration, Take
from locking.holders import Holders


def _two_counters(r: redis.Redis, prefix: str) -> tuple[StockCounter, Holders, list[str]]:
    """Two counters of 10 units each, and the counter and registry of `r`."""
    counter = StockCounter(r)
    rows = [prefix + "row:0", prefix + "row:1"]
    counter.set_many({rows[0]: 10, rows[1]: 10})
    return counter, Holders(r), rows


def _registry_keys(prefix: str) -> tuple[str, str]:
    """The holders hash and the counters' generation the takes below register under."""
    return prefix + "holders", prefix + "generation"


def _take_ahead(counter: StockCounter, prefix: str, rows: list[str], qty: int, holder: str):
    """A take of `qty` units that registers `holder` as their holder in its own script."""
    registration = Registration(*_registry_keys(prefix), holder, lease_ms=10_000, keep_ms=60_000)
    (taken,) = counter.take_spread_many([Take(prefix + "turn", rows, qty, holder=registration)])
    assert taken and sum(taken.values()) == qty
    assert registration.seen is not None
    return {rows[index]: units for index, units in taken.items()}, registration.seen


def test_a_holder_gives_back_in_its_generation_and_adds_nothing_once_the_counters_were_set(
    r: redis.Redis, prefix: str
) -> None:
    # Given two counters and a holder that took 5 units from them, registered by the take
    counter, registry, rows = _two_counters(r, prefix)
    holders, generation = _registry_keys(prefix)
    held, seen = _take_ahead(counter, prefix, rows, 5, "one")
    assert sum(counter.get_many(rows)) == 15
    assert registry.count(holders) == (1, 0)
    # in a generation the registration started (there was none): not one a Redis that lost
    # its keys would start again
    assert seen == r.get(generation).decode() and int(seen) > 1_000_000

    # When it gives them back: they are in the counters again, its registration ended
    assert registry.give_back(holders, generation, "one", seen, held) is True
    assert counter.get_many(rows) == [10, 10]
    assert registry.count(holders) == (0, 0)

    # And once the counters were set (from a source that counts units held) after a take,
    # a give-back of that take adds nothing, and the registrations are gone
    held, seen = _take_ahead(counter, prefix, rows, 5, "one")
    registry.set_counters(holders, generation, {rows[0]: 10, rows[1]: 10})
    assert registry.count(holders) == (0, 0)
    assert registry.give_back(holders, generation, "one", seen, held) is False
    assert counter.get_many(rows) == [10, 10]
    assert registry.register(holders, generation, "one", lease_ms=10_000, keep_ms=60_000) == str(
        int(seen) + 1
    )


def test_units_held_before_redis_lost_its_keys_are_not_given_back_into_the_counters_rebuilt(
    r: redis.Redis, prefix: str
) -> None:
    # Given a holder of 5 units taken before Redis lost every key (a restart, empty), and the
    # counters rebuilt since from a source that counts those 5
    counter, registry, rows = _two_counters(r, prefix)
    holders, generation = _registry_keys(prefix)
    before, seen_before = _take_ahead(counter, prefix, rows, 5, "one")
    r.delete(*rows, holders, generation, prefix + "turn")
    counter.set_many({rows[0]: 10, rows[1]: 10})

    # When the holder takes 3 more, the take registering it again
    after, seen_after = _take_ahead(counter, prefix, rows, 3, "one")

    # Then they are taken in a generation of their own, and live under a registration
    assert seen_after != seen_before
    assert registry.count(holders) == (1, 0)
    # and a give-back of the 5 taken before adds nothing, one of the 3 taken since does
    assert registry.give_back(holders, generation, "one", seen_before, before) is False
    assert sum(counter.get_many(rows)) == 17
    assert registry.give_back(holders, generation, "one", seen_after, after) is True
    assert sum(counter.get_many(rows)) == 20


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
