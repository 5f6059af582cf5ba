#!/usr/bin/env python3
"""Allreduce sweep in the style of nccl-tests, with ib_write_bw and OpenMPI+UCX on the same device

The code is pyrdma.perf.allreduce_bench (so tests and other benches import it); this script runs its main().
pyrdma must be importable: `pip install -e .`, or PYTHONPATH=<the checkout> as scripts/bench.sh sets.
"""
import sys

from pyrdma.perf.allreduce_bench import main

if __name__ == "__main__":
    sys.exit(main())
