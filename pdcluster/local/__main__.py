"""`python -m pdcluster.local` (`make up`): the whole cluster on this machine, as cluster.py's main runs it."""

import sys

from pdcluster.local.cluster import main

sys.exit(main())
