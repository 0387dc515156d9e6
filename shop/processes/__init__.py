"""Process tooling, in one place: what starts, watches and stops the shop's processes.

- `ports`: `free_port`, the one way a free TCP port is picked;
- `redis_server`: `RedisServer`, the one runner of a `redis-server` (the embedded Redis of the
  local `make` targets, and the private servers of the tests that kill, pause or restart one);
- `devservices`: embedded PostgreSQL and Redis for runs whose environment names none
  (`python -m shop.devservices`);
- `serve`: `make serve`, the shop with its Celery worker and beat (`python -m shop.serve`);
- `servers`: `ShopServer` (a real gunicorn) and `CeleryWorker`, for load runs and tests.

Nothing here imports Django at module level: `devservices` runs before any settings exist.
"""
