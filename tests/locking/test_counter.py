"""Behaviour of locking.StockCounter against the shared Redis (uuid key prefix, cleaned up)."""

from __future__ import annotations

import multiprocessing

import pytest
import redis

from locking import Claim, KeyClaimed, StockCounter
from tests.support import delete_prefix, gather_from_processes, redis_url, unique_prefix


def test_take_exact_results(r: redis.Redis, prefix: str) -> None:
    counter = StockCounter(r)
    key = prefix + "sku"
    assert StockCounter.MISSING == -2
    assert StockCounter.INSUFFICIENT == -1

    assert counter.take(key, 1) == StockCounter.MISSING
    assert r.exists(key) == 0  # a missing counter is reported, not created at -1

    counter.set(key, 5)
    assert counter.take(key, 3) == 2
    assert counter.take(key, 3) == StockCounter.INSUFFICIENT
    assert counter.get(key) == 2  # a refused take changes nothing
    assert counter.take(key, 2) == 0
    assert counter.take(key, 1) == StockCounter.INSUFFICIENT
    assert counter.get(key) == 0


def test_give_back(r: redis.Redis, prefix: str) -> None:
    counter = StockCounter(r)
    key = prefix + "sku"
    counter.set(key, 0)
    assert counter.give_back(key, 4) == 4
    assert counter.take(key, 4) == 0
    assert counter.give_back(prefix + "gone", 3) == StockCounter.MISSING
    assert r.exists(prefix + "gone") == 0  # stays missing


def test_set_many_get_many(r: redis.Redis, prefix: str) -> None:
    counter = StockCounter(r)
    a, b, missing = prefix + "a", prefix + "b", prefix + "missing"
    counter.set_many({a: 10, b: 0})
    assert counter.get_many([a, missing, b]) == [10, None, 0]
    assert counter.get(missing) is None
    assert counter.get_many([]) == []
    counter.set_many({})  # nothing to do, no error
    assert counter.get_many([a, b]) == [10, 0]


def test_set_newer_keeps_the_latest_version_whatever_order_copies_land_in(
    r: redis.Redis, prefix: str
) -> None:
    counter = StockCounter(r)
    row, other = prefix + "row:0", prefix + "row:1"
    # a copy of version 7 is set, with its version beside it
    assert counter.set_newer({row: (3, 7)}) == 1
    assert (counter.get(row), r.get(row + ":version")) == (3, b"7")
    # an older copy arriving late changes nothing; a newer one and the same one again do
    assert counter.set_newer({row: (9, 6)}) == 0 and counter.get(row) == 3
    assert counter.set_newer({row: (4, 8)}) == 1 and counter.get(row) == 4
    counter.set(row, 99)  # a counter gone wrong under an unchanged version
    assert counter.set_newer({row: (4, 8)}) == 1 and counter.get(row) == 4
    # without create a missing counter stays missing; with it, it is made even where a stale
    # version was left behind
    assert counter.set_newer({other: (5, 1)}, create=False) == 0 and r.exists(other) == 0
    r.set(other + ":version", 50)
    assert counter.set_newer({other: (5, 1)}) == 1 and counter.get(other) == 5
    # force sets whatever version is there (a repair)
    assert counter.set_newer({row: (2, 1)}, force=True) == 1
    assert (counter.get(row), r.get(row + ":version")) == (2, b"1")
    # bad values are refused before Redis is touched
    with pytest.raises(ValueError):
        counter.set_newer({row: (-1, 9)})
    with pytest.raises(ValueError):
        counter.set_newer({row: (1, "9")})  # type: ignore[dict-item]
    assert counter.get(row) == 2
    assert counter.set_newer({}) == 0


@pytest.mark.parametrize("qty", [0, -1, 1.5, True, "1", None])
def test_quantity_must_be_a_positive_int(r: redis.Redis, prefix: str, qty: object) -> None:
    counter = StockCounter(r)
    key = prefix + "sku"
    counter.set(key, 5)
    with pytest.raises(ValueError):
        counter.take(key, qty)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        counter.give_back(key, qty)  # type: ignore[arg-type]
    assert counter.get(key) == 5


