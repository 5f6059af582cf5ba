#!/usr/bin/env python3
"""Where the time of a Python write-latency iteration goes (issue: "what does Python cost me?").

The code is pyrdma.perf.lat_breakdown (so tests and other benches import it); this script runs its main().
pyrdma must be importable: `pip install -e .`, or PYTHONPATH=<the checkout> as scripts/bench.sh sets.
"""
import sys

from pyrdma.perf.lat_breakdown import main

if __name__ == "__main__":
    sys.exit(main())
