import sys

from pdcluster.protocol import Role
from pdcluster.worker.cli import main

sys.exit(main(Role.DECODE))
