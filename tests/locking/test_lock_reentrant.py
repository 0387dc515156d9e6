"""`ReentrantLock`: the thread that holds a lock takes it again instead of waiting for
itself (the articles' methodA -> methodB), counted, released when the count is back at 0."""

from __future__ import annotations

import threading
import time

from locking import Lock, ReentrantLock


def test_a_holder_takes_its_lock_again_and_keeps_it_until_the_last_release(r, prefix):
    name = prefix + "item:lock"
    outer = ReentrantLock(r, name, timeout=5)
    assert outer.acquire(blocking=False)
    token = r.get(name)

    # methodB, with a ReentrantLock of its own for the same name: taken again, same owner (waiting
    # could not have got it: the outer holds it for 5 s, past the 2 s blocking timeout)
    inner = ReentrantLock(r, name, timeout=5)
    assert inner.acquire(blocking_timeout=2)
    assert r.get(name) == token and inner.owned()

    # nobody else gets it while either holds it
    other = threading.Thread(target=lambda: seen.append(Lock(r, name).acquire(blocking=False)))
    seen: list[bool] = []
    other.start()
    other.join()
    assert seen == [False]

    inner.release()
    assert r.get(name) == token  # still held: the outer holds it
    outer.release()
    assert r.get(name) is None


def test_taking_it_again_resets_its_time_to_live(r, prefix):
    name = prefix + "item:lock"
    outer = ReentrantLock(r, name, timeout=1)
    outer.acquire()
    r.pexpire(name, 100)
    ReentrantLock(r, name, timeout=1).acquire()
    assert 900 < r.pttl(name) <= 1000


def test_another_thread_is_not_the_owner(r, prefix):
    name = prefix + "item:lock"
    outer = ReentrantLock(r, name, timeout=5)
    outer.acquire()
    answers: list[bool] = []
    thread = threading.Thread(
        target=lambda: answers.append(
            ReentrantLock(r, name, timeout=5).acquire(blocking_timeout=0.3)
        )
    )
    thread.start()
    thread.join()
    assert answers == [False]
    outer.release()


def test_a_lock_that_expired_is_taken_afresh_not_again(r, prefix):
    name = prefix + "item:lock"
    outer = ReentrantLock(r, name, timeout=5)
    outer.acquire()
    r.delete(name)  # it expired, say
    Lock(r, name, timeout=5).acquire()  # and someone else took it
    inner = ReentrantLock(r, name, timeout=5)
    assert not inner.acquire(blocking_timeout=0.3)  # not this thread's any more: it waits


def test_without_reentrant_a_holder_waits_for_itself(r, prefix):
    name = prefix + "item:lock"
    Lock(r, name, timeout=5).acquire()
    asked = time.monotonic()
    assert not Lock(r, name, timeout=5).acquire(blocking_timeout=0.3)
    assert time.monotonic() - asked >= 0.3
