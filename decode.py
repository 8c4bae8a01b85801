"""python decode.py --config configs/decode.yaml  (see README: Configuration)."""

import sys

from pdcluster.protocol import Role
from pdcluster.worker.cli import main

if __name__ == "__main__":
    sys.exit(main(Role.DECODE))
