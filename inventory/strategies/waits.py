"""The waits a strategy makes on purpose: a jittered back-off after a write that lost a race,
and the work a critical section is made to take in the lab (FLASHSALE_HOLD_DELAY_MS, a seam of
shop.lab_settings; none in the shop), which makes races and lock expiry visible to the pitfall
lab and the benchmarks."""

from __future__ import annotations

import random
import time

from django.conf import settings

_BACKOFF_BASE_SECONDS = 0.001
_BACKOFF_CAP_SECONDS = 0.025


def back_off(attempt: int) -> None:
    """Sleep a random, growing while (full jitter) before retrying a write that lost a race."""
    time.sleep(random.uniform(0, min(_BACKOFF_CAP_SECONDS, _BACKOFF_BASE_SECONDS * 2**attempt)))


def simulate_work() -> None:
    """Sleep FLASHSALE_HOLD_DELAY_MS inside a critical section, to make races and expiry visible."""
    hold_ms = getattr(settings, "FLASHSALE_HOLD_DELAY_MS", 0)
    if hold_ms > 0:
        time.sleep(hold_ms / 1000)
