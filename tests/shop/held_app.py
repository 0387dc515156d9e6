"""A WSGI app that takes as long to import as a test wants: a worker importing it writes its
pid into the directory HELD_APP_LOADING, then waits until the file HELD_APP_RELEASE exists.
It holds a server's worker where the shop's own app spends its first second, loading Django."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

(Path(os.environ["HELD_APP_LOADING"]) / str(os.getpid())).touch()
while not Path(os.environ["HELD_APP_RELEASE"]).exists():
    time.sleep(0.05)


def application(
    environ: dict[str, object], start_response: Callable[..., object]
) -> Iterable[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"released\n"]
