"""`python -m pdcluster.kvstore` (list, clear, launch): cli.py's commands."""

import sys

from pdcluster.kvstore.cli import main

sys.exit(main())
