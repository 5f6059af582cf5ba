"""perftest-compatible microbenchmarks written with pyrdma (the ``pyrdma-perf`` command).

``stats``  perftest's report arithmetic and row format (pure Python/numpy);
``parse``  reads perftest's (and our) stdout back into reports;
``oob``    the versioned TCP exchange between server and client;
``loops``  the measurement loops, in ``loop`` (one API call per op) and ``batched`` mode;
``cli``    argument parsing and the server/client orchestration (``main``).
"""
from pyrdma.perf.stats import BWReport, LatDurationReport, LatReport, bw_report, lat_report
from pyrdma.perf.parse import parse_output

__all__ = ["BWReport", "LatReport", "LatDurationReport", "bw_report", "lat_report", "parse_output"]
