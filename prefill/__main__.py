"""`python -m prefill` and the `pdcluster-prefill` script: the shared worker launcher with the prefill's rules."""

import sys

from pdcluster.worker import cli
from prefill import plan


def main(argv: list[str] | None = None) -> int:
    return cli.main(plan, argv)


if __name__ == "__main__":
    sys.exit(main())
