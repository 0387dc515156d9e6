"""`python -m loadtest.bench_strategies`: the strategy benchmark (`loadtest.bench.strategies`,
also `manage.py bench strategies` and `make bench`)."""

import sys

from loadtest.bench.strategies import main

if __name__ == "__main__":
    sys.exit(main())
