"""`python -m shop.devservices [--] CMD [ARGS...]`: see `shop.processes.devservices`."""

import sys

from shop.processes.devservices import main

if __name__ == "__main__":
    sys.exit(main())
