"""The web server's access log, with the health checks' requests at debug level only.

A storefront page polls /healthz every 2 seconds for its banner, and Docker and load balancers
poll it too: at info level their lines bury the requests a reader looks for. `--log-level debug`
shows them again. For granian (the shop's server) a logging filter of its access logger
(`shop/granian_logging.json`); for gunicorn a logger class (`logger_class` in
shop.gunicorn_conf).
"""

from __future__ import annotations

import logging
from typing import Any

from gunicorn.glogging import Logger

#: Paths polled for health rather than asked by a buyer.
HEALTH_POLLS = frozenset({"/healthz"})


class HealthPollsAtDebug(logging.Filter):
    """Keeps granian's access lines of the health polls out unless its own log is at debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args.get("path") if isinstance(args, dict) else None
        return path not in HEALTH_POLLS or logging.getLogger("_granian").isEnabledFor(logging.DEBUG)


class AccessLog(Logger):
    def access(self, resp: Any, req: Any, environ: dict[str, Any], request_time: Any) -> None:
        if req.path in HEALTH_POLLS and not self.error_log.isEnabledFor(logging.DEBUG):
            return
        super().access(resp, req, environ, request_time)
