"""The benchmarks run by `manage.py bench` (`make bench`).

- `strategies`: every strategy, the peer locks and the ceilings, driven by buyer processes
  without HTTP (`contenders`: what is measured and held to which target; `buyers`: the buyer
  processes; `rounds`: one contender's round; `measure`: CPU and --profile timings; `report`:
  the printed results);
- `servers`: the server designs over HTTP, the same crowd for each;
- `settle`: whether the order workers keep pace with checkout;
- `calls`: what redis-py's command layers cost a sale;
- `loadtest.bench_locks`: our lock and the peers' alone, with no database;
  `loadtest.bench_waiters`: a crowd of lock waiters, with and without the wake hub.
"""
