"""`locking` on a real Redis Cluster (3 masters, 3 replicas from the redis-server binary): the
lock's scripts stay in the slot of its hash tag, and the counters' calls over many keys go
slot by slot where they need no atomicity between them."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from redis.exceptions import RedisClusterException

from locking import Lock, StockCounter, WakeHubLock
from locking.cluster import has_hash_tag, slot
from locking.counter import Claim, Take
from shop.processes.redis_cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(masters=3, replicas=1) as local:
        yield local


@pytest.fixture
def rc(cluster):
    client = cluster.client()
    yield client
    client.close()


def _tag() -> str:
    return uuid.uuid4().hex[:10]


def test_hash_tags_are_recognised():
    assert has_hash_tag("lock:{item:1}") and has_hash_tag(b"a{b}c")
    assert not has_hash_tag("lock:item:1") and not has_hash_tag("a{}b") and not has_hash_tag("}{")
    assert slot("x:{item:1}:queue") == slot("y:{item:1}") != slot("y:{item:2}")


def test_a_lock_name_without_a_hash_tag_is_refused_on_a_cluster(rc):
    with pytest.raises(ValueError, match="has no hash tag"):
        Lock(rc, "lock:item:no-tag")
    with pytest.raises(ValueError, match="the wake hub needs a single Redis"):
        WakeHubLock(rc, "lock:{item:1}", hub_prefix="hub")


def test_contended_locks_on_a_cluster_exclude_and_hand_over_in_order(rc, cluster):
    # Given three locks whose names land on (likely) different masters, 6 threads each
    names = [f"lock:{{t-{_tag()}}}" for _ in range(3)]
    counts = {name: 0 for name in names}
    inside = {name: 0 for name in names}
    overlaps = []
    fences: dict[str, list[int]] = {name: [] for name in names}
    guard = threading.Lock()

    def work(name: str) -> None:
        lock = Lock(rc, name, timeout=5, blocking_timeout=20)
        for _ in range(25):
            assert lock.acquire()
            with guard:
                inside[name] += 1
                if inside[name] > 1:
                    overlaps.append(name)
                fences[name].append(lock.fence)
            seen = counts[name]
            time.sleep(0.001)  # a gap between read and write, for a second holder to fall in
            counts[name] = seen + 1
            with guard:
                inside[name] -= 1
            lock.release()

    threads = [threading.Thread(target=work, args=(name,)) for name in names for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    # Then every increment of every lock's counter survived, holders never overlapped, and
    # each lock's fences grew with every grant
    assert not overlaps
    assert counts == {name: 150 for name in names}
    for name in names:
        assert fences[name] == sorted(fences[name]) and len(set(fences[name])) == 150
        # and nothing is left of the lock or its helper keys on the cluster
        assert rc.exists(name, f"{name}:queue", f"{name}:waiters") == 0


def test_counters_spread_over_slots_are_read_set_and_given_back_slot_by_slot(rc, cluster):
    names = [f"row:{{r-{_tag()}}}" for _ in range(5)]
    while len({cluster.port_of(name) for name in names}) < 2:
        names[0] = f"row:{{r-{_tag()}}}"
    names.append(f"row:{{r-{_tag()}}}")
    counter = StockCounter(rc)
    counter.set_many({name: index for index, name in enumerate(names)})
    assert counter.get_many(names) == list(range(6))
    counter.give_back_many({name: 10 for name in names})
    assert counter.get_many(names) == [10 + index for index in range(6)]
    # versions stay with their counters: an older copy never replaces a newer one
    assert counter.set_newer({name: (5, 2) for name in names}) == 6
    assert counter.set_newer({name: (7, 1) for name in names}) == 0
    assert counter.get_many(names) == [5] * 6


def test_many_takes_over_several_sales_run_one_script_per_slot(rc):
    # Given three sales, each with its cursor, counters and claims in a slot of its own
    sales = []
    counter = StockCounter(rc)
    for _ in range(3):
        tag = f"{{s-{_tag()}}}"
        rows = [f"{tag}:row:{i}" for i in range(3)]
        counter.set_many({row: 2 for row in rows})
        sales.append((f"{tag}:turn", rows, tag))
    assert len({slot(cursor) for cursor, _, _ in sales}) == 3

    # When one call takes for all three, interleaved, one take with a claim
    takes = []
    for round_number in range(4):
        for cursor, rows, tag in sales:
            claim = Claim(f"{tag}:claim:k{round_number}", 5000) if round_number == 0 else None
            takes.append(Take(cursor, rows, 2, claim))
    results = counter.take_spread_many(takes)

    # Then each take got what it would have got alone, in order: three takes of 2 per sale
    # (6 units each), the fourth sold out
    assert [bool(result) for result in results] == [True] * 9 + [False] * 3
    for _, rows, _ in sales:
        assert counter.get_many(rows) == [0, 0, 0]
    assert all(take.claim.held for take in takes[:3] if take.claim)


def test_the_first_free_row_holding_the_quantity_is_locked_across_slots(rc, cluster):
    rows = [f"item:x:row:{{sh-{_tag()}-{i}}}" for i in range(10)]
    locks = [f"lock:{row[row.index('{') :]}" for row in rows]
    assert all(slot(row) == slot(lock) for row, lock in zip(rows, locks, strict=True))
    assert len({cluster.port_of(row) for row in rows}) >= 2
    counter = StockCounter(rc)
    counter.set_many({row: (3 if i in (4, 7) else 0) for i, row in enumerate(rows)})
    rc.set(locks[4], "someone")

    picked, levels, fence = counter.lock_first_holding(
        rows, locks, 2, start=2, token="me", ttl_ms=5000
    )
    assert picked == 7 and fence is not None and fence > 0
    assert levels == [3 if i in (4, 7) else 0 for i in range(10)]
    assert rc.get(locks[7]) == b"me"

    # every row holding 2 locked: -1; a missing counter: None
    assert counter.lock_first_holding(rows, locks, 2, start=0, token="you", ttl_ms=5000)[0] == -1
    rc.delete(rows[0])
    assert counter.lock_first_holding(rows, locks, 1, start=0, token="you", ttl_ms=5000) == (
        None,
        [],
        None,
    )


def test_a_script_over_two_slots_is_refused_by_the_client(rc):
    counter = StockCounter(rc)
    with pytest.raises(RedisClusterException):
        counter.take_spread("{a}:turn", ["{b}:row:0"], 1)
