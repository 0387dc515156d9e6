"""Reading a number from the environment within its bounds: the one way settings read one.

A value outside its bounds, or not a number, stops the process at start with one line that
says what is allowed, rather than a sale that misbehaves later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypeVar

from django.core.exceptions import ImproperlyConfigured

Number = TypeVar("Number", int, float)

#: FLASHSALE_CHECKOUT_DEADLINE_MS's default and bounds, in milliseconds: read by the settings,
#: and by the servers, which give a worker that stops the time to end its checkouts
#: (`shop.processes.servers.granian_command`).
CHECKOUT_DEADLINE_MS = (3000, 100, 60_000)


def bounded(
    name: str,
    default: Number,
    low: Number,
    high: Number,
    *,
    environ: Mapping[str, str] = os.environ,
) -> Number:
    """The number the environment variable `name` holds, of `default`'s type (int or float),
    or `default` when it is unset. ImproperlyConfigured unless it is from `low` to `high`."""
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = type(default)(raw.strip())
    except ValueError:
        value = None
    if value is None or not low <= value <= high:  # NaN is never within bounds
        raise ImproperlyConfigured(f"{name} must be from {low} to {high}, not {raw}")
    return value
