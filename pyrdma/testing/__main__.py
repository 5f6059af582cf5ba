import sys

from pyrdma.testing.vm import main

sys.exit(main())
