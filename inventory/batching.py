"""Group commit inside one process: the checkouts in flight in it are written together.

A thread hands its request to `Batcher.submit` and waits. When no batch is being written, it
leads: it takes the requests waiting, up to `most` (its own first), runs `write` on them in
its own thread (its own connections), passes the lead to the oldest request that arrived
meanwhile, and gives each waiting thread its answer. A lone request is a batch of one that
waits for nothing; a batch holds the requests that came during the last write, and a leader
that finds fewer than the last batch held waits up to `gather` seconds for the threads just
answered to come back (PostgreSQL's `commit_delay`). The batcher knows nothing of what it writes.

A request still waiting when its deadline passes is withdrawn and answered `Expired`: it was
never written. Once in a batch, it waits for the batch's answer; bounding the write by the
batch's deadlines is `write`'s job. Decision records: docs/decisions/0001 (group commit in the
web process), 0025 (the lead before the answers), 0027 (the leader gathers).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Request = TypeVar("Request")
Answer = TypeVar("Answer")


class Expired(Exception):
    """The request's deadline passed before any batch took it: nothing of it was written."""


@dataclass(eq=False)
class _Waiting(Generic[Request, Answer]):
    request: Request
    deadline: float
    woken: threading.Event = field(default_factory=threading.Event)
    #: Set instead of an answer: this thread leads the next batch.
    leads: bool = False
    answer: Answer | BaseException | None = None


#: How long a leader waits for its last batch's size (docs/decisions/0027): a thread answered
#: comes back within a fraction of a millisecond when more requests wait for it.
GATHER_SECONDS = 0.001


class Batcher(Generic[Request, Answer]):
    """Runs `write(requests)` for the requests of concurrent threads, one batch at a time.

    `write` returns one answer per request, in order: a value, or an exception for that
    request's thread to raise. An exception `write` raises is every request's answer.
    `gather`: seconds a leader waits for as many requests as its last batch held (0: none).
    """

    def __init__(
        self,
        write: Callable[[list[Request]], Sequence[Answer | BaseException]],
        *,
        most: int = 64,
        gather: float = GATHER_SECONDS,
    ) -> None:
        self._write = write
        self._most = most
        self._gather = gather
        self._lock = threading.Lock()
        #: Notified, under `_lock`, when a gathering leader has as many requests as it waits for.
        self._arrived = threading.Condition(self._lock)
        self._gathering = False
        #: How many requests the last batch held.
        self._last = 0
        self._queue: deque[_Waiting[Request, Answer]] = deque()
        self._leading = False

    def submit(self, request: Request, *, deadline: float) -> Answer:
        """Write `request` in a batch and return its answer (or raise it). `deadline`: a
        `time.monotonic()` value, after which it is withdrawn if no batch has taken it."""
        waiting: _Waiting[Request, Answer] = _Waiting(request, deadline)
        with self._lock:
            self._queue.append(waiting)
            leads = not self._leading
            self._leading = True
            if self._gathering and len(self._queue) >= self._last:
                self._arrived.notify()  # woken once, when there are as many as it waits for
        if not leads:
            self._wait(waiting)
        if waiting.leads or leads:
            self._lead()
        answer = waiting.answer
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]  # set by the batch that wrote it

    def _gather_last_size(self) -> None:
        """With `_lock` held: wait up to `gather` seconds until as many requests wait as the
        last batch held. A lone request after a lone request never waits."""
        if not self._gather or len(self._queue) >= self._last:
            return
        ends = time.monotonic() + self._gather
        self._gathering = True
        try:
            while len(self._queue) < self._last:
                left = ends - time.monotonic()
                if left <= 0:
                    return
                self._arrived.wait(left)
        finally:
            self._gathering = False

    def _wait(self, waiting: _Waiting[Request, Answer]) -> None:
        left = waiting.deadline - time.monotonic()
        if waiting.woken.wait(max(left, 0) if left != math.inf else None):
            return
        with self._lock:
            if waiting.leads:  # handed the lead as its wait ran out: it leads all the same
                return
            if waiting in self._queue:  # no batch took it: withdraw it
                self._queue.remove(waiting)
                waiting.answer = Expired("the checkout's deadline passed before it was written")
                return
        waiting.woken.wait()  # in a batch being written: its answer comes with the batch's

    def _lead(self) -> None:
        with self._lock:
            self._gather_last_size()
            batch = [self._queue.popleft() for _ in range(min(self._most, len(self._queue)))]
            self._last = len(batch)
        try:
            answers = list(self._write([waiting.request for waiting in batch]))
            if len(answers) != len(batch):
                raise RuntimeError(f"{len(answers)} answers for a batch of {len(batch)}")
        except BaseException as error:  # every request's answer; the leader's thread goes on
            answers = [error] * len(batch)
        # The lead first, then the answers: the next batch's round trips start while the
        # threads just answered go on with their requests (wakened first, they would take the
        # interpreter before it: docs/decisions/0025).
        with self._lock:
            if self._queue:
                following = self._queue[0]
                following.leads = True
                following.woken.set()
            else:
                self._leading = False
        for waiting, answer in zip(batch, answers, strict=True):
            waiting.answer = answer
            waiting.leads = False
            waiting.woken.set()
