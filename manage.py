#!/usr/bin/env python
"""Django's command-line utility for flashsale.

A command that cannot reach what it needs (no DATABASE_URL, a database or Redis that does not
answer, a setting that is wrong) says so in one line and exits 1; `--traceback` shows the
traceback instead.
"""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as error:
        _stop(error, f"error: {error}")
    except OperationalError as error:
        _stop(error, f"error: cannot use the database {_database()}: {_first_line(error)}")
    except (RedisConnectionError, RedisTimeoutError) as error:
        _stop(error, f"error: cannot reach Redis (REDIS_URL): {_first_line(error)}")


def _stop(error: Exception, line: str) -> None:
    if "--traceback" in sys.argv:
        raise error
    print(line, file=sys.stderr)
    sys.exit(1)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _database() -> str:
    """Where DATABASE_URL points, without its password."""
    from django.db import connection

    settings = connection.settings_dict
    host = settings.get("HOST") or "the local socket"
    port = f":{settings['PORT']}" if settings.get("PORT") else ""
    return f"{settings.get('NAME')} on {host}{port} (DATABASE_URL)"


if __name__ == "__main__":
    main()
