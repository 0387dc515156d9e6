"""An app module whose import never returns: a worker importing it writes its pid into the
directory HELD_APP_LOADING, then waits there until it is killed. It holds a server's worker
where the shop's own app spends its first second, loading Django."""

from __future__ import annotations

import os
import threading
from pathlib import Path

(Path(os.environ["HELD_APP_LOADING"]) / str(os.getpid())).touch()
threading.Event().wait()
