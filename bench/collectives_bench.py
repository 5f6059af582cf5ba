#!/usr/bin/env python3
"""All-to-all, gather, scatter and send/recv: pyrdma against OpenMPI+UCX and perftest, in one boot.

The code is pyrdma.perf.collectives_bench (its docstring says what is measured and how); this script
runs its main(). pyrdma must be importable: `pip install -e .`, or PYTHONPATH=<the checkout>.
"""
import sys

from pyrdma.perf.collectives_bench import main

if __name__ == "__main__":
    sys.exit(main())
