"""`python -m shop.serve`, what `make serve` runs: see `shop.processes.serve`."""

import sys

from shop.processes.serve import main

if __name__ == "__main__":
    sys.exit(main())