@pytest.mark.parametrize("value", [-1, 2.5, True, "3"])
def test_stock_values_must_be_non_negative_ints(r: redis.Redis, prefix: str, value: object) -> None:
    counter = StockCounter(r)
    with pytest.raises(ValueError):
        counter.set(prefix + "sku", value)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        counter.set_many({prefix + "ok": 1, prefix + "sku": value})  # type: ignore[dict-item]
    assert r.exists(prefix + "sku", prefix + "ok") == 0  # set_many validates before writing


def test_a_non_integer_counter_is_an_error(r: redis.Redis, prefix: str) -> None:
    counter = StockCounter(r)
    key = prefix + "sku"
    r.set(key, "lots")
    with pytest.raises(redis.exceptions.ResponseError, match="does not hold an integer"):
        counter.take(key, 1)
    assert r.get(key) == b"lots"


def test_works_with_decode_responses(prefix: str) -> None:
    client = redis.Redis.from_url(redis_url(), decode_responses=True)
    try:
        counter = StockCounter(client)
        counter.set(prefix + "sku", 3)
        assert counter.take(prefix + "sku", 2) == 1
        assert counter.get(prefix + "sku") == 1
        assert counter.get_many([prefix + "sku"]) == [1]
    finally:
        client.close()


PROCESSES = 16
ATTEMPTS = 2000
STOCK = 500


def _hammer(url: str, key: str, attempts: int, barrier, results) -> None:
    client = redis.Redis.from_url(url)
    try:
        counter = StockCounter(client)
        barrier.wait(60)
        results.put([counter.take(key, 1) for _ in range(attempts)])
    except BaseException as exc:
        results.put(repr(exc))
    finally:
        client.close()


