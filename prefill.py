"""python prefill.py --config configs/prefill.yaml  (see docs/configuration.md)."""

import sys

from prefill.__main__ import main  # the package prefill/, not this file: a folder wins over a module

if __name__ == "__main__":
    sys.exit(main())
