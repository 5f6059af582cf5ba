"""perftest-compatible microbenchmarks written with pyrdma (the ``pyrdma-perf`` command).

``stats``  perftest's report arithmetic and row format (pure Python/numpy);
``parse``  reads perftest's (and our) stdout back into reports;
``oob``    the versioned TCP exchange between server and client;
``loops``  the measurement loops, in ``loop`` (one API call per op) and ``batched`` mode
           (``loops.bw``, ``loops.lat``, and what they share in ``loops.common``);
``side``   one side of a run (``Side``): resources, exchange, measurement, printing, JSON;
           ``compat`` (perftest's exchange) and ``rdmacm`` (rdma_cm) derive from it;
``cli``    argument parsing (``Config``) and ``main``, which picks the side;
``collectives``  nccl-tests' collective benchmarks (all_reduce_perf ... sendrecv_perf) on the Communicator.

The benches' code (bench/ runs it): ``side_by_side`` (perftest and pyrdma-perf in rounds),
``lat_breakdown`` (where a latency iteration's time goes), ``allreduce_bench`` (collective sweeps
against ib_write_bw and MPI; ``mpi_allreduce.py`` is its MPI side, run by mpirun).
"""
from pyrdma.perf.stats import BWReport, LatDurationReport, LatReport, bw_report, lat_report
from pyrdma.perf.parse import parse_output

__all__ = ["BWReport", "LatReport", "LatDurationReport", "bw_report", "lat_report", "parse_output"]
