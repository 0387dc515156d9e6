"""The lock scenario about failover: a lock the primary granted and never replicated.

It starts the servers it needs beyond its own Redis (a replica, other masters) and stops
them before it returns. See docs/lab.md#the-scenarios.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis

from locking import Lock, ProcessFences, QuorumLock, ReplicatedLock
from shop.processes.redis_server import RedisServer

from ..proxy import LossyProxy
from .base import Outcome, Recorder, RedisHost, Scenario, Variant
from .interleaving import NAME


def _replica_of(port: int) -> RedisServer:
    """A replica of the Redis at `port`, started and synchronised."""
    replica = RedisServer(args=["--replicaof", "127.0.0.1", str(port)]).start()
    client = replica.client(socket_timeout=5)
    deadline = time.monotonic() + 10
    while client.info("replication").get("master_link_status") != "up":
        if time.monotonic() > deadline:
            replica.stop()
            raise RuntimeError("the replica did not synchronise within 10 s")
        time.sleep(0.02)
    return replica


def _holding(clients: list[redis.Redis], token: bytes | None) -> int:
    """How many of the masters hold the lock with `token` (none when there is no token)."""
    if token is None:
        return 0
    return sum(client.get(NAME) == token for client in clients)


class FailoverLosesLock(Scenario):
    name = "failover-loses-lock"
    measure = "holders at once beyond one"
    article = "setnx-expire"
    warning = "a lock the primary granted and never replicated is granted again by the replica"
    explanation = (
        "the link to the replica is cut, A takes the lock on the primary, the primary dies, the "
        "replica is promoted and grants the lock to B: two holders. The shop's two fixes, one "
        "after the other: an acquire that WAITs for the replica does not count a lock only the "
        "primary holds (A is refused, B alone holds); a quorum lock on three independent "
        "masters, the first failing over the same way, still finds A's lock on the other two "
        "(B is refused until A releases)"
    )

    #: The quorum lock's masters, how long B keeps asking them while A holds the lock, and how
    #: long B works once it holds it.
    MASTERS = 3
    B_ASKS = 0.3
    WORK = 0.1

    def run(self, variant: Variant, redis_host: RedisHost) -> Outcome:
        recorder = Recorder()
        replicas = 0 if variant == "naive" else 1
        holders, replicated_while_up = self._one_primary(redis_host, recorder, replicas)
        details: dict[str, Any] = {"acquire_with_the_replica_up": replicated_while_up}
        if variant == "fixed":
            details["most_holders_waiting_for_the_replica"] = holders
            details |= self._quorum(recorder)
        return recorder.outcome(
            recorder.most_holders - 1, most_holders=recorder.most_holders, **details
        )

    def _one_primary(
        self, redis_host: RedisHost, recorder: Recorder, replicas: int
    ) -> tuple[int, bool]:
        """`ReplicatedLock(replicas=...)` (`Lock` with none) on `redis_host`, the primary, and a
        replica behind a cut link: (how many held the lock at once after B asked for it,
        whether an acquire was granted while the link was up)."""

        def lock_on(client: redis.Redis, name: str, replica_timeout: float = 0.1) -> Lock:
            if not replicas:
                return Lock(client, name, timeout=5)
            return ReplicatedLock(
                client, name, timeout=5, replicas=replicas, replica_timeout=replica_timeout
            )

        with LossyProxy(redis_host.port) as link:
            replica = _replica_of(link.port)  # it replicates through the proxy
            try:
                primary = redis_host.client(socket_timeout=5)
                promoted = replica.client(socket_timeout=5)
                # With the replica in step, the WAITed acquire takes the lock as usual.
                check = lock_on(primary, f"{NAME}:check")
                replicated_while_up = check.acquire(blocking=False)
                if replicated_while_up:
                    check.release()
                link.cut()  # a partition: the replica hears nothing from now on
                recorder.note("replica", "cut off")
                a = lock_on(primary, NAME, replica_timeout=0.2)
                if a.acquire(blocking=False):
                    recorder.acquired("A", "on the primary")
                else:
                    recorder.note("A", "refused", "no replica acknowledged the lock")
                redis_host.kill()
                recorder.note("primary", "died", "SIGKILL")
                promoted.replicaof("NO", "ONE")
                recorder.note("replica", "promoted")
                b = Lock(promoted, NAME, timeout=5)
                if not b.acquire(blocking_timeout=2):
                    return len(recorder.holding()), replicated_while_up
                recorder.acquired("B", "on the promoted replica")
                holders = len(recorder.holding())
                time.sleep(self.WORK)
                recorder.released("B")
                b.release()
                return holders, replicated_while_up
            finally:
                replica.stop()

    def _quorum(self, recorder: Recorder) -> dict[str, Any]:
        """`QuorumLock` on MASTERS masters of the run's own; the first replicates to a replica
        behind a cut link, dies after granting A's lock, and its replica takes its place."""
        fences = ProcessFences()
        with contextlib.ExitStack() as servers:
            masters = [servers.enter_context(RedisServer()) for _ in range(self.MASTERS)]
            link = servers.enter_context(LossyProxy(masters[0].port))
            replica = _replica_of(link.port)
            servers.callback(replica.stop)
            clients = [master.client(socket_timeout=0.5) for master in masters]
            link.cut()
            recorder.note(
                "replica 1", "cut off", f"from master 1, one of {self.MASTERS} independent masters"
            )
            a = QuorumLock(clients, NAME, timeout=5, fence_source=fences)
            a_holds = a.acquire(blocking=False)
            if a_holds:
                granted = _holding(clients, a.local.token)
                recorder.acquired("A", f"on {granted} of {self.MASTERS} masters, fence {a.fence}")
            else:
                recorder.note("A", "refused", "no majority of the masters granted the lock")
            masters[0].kill()
            recorder.note("master 1", "died", "SIGKILL")
            promoted = replica.client(socket_timeout=0.5)
            promoted.replicaof("NO", "ONE")
            recorder.note("replica 1", "promoted", "in master 1's place, without A's lock")
            clients[0] = promoted
            holding_a = _holding(clients, a.local.token)
            b = QuorumLock(clients, NAME, timeout=5, fence_source=fences, retry_delay=0.05)
            b_holds = b.acquire(blocking_timeout=self.B_ASKS)
            if b_holds:
                recorder.acquired("B", f"on a majority of the masters, fence {b.fence}")
            else:
                recorder.note(
                    "B",
                    "refused",
                    f"for {self.B_ASKS:g} s: A's lock is on {holding_a} of {self.MASTERS} masters",
                )
            holders = len(recorder.holding())
            handed_out = [a.fence]
            if a_holds:
                recorder.released("A")
                a.release()  # master 1 is gone: the others delete it
            granted_once_a_released = False
            if not b_holds:
                granted_once_a_released = b_holds = b.acquire(blocking=False)
                if b_holds:
                    recorder.acquired("B", f"once A released, fence {b.fence}")
            handed_out.append(b.fence)
            if b_holds:
                time.sleep(self.WORK)
                recorder.released("B")
                b.release()
        return {
            "most_holders_on_the_quorum": holders,
            "masters_holding_a_after_the_failover": holding_a,
            "b_granted_once_a_released": granted_once_a_released,
            "quorum_fences": handed_out,
        }