def test_concurrent_takes_never_oversell(r: redis.Redis, prefix: str) -> None:
    key = prefix + "hot-sku"
    StockCounter(r).set(key, STOCK)
    # spawn: every process starts clean, with its own client.
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [
        ctx.Process(
            target=_hammer, args=(redis_url(), key, ATTEMPTS // PROCESSES, barrier, results)
        )
        for _ in range(PROCESSES)
    ]
    outcomes = gather_from_processes(procs, results)
    assert all(isinstance(o, list) for o in outcomes), outcomes
    assert [proc.exitcode for proc in procs] == [0] * PROCESSES
    returned = [value for outcome in outcomes for value in outcome]
    assert len(returned) == ATTEMPTS
    successes = [value for value in returned if value >= 0]
    # Every successful DECRBY returns a distinct remaining value: 499, 498, ..., 0.
    assert sorted(successes) == list(range(STOCK))
    assert returned.count(StockCounter.INSUFFICIENT) == ATTEMPTS - STOCK
    assert StockCounter(r).get(key) == 0


def test_give_back_once_applies_a_marker_exactly_once():
    client = redis.Redis.from_url(redis_url())
    prefix = unique_prefix("once")
    try:
        counter = StockCounter(client)
        counter.set_many({f"{prefix}:a": 1, f"{prefix}:b": 2})
        amounts = {f"{prefix}:a": 3, f"{prefix}:b": 4, f"{prefix}:missing": 5}
        assert counter.give_back_once(f"{prefix}:done", amounts) is True
        assert counter.give_back_once(f"{prefix}:done", amounts) is False
        assert counter.get_many([f"{prefix}:a", f"{prefix}:b", f"{prefix}:missing"]) == [
            4,
            6,
            None,
        ]
        assert 0 < client.ttl(f"{prefix}:done") <= 7 * 24 * 3600
    finally:
        delete_prefix(client, prefix)


def test_take_spread_takes_from_one_counter_in_turn_or_from_several(
    r: redis.Redis, prefix: str
) -> None:
    counter = StockCounter(r)
    keys = [f"{prefix}row:{index}" for index in range(3)]
    cursor = prefix + "turn"
    assert counter.take_spread(cursor, keys, 1) is None  # missing counters: nothing taken
    counter.set_many(dict(zip(keys, [2, 2, 1], strict=True)))

    # one unit at a time lands on the rows in turn
    taken = [counter.take_spread(cursor, keys, 1) for _ in range(3)]
    assert sorted(next(iter(plan)) for plan in taken) == [0, 1, 2]
    # no single row holds 2 now (1, 1, 0): the units come from several, lowest first
    assert counter.take_spread(cursor, keys, 2) == {0: 1, 1: 1}
    assert counter.take_spread(cursor, keys, 1) == {}  # sold out: nothing taken
    assert counter.get_many(keys) == [0, 0, 0]


def _rows_and_locks(prefix: str) -> tuple[list[str], list[str]]:
    """Three rows' counters and their locks."""
    return [f"{prefix}row:{i}" for i in range(3)], [f"{prefix}lock:{i}" for i in range(3)]


def test_lock_first_holding_locks_a_free_row_that_holds_the_quantity(
    r: redis.Redis, prefix: str
) -> None:
    from locking import Lock

    counter = StockCounter(r)
    keys, locks = _rows_and_locks(prefix)
    take = {"start": 0, "ttl_ms": 5000}
    assert counter.lock_first_holding(keys, locks, 1, token="t0", **take) == (None, [], None)
    assert all(r.get(lock) is None for lock in locks)  # missing counters: nothing locked
    counter.set_many(dict(zip(keys, [0, 5, 5], strict=True)))

    # the first row from `start` that holds the quantity and is free, locked with the token,
    # and a fencing token for each grant
    row, levels, fence1 = counter.lock_first_holding(keys, locks, 1, token="t1", **take)
    assert (row, levels) == (1, [0, 5, 5]) and fence1 and fence1 > 0
    row, levels, fence2 = counter.lock_first_holding(keys, locks, 1, token="t2", **take)
    assert (row, levels) == (2, [0, 5, 5]) and fence2 and fence2 > 0
    assert counter.lock_first_holding(keys, locks, 1, token="t3", **take)[::2] == (-1, None)
    assert (r.get(locks[1]), r.get(locks[2]), r.get(locks[0])) == (b"t1", b"t2", None)

    # and the Lock adopts what the script took: owned, with its fence, then released
    lock = Lock(r, locks[1], timeout=5)
    lock.adopt("t1", fence1)
    assert lock.owned() and lock.fence == fence1
    lock.release()
    assert r.get(locks[1]) is None
    row, _, fence4 = counter.lock_first_holding(keys, locks, 1, token="t4", **take)
    assert row == 1 and fence4 and fence4 > fence1  # the same lock's next grant: a later fence


def test_lock_first_holding_many_runs_each_call_in_order_in_one_round_trip(
    r: redis.Redis, prefix: str
) -> None:
    from locking.counter import LockFirst

    counter = StockCounter(r)
    keys, locks = _rows_and_locks(prefix)
    missing = LockFirst(keys, locks, 1, 0, "t0", 5000)
    assert counter.lock_first_holding_many([missing]) == [(None, [], None)]
    counter.set_many(dict(zip(keys, [1, 3, 0], strict=True)))
    r.set(locks[0], "someone")

    # each call finds the locks of the calls before it taken: four buyers of one unit get the
    # one free row holding it; the next waits (-1); one of 4 units finds no row holding it
    calls = [LockFirst(keys, locks, qty, 0, f"t{n}", 5000) for n, qty in enumerate([1, 1, 4])]
    (first, levels, fence), (second, _, none), (third, _, _) = counter.lock_first_holding_many(
        calls
    )
    assert (first, levels, fence is not None) == (1, [1, 3, 0], True)
    assert (second, none, third) == (-1, None, -1)
    assert (r.get(locks[0]), r.get(locks[1]), r.get(locks[2])) == (b"someone", b"t0", None)
    assert counter.lock_first_holding_many([]) == []
    with pytest.raises(ValueError):
        counter.lock_first_holding_many([LockFirst(keys, locks[:2], 1, 0, "t9", 5000)])
    assert r.get(locks[2]) is None  # a call refused before anything was sent


def test_a_claimed_take_keeps_twins_out_until_its_taker_gives_it_up(
    r: redis.Redis, prefix: str
) -> None:
    counter = StockCounter(r)
    cursor, keys = prefix + "turn", [prefix + "row:0", prefix + "row:1"]
    counter.set_many(dict.fromkeys(keys, 1))
    first, twin = Claim(prefix + "claim", ttl_ms=5000), Claim(prefix + "claim", ttl_ms=5000)

    assert counter.take_spread(cursor, keys, 1, claim=first) in ({0: 1}, {1: 1})
    assert r.get(first.key) == first.token.encode() and 0 < r.pttl(first.key) <= 5000
    # the twin takes nothing while the claim stands, whether units are left or not
    with pytest.raises(KeyClaimed):
        counter.take_spread(cursor, keys, 1, claim=twin)
    assert counter.get_many(keys).count(1) == 1
    counter.set_many(dict.fromkeys(keys, 0))
    with pytest.raises(KeyClaimed):
        counter.take_spread(cursor, keys, 1, claim=twin)
    # only its taker gives it up; then the twin is answered like anyone (sold out here)
    counter.release_claim(twin)
    assert counter.claim_held(first)
    counter.release_claim(first)
    assert not counter.claim_held(first)
    assert counter.take_spread(cursor, keys, 1, claim=twin) == {}
    assert not r.exists(twin.key)  # nothing taken: no claim set
    # takes without a claim never look at it
    counter.set(keys[0], 1)
    r.set(first.key, "someone")
    assert counter.take_spread(cursor, keys, 1) == {0: 1}
    with pytest.raises(ValueError):
        Claim(prefix + "claim", ttl_ms=0)


def test_many_takes_in_one_script_answer_each_as_if_run_alone(r: redis.Redis, prefix: str) -> None:
    from locking.counter import Take

    counter = StockCounter(r)
    item_a = [f"{prefix}a:{index}" for index in range(3)]
    item_b = [f"{prefix}b:{index}" for index in range(2)]
    missing = [f"{prefix}gone:{index}" for index in range(2)]
    counter.set_many(dict(zip(item_a, [2, 2, 1], strict=True)))
    counter.set_many(dict.fromkeys(item_b, 1))
    held = Claim(prefix + "claim", ttl_ms=5000)
    twin = Claim(prefix + "claim", ttl_ms=5000)
    turn_a, turn_b = prefix + "turn:a", prefix + "turn:b"

    results = counter.take_spread_many(
        [
            Take(turn_a, item_a, 1),
            Take(turn_a, item_a, 1, claim=held),
            Take(turn_a, item_a, 1, claim=twin),  # the claim above now stands
            Take(prefix + "turn:gone", missing, 1),
            Take(turn_b, item_b, 3),  # more than there is: nothing taken
            Take(turn_b, item_b, 2),  # from both rows, lowest first
            Take(turn_b, item_b, 1),  # sold out
            Take(turn_a, item_a, 1),
        ]
    )

    in_turn = [results[0], results[1], results[7]]
    assert sorted(next(iter(plan)) for plan in in_turn) == [0, 1, 2]  # the rows in turn
    assert all(plan == {next(iter(plan)): 1} for plan in in_turn)
    assert results[2] is twin and not twin.held  # the twin waits, nothing taken
    assert held.held and r.get(held.key) == held.token.encode()
    assert results[3] is None and r.exists(*missing) == 0
    assert results[4] == {} and results[5] == {0: 1, 1: 1} and results[6] == {}
    assert counter.get_many(item_a) == [1, 1, 0] and counter.get_many(item_b) == [0, 0]
    assert counter.take_spread_many([]) == []


@pytest.mark.parametrize(
    ("cursor", "counters", "qty"),
    [
        ("t", [], 1),
        ("t", ["k"], 0),
        ("t", ["k"], True),
        ("t", "k", 1),
        (None, ["k"], 1),
        ("t", ("k", 1), 1),
        ("t", ("k", ["j"]), 1),
        ("t", ["k", b"j"], 1),
        ("t", (), 1),
    ],
)
def test_a_take_with_bad_arguments_is_refused_before_redis(cursor, counters, qty) -> None:
    from locking.counter import Take

    with pytest.raises(ValueError):
        Take(cursor, counters, qty)
