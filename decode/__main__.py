"""`python -m decode` and the `pdcluster-decode` script: the shared worker launcher with the decode's rules."""

import sys

from decode import plan
from pdcluster.worker import cli


def main(argv: list[str] | None = None) -> int:
    return cli.main(plan, argv)


if __name__ == "__main__":
    sys.exit(main())
