#!/usr/bin/env python3
"""perftest vs pyrdma-perf, side by side, on one RDMA device (Soft-RoCE rxe0 in the test VM).

The code is pyrdma.perf.side_by_side (so tests and other benches import it); this script runs its main().
pyrdma must be importable: `pip install -e .`, or PYTHONPATH=<the checkout> as scripts/bench.sh sets.
"""
import sys

from pyrdma.perf.side_by_side import main

if __name__ == "__main__":
    sys.exit(main())
