"""Process tooling, in one place: what starts, watches and stops the shop's processes.

- `ports`: `free_port`, the one way a free TCP port is picked;
- `redis_server`: `RedisServer`, the one runner of a `redis-server` (the embedded Redis of the
  local `make` targets, and the private servers of the tests that kill, pause or restart one);
- `devservices`: runs a command with embedded PostgreSQL and Redis for whichever its
  environment names none (`python -m shop.devservices`): `embedded_postgres` and
  `embedded_redis` are the two services, `embedded` what they share;
- `children`: `die_with_parent` and the other helpers for the children these start;
- `serve`: `make serve`, the shop with its Celery worker and beat (`python -m shop.serve`);
- `servers`: `ShopServer` (a real granian, or gunicorn's sync or gthread workers) and
  `CeleryWorker`, for load runs and tests.

Nothing here imports Django at module level: `devservices` runs before any settings exist.
"""
