"""What `devservices` and its embedded services share: the checkout's data folder, the error
a service that cannot start raises, and how they speak to the user.

Nothing here imports Django: it runs before any settings exist.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class DevServicesError(Exception):
    """A service could not be started; the message is meant for the user."""


def say(message: str) -> None:
    print(f"devservices: {message}", file=sys.stderr, flush=True)


def data_dir() -> Path:
    return Path(os.environ.get("DEVSERVICES_DATA_DIR") or ROOT / ".data").resolve()
