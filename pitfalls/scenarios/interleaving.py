"""What the lock scenarios share: the lock they fight over, its short TTL, and the two tools
of a forced interleaving (a thread of its own, a sleep until a set moment).

Every timing in the lock scenarios is a forced interleaving, with margins of hundreds of
milliseconds: a holder works past its lock's TTL on purpose, a waiter arrives while the lock
is held, a pause sits between two commands that should have been one. The damage therefore
happens (or is prevented) the same way on every run, on a busy machine too.
See docs/lab.md#the-scenarios.
"""

from __future__ import annotations

import threading
import time

NAME = "pitfall:item:42:lock"
#: The lock's TTL in the scenarios where it expires: short, so that a run takes a second or
#: two, long enough that a busy machine's scheduling delays (tens of ms) change nothing.
TTL = 0.5


def in_thread(target, *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def sleep_until(start: float, seconds: float) -> None:
    """Sleep until `seconds` after `start` (monotonic)."""
    time.sleep(max(0.0, start + seconds - time.monotonic()))
