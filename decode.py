"""python decode.py --config configs/decode.yaml  (see docs/configuration.md)."""

import sys

from decode.__main__ import main  # the package decode/, not this file: a folder wins over a module

if __name__ == "__main__":
    sys.exit(main())
