"""The benchmarks without HTTP, run by `manage.py bench` (`make bench`).

- `strategies`: every strategy, the peer locks and the ceilings, driven by buyer processes
  (`contenders`: what is measured and held to which target; `buyers`: the buyer processes;
  `rounds`: one contender's round; `measure`: CPU and --profile timings; `report`: the
  printed results);
- `loadtest.bench_locks`: our lock and the peers' alone, with no database.
"""
