"""Group commit over Redis: many takers, one writer at a time, each taker answered.

A taker takes its units from stock counters and queues its request in one script
(:data:`scripts.TAKE_AND_ENQUEUE`). The taker that finds the combiner lock free becomes the
combiner: it pops the queued requests in batches, has them written (one database statement
and one commit for a whole batch, by the caller's ``write`` function), and pushes each taker its
answer. The others wait on their reply key. A combiner hands the lock to the oldest waiting
taker when it is done with its own request, so nobody combines for ever.

Nothing here knows what a request means: requests are JSON objects the caller builds, answers
are JSON objects the caller's ``write`` returns. Only redis-py is needed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import TimeoutError as RedisTimeoutError

from . import scripts
from .counter import Claim, KeyClaimed, StockCounter, claim_args

#: Answer pushed to a taker that now holds the combiner lock (see scripts.RELEASE_COMBINER).
COMBINE = "combine"
#: Longest single BLPOP: well under a client socket timeout, so a wait never trips it.
WAIT_SLICE_SECONDS = 0.2


@dataclass
class Queued:
    """A request taken and queued: its units per counter position, and whether its taker holds
    the combiner lock."""

    request_id: str
    entry: str
    taken: dict[int, int]
    combiner: bool
    token: str = field(default="")


class GroupCommit:
    """One queue of requests and its combiner lock.

    ``write(requests) -> answers`` is called by whichever taker combines, with up to
    ``batch`` decoded requests (each with a ``rows`` member: the units taken per counter
    position); it returns one JSON-serialisable answer per request, in order, and must either
    commit all of the batch's writes or raise (then every taker of the batch is answered
    ``{"o": "failed"}``: the writes may or may not have been made).
    """

    def __init__(
        self,
        redis: Any,
        *,
        queue: str,
        lock: str,
        reply_prefix: str,
        lock_ttl_ms: int = 5000,
        batch: int = 100,
    ) -> None:
        self.redis = redis
        self.queue = queue
        self.lock = lock
        self.reply_prefix = reply_prefix
        self.lock_ttl_ms = lock_ttl_ms
        self.batch = batch
        self._take = scripts.script_for(redis, scripts.TAKE_AND_ENQUEUE)
        self._release = scripts.script_for(redis, scripts.RELEASE_COMBINER)
        self._withdraw = scripts.script_for(redis, scripts.WITHDRAW_REQUEST)

    def take_and_enqueue(
        self,
        *,
        cursor: str,
        counters: Sequence[str],
        qty: int,
        request: dict[str, Any],
        claim: Claim | None = None,
    ) -> Queued | dict[int, int] | None:
        """Take qty units from the counters and queue the request, in one script.

        Returns the Queued request; or, with nothing taken or queued, an empty dict when the
        counters hold fewer than qty units together and None when a counter is missing.
        ``claim`` works as in :meth:`StockCounter.take_spread` (raises KeyClaimed).
        """
        request_id = uuid.uuid4().hex
        token = uuid.uuid4().hex
        body = json.dumps(request, separators=(",", ":"))
        claim_keys, claim_argv = claim_args(claim)
        reply = self._take(
            keys=[cursor, self.queue, self.lock, *counters, *claim_keys],
            args=[qty, request_id, body[:-1], token, self.lock_ttl_ms, *claim_argv],
            client=self.redis,
        )
        if reply[0] == StockCounter.CLAIMED and claim is not None:
            raise KeyClaimed(claim)
        if reply[0] == -2:
            return None
        if reply[0] == -1:
            return {}
        entry = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
        taken = {int(reply[i]): int(reply[i + 1]) for i in range(2, len(reply), 2)}
        if claim is not None:
            claim.held = True
        return Queued(request_id, entry, taken, combiner=bool(reply[0]), token=token)

    def settle(
        self, queued: Queued, write: Callable[[list[dict[str, Any]]], list[Any]], wait: float
    ) -> dict[str, Any] | None:
        """The answer to a queued request: written by this caller as the combiner, or by
        another; None when none came within ``wait`` seconds, or when this caller combined and
        found its request gone from the queue (another combiner took it). Then :meth:`withdraw`
        tells whether it can still be written. Redis errors propagate, and so does an error of
        ``write`` for the batch this caller combined (the request may be written or not).
        """
        deadline = time.monotonic() + wait
        while True:
            if queued.combiner:
                answer = self._combine(queued, write)
                if answer is not None:
                    return answer
                return None  # our request was not in the queue: withdrawn or lost
            answer = self._wait(queued.request_id, deadline)
            if answer is None:
                return None
            if answer.get("o") == COMBINE:
                queued.combiner = True
                queued.token = f"handoff:{queued.request_id}"
                continue
            return answer

    def answer_for(self, queued: Queued, wait: float) -> dict[str, Any] | None:
        """Wait up to ``wait`` seconds more for the answer to a request a combiner took (after
        :meth:`withdraw` returned False); None if it still has not come."""
        deadline = time.monotonic() + wait
        while True:
            answer = self._wait(queued.request_id, deadline)
            if answer is None or answer.get("o") != COMBINE:
                return answer
            # A hand-over that came as we withdrew: the withdrawal handed the lock on.

    def withdraw(self, queued: Queued) -> bool:
        """Take a request no answer came for out of the queue; True when it was still there
        (no combiner took it, so it will never be written), False when one did."""
        removed = self._withdraw(
            keys=[self.queue, self.lock],
            args=[
                queued.entry,
                f"handoff:{queued.request_id}",
                self.lock_ttl_ms,
                self.reply_prefix,
            ],
            client=self.redis,
        )
        return bool(removed)

    def _wait(self, request_id: str, deadline: float) -> dict[str, Any] | None:
        key = self.reply_prefix + request_id
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                popped = self.redis.blpop(
                    [key], timeout=round(max(min(left, WAIT_SLICE_SECONDS), 0.001), 3)
                )
            except RedisTimeoutError:
                continue  # the client gave up before the server's BLPOP did: ask again
            if popped is not None:
                return json.loads(popped[1])

    def _combine(
        self, queued: Queued, write: Callable[[list[dict[str, Any]]], list[Any]]
    ) -> dict[str, Any] | None:
        """Write batches until our own request is answered, then hand the lock on."""
        own: dict[str, Any] | None = None
        try:
            while own is None:
                popped = self.redis.lpop(self.queue, self.batch)
                if not popped:
                    break
                ids, requests = [], []
                for raw in popped:
                    text = raw.decode() if isinstance(raw, bytes) else raw
                    request_id, _, body = text.partition("|")
                    ids.append(request_id)
                    requests.append(json.loads(body))
                try:
                    answers = write(requests)
                except Exception:
                    answers = [{"o": "failed"}] * len(requests)
                    self._answer(ids, answers, skip=queued.request_id)
                    raise
                self._answer(ids, answers, skip=queued.request_id)
                for request_id, answer in zip(ids, answers, strict=True):
                    if request_id == queued.request_id:
                        own = answer
        finally:
            self._release(
                keys=[self.queue, self.lock],
                args=[queued.token, self.lock_ttl_ms, self.reply_prefix],
                client=self.redis,
            )
        return own

    def _answer(self, ids: list[str], answers: list[Any], *, skip: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for request_id, answer in zip(ids, answers, strict=True):
            if request_id == skip:
                continue
            key = self.reply_prefix + request_id
            pipe.rpush(key, json.dumps(answer, separators=(",", ":")))
            pipe.pexpire(key, 60_000)
        pipe.execute()
