import sys

from pyrdma.perf.cli import main

sys.exit(main())
