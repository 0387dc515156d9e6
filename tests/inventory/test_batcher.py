"""`inventory.batching.Batcher`: group commit among the threads of one process (pure logic,
real threads; the batches it writes for `lua` are tested in test_group_commit.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from inventory.batching import Batcher, Expired

LATER = time.monotonic() + 3600


class Recorder:
    """A `write` that records its batches; the first one waits for `release` when `hold`."""

    def __init__(self, hold: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.writing = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.lock = threading.Lock()

    def __call__(self, requests: list[int]) -> list[int | BaseException]:
        with self.lock:
            self.batches.append(list(requests))
            first = len(self.batches) == 1
        if first:
            self.writing.set()
            assert self.release.wait(30)
        return [ValueError(n) if n < 0 else n * 10 for n in requests]


def test_a_lone_request_is_a_batch_of_one_and_gets_its_answer():
    write = Recorder()
    batcher = Batcher(write)

    assert batcher.submit(4, deadline=LATER) == 40
    assert batcher.submit(5, deadline=LATER) == 50
    assert write.batches == [[4], [5]]


def test_requests_that_arrive_while_a_batch_is_written_go_in_the_next_one_together():
    # Given a batch being written (held until released)
    write = Recorder(hold=True)
    batcher = Batcher(write)
    with ThreadPoolExecutor(9) as pool:
        first = pool.submit(batcher.submit, 1, deadline=LATER)
        assert write.writing.wait(10)
        # When eight more requests arrive meanwhile
        others = [pool.submit(batcher.submit, n, deadline=LATER) for n in range(2, 10)]
        deadline = time.monotonic() + 10
        while len(batcher._queue) < 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        write.release.set()
        answers = [first.result(10)] + [future.result(10) for future in others]
    # Then they are written as one batch, each answered its own
    assert answers == [n * 10 for n in range(1, 10)]
    assert write.batches[0] == [1]
    assert sorted(write.batches[1]) == list(range(2, 10))
    assert len(write.batches) == 2


def _two_batches(batcher: Batcher, write: Recorder) -> None:
    """Batches [1], then [2, 3]: the batcher's last batch held two."""
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(batcher.submit, 1, deadline=LATER)
        assert write.writing.wait(10)
        pair = [pool.submit(batcher.submit, n, deadline=LATER) for n in (2, 3)]
        deadline = time.monotonic() + 10
        while len(batcher._queue) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        write.release.set()
        assert [first.result(10)] + [future.result(10) for future in pair] == [10, 20, 30]
    assert [sorted(batch) for batch in write.batches] == [[1], [2, 3]]


def test_a_leader_gathers_as_many_requests_as_its_last_batch_held():
    # Given a batcher whose last batch held two
    write = Recorder(hold=True)
    batcher = Batcher(write, gather=60)
    _two_batches(batcher, write)
    with ThreadPoolExecutor(2) as pool:
        # When one request comes alone: its thread leads, and gathers
        lone = pool.submit(batcher.submit, 4, deadline=LATER)
        deadline = time.monotonic() + 10
        while not batcher._gathering and time.monotonic() < deadline:
            time.sleep(0.001)
        assert batcher._gathering and write.batches[2:] == []
        # and a second one comes
        second = pool.submit(batcher.submit, 5, deadline=LATER)
        answers = [lone.result(30), second.result(30)]
    # Then the two are written together
    assert answers == [40, 50]
    assert [sorted(batch) for batch in write.batches[2:]] == [[4, 5]]


def test_a_leader_gathers_no_longer_than_its_gather_time():
    # Given a batcher whose last batch held two, and a short gathering time
    write = Recorder(hold=True)
    batcher = Batcher(write, gather=0.05)
    _two_batches(batcher, write)
    # When one request comes alone, and no other
    # Then it is written alone once the time is up, and the next lone one too
    assert batcher.submit(4, deadline=LATER) == 40
    assert batcher.submit(5, deadline=LATER) == 50
    assert write.batches[2:] == [[4], [5]]


def test_an_answer_that_is_an_exception_is_raised_in_its_own_thread_only():
    batcher = Batcher(Recorder())

    with pytest.raises(ValueError):
        batcher.submit(-1, deadline=LATER)
    assert batcher.submit(3, deadline=LATER) == 30


def test_an_exception_of_the_write_is_every_request_answer_and_the_next_batch_runs():
    calls = []

    def write(requests: list[int]) -> list[int]:
        calls.append(requests)
        if len(calls) == 1:
            raise RuntimeError("database gone")
        return requests

    batcher = Batcher(write)
    with pytest.raises(RuntimeError, match="database gone"):
        batcher.submit(1, deadline=LATER)
    assert batcher.submit(2, deadline=LATER) == 2


def test_a_request_still_waiting_at_its_deadline_is_withdrawn_and_never_written():
    write = Recorder(hold=True)
    batcher = Batcher(write)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(batcher.submit, 1, deadline=LATER)
        assert write.writing.wait(10)
        # A request due in 50 ms waits behind a batch that outlasts it
        with pytest.raises(Expired):
            batcher.submit(2, deadline=time.monotonic() + 0.05)
        write.release.set()
        assert first.result(10) == 10
    assert batcher.submit(3, deadline=LATER) == 30
    assert write.batches == [[1], [3]]


def test_many_threads_each_get_their_own_answer_once():
    batcher = Batcher(lambda requests: [n * 10 for n in requests])
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda n: batcher.submit(n, deadline=LATER), range(2000)))
    assert answers == [n * 10 for n in range(2000)]
