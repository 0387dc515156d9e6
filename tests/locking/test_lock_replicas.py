"""`ReplicatedLock(replicas=N)`: an acquisition counts only once N replicas hold it (WAIT), on a
real primary and replica; a lock only the primary holds is given up, not used."""

from __future__ import annotations

import time

import pytest

from locking import Lock, ReplicatedLock
from shop.processes.redis_server import RedisServer


@pytest.fixture
def primary_and_replica():
    with RedisServer() as primary:
        with RedisServer(args=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
            client = replica.client(socket_timeout=5)
            deadline = time.monotonic() + 10
            while client.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica did not synchronise"
                time.sleep(0.02)
            yield primary, replica


def test_an_acquire_counts_once_the_replica_holds_the_lock(primary_and_replica):
    primary, replica = primary_and_replica
    lock = ReplicatedLock(primary.client(socket_timeout=5), "item:lock", timeout=5, replicas=1)

    assert lock.acquire(blocking=False)

    # the replica had the lock before acquire returned
    assert replica.client().get("item:lock") == lock.local.token
    assert 4000 < replica.client().pttl("item:lock") <= 5000
    lock.release()


def test_a_lock_no_replica_acknowledges_is_given_up_and_handed_on(primary_and_replica):
    primary, replica = primary_and_replica
    client = primary.client(socket_timeout=5)
    replica.pause()  # it acknowledges nothing
    try:
        lock = ReplicatedLock(client, "item:lock", timeout=5, replicas=1, replica_timeout=0.2)
        asked = time.monotonic()
        assert not lock.acquire(blocking=False)
        assert time.monotonic() - asked > 0.15  # it waited for the replica, in vain
        # what it took on the primary is released: the next buyer gets the lock at once
        assert client.get("item:lock") is None
        assert Lock(client, "item:lock", timeout=5).acquire(blocking=False)
        # and more replicas than there are is never enough
        two = ReplicatedLock(client, "other:lock", timeout=5, replicas=2, replica_timeout=0.1)
        assert not two.acquire(blocking=False)
    finally:
        replica.resume()


def test_a_plain_lock_does_not_wait_for_the_replica(primary_and_replica):
    primary, replica = primary_and_replica
    replica.pause()
    try:
        lock = Lock(primary.client(socket_timeout=5), "item:lock", timeout=5)
        assert lock.acquire(blocking=False)  # granted by the primary alone
    finally:
        replica.resume()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timeout": 5, "replicas": -1}, "replicas must be"),
        ({"timeout": 5, "replicas": 0}, "replicas must be"),
        ({"timeout": 5, "replicas": True}, "replicas must be"),
        ({"timeout": 5, "replicas": "1"}, "replicas must be"),
        ({"replicas": 1}, "needs a timeout"),
        ({"timeout": 5, "replicas": 1, "replica_timeout": 0}, "replica_timeout"),
    ],
)
def test_bad_replica_options_are_refused(r, options, message):
    with pytest.raises(ValueError, match=message):
        ReplicatedLock(r, "item:lock", **options)
