"""gunicorn's logger (`logger_class` in shop.gunicorn_conf), with the health checks' requests
in the access log at debug level only.

A storefront page polls /healthz every 2 seconds for its banner, and Docker and load balancers
poll it too: at info level their lines bury the requests a reader looks for. `--log-level debug`
shows them again.
"""

from __future__ import annotations

import logging
from typing import Any

from gunicorn.glogging import Logger

#: Paths polled for health rather than asked by a buyer.
HEALTH_POLLS = frozenset({"/healthz"})


class AccessLog(Logger):
    def access(self, resp: Any, req: Any, environ: dict[str, Any], request_time: Any) -> None:
        if req.path in HEALTH_POLLS and not self.error_log.isEnabledFor(logging.DEBUG):
            return
        super().access(resp, req, environ, request_time)
