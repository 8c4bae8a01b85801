import sys

from pdcluster.kvstore.cli import main

sys.exit(main())
