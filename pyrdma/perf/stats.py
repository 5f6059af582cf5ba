"""perftest's report arithmetic and output format, in pure Python/numpy.

Everything here was worked out from perftest 4.5-0.17 (the version Debian ships, which reports
itself as "6.06"): ``print_report_bw``, ``print_report_lat`` and ``print_report_lat_duration`` in
src/perftest_parameters.c and the loops in src/perftest_resources.c. What this module reproduces:

Time base
    perftest takes ``get_cycles()`` (the TSC) stamps and divides by the CPU MHz. We take
    ``time.perf_counter_ns()`` stamps, so one "cycle" is a nanosecond: ``TICKS_PER_SEC = 1e9``,
    ``TICKS_PER_USEC = 1000``. Cycle arithmetic stays integer wherever perftest's does.

Bandwidth (``bw_report``)
    The sender stamps ``tposted[k]`` just before posting WR ``k`` (with a post list of L WRs only
    every L-th index is stamped, at the first WR of each list) and ``tcompleted[k]`` when the
    completion that covers WR ``k`` is polled. With CQ moderation ``cq_mod`` only WRs
    ``cq_mod-1, 2*cq_mod-1, ...`` and the very last one are signaled, so only those completion
    indices exist. For N = iters * qps:

    * BW average = size * N * ticks_per_sec / ((tcompleted[N-1] - tposted[0]) * F)
    * MsgRate    = N * ticks_per_sec / ((tcompleted[N-1] - tposted[0]) * 1e6)       [Mpps]
    * BW peak    = size * ticks_per_sec / (opt_delta * F), where opt_delta is the smallest
      per-message time over every window from a stamped post i (i = 0, L, 2L, ...) to a stamped
      completion j >= i: ``(tcompleted[j] - tposted[i]) // (j - i + 1)`` (integer division), the
      j running over ROUND_UP(i+1, cq_mod)-1, +cq_mod, ... plus N-1 when cq_mod does not divide N.
      The search starts from tcompleted[0] - tposted[0], which only exists when WR 0 was signaled.
    * F (``format_factor``) is 0x100000 = 2^20 for MB/sec, so perftest's "MB" is a MiB; with
      --report_gbits F = 125000000 (bytes/s per Gb/s, 10^9 bits).
    * "noPeak" (set by perftest for --duration, for the send_bw server, and when a BW test runs
      more than 20000 iterations) prints a peak of 0 and times the average from the single stamps
      tposted[0] .. tcompleted[0].

Latency (``lat_report``)
    perftest stamps ``tposted[k]`` before each post; the sample is the ``iters - 1`` deltas between
    consecutive posts, so for a ping-pong (write_lat, send_lat) each delta is one full round trip
    and is divided by 2 (``rtt_factor``); for read_lat and atomic_lat (post, then spin on the
    completion) the delta is the whole operation and the factor is 1. Then, on the deltas sorted:

    * the two largest are dropped (LAT_MEASURE_TAIL = 2): m = iters - 1 - 2 values remain;
    * t_min = d[0]; t_max = d[m] (the array still holds the two dropped values, so this is the
      second largest delta overall); t_typical = median of d[0:m] (odd m: d[m//2]; even m: the
      integer mean of the two middle values); 99% = d[ceil(m*0.99)], 99.9% = d[ceil(m*0.999)];
    * t_avg = mean of d[0:m] (in usec, floating point);
    * t_stdev = sqrt(sum(int(t_avg - d_i)^2) / m) where the difference is truncated to an integer
      number of usec before squaring (perftest stores it in an ``int``). This quirk is reproduced so
      the columns compare line by line; ``exact_stdev`` gives the true value too.

Duration latency (``lat_duration_report``): t_avg = sample_time / rtt_factor / iters (usec),
    tps = iters / sample_time (per second); perftest counts iterations only inside the sampling
    window [margin, duration - margin], margin = duration // 4 by default.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

TICKS_PER_SEC = 1_000_000_000     # perf_counter_ns ticks per second ("cycles_to_units" for BW)
TICKS_PER_USEC = 1000.0           # ticks per microsecond ("cpu MHz" for latency)
MB = 0x100000                     # perftest's MB/sec divisor: 2^20 bytes
GBIT = 125_000_000                # perftest's Gb/sec divisor: bytes per second in one Gb/s
LAT_MEASURE_TAIL = 2              # largest deltas dropped from a latency sample
RESULT_LINE = "-" * 87

BW_HEADER_MB = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]"
BW_HEADER_GBIT = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
LAT_HEADER = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    "
              "t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ")
LAT_DUR_HEADER = " #bytes        #iterations       t_avg[usec]    tps average"

# The row layouts (perftest's REPORT_FMT / REPORT_FMT_EXT / REPORT_FMT_LAT / REPORT_FMT_LAT_DUR);
# tabs included, so a row from us and a row from perftest line up in the same terminal.
_BW_ROW = " {size:<7d}    {iters:<10d}       {peak:<7.2f}            {avg:<7.2f}\t\t   {rate:<7.6f}"
_BW_ROW_EXT = " {size:<7d}    {iters:d}           {peak:<7.6f}            {avg:<7.6f}            {rate:<7.6f}"
_LAT_ROW = (" {size:<7d} {iters:d}          {t_min:<7.2f}        {t_max:<7.2f}      {t_typical:<7.2f}  \t"
            "       {t_avg:<7.2f}     \t{t_stdev:<7.2f}\t\t{p99:<7.2f} \t\t{p999:<7.2f}")
_LAT_DUR_ROW = " {size:<7d}       {iters:d}            {t_avg:<7.2f}        {tps:<7.2f}"


@dataclass
class BWReport:
    """One bandwidth row. bw_* are in MB/sec (2^20) or Gb/sec (``gbits``); msg_rate in Mpps."""
    size: int
    iters: int
    bw_peak: float
    bw_avg: float
    msg_rate: float
    gbits: bool = False

    def row(self):
        return format_bw_row(self)

    def __add__(self, other):
        # perftest's bidirectional total: peak, average and rate add up.
        return BWReport(self.size, self.iters, self.bw_peak + other.bw_peak, self.bw_avg + other.bw_avg,
                        self.msg_rate + other.msg_rate, self.gbits)

    def to_dict(self):
        return asdict(self)


@dataclass
class LatReport:
    """One latency row, all times in usec."""
    size: int
    iters: int
    t_min: float
    t_max: float
    t_typical: float
    t_avg: float
    t_stdev: float
    p99: float
    p999: float
    exact_stdev: float = field(default=float("nan"), compare=False)

    def row(self):
        return format_lat_row(self)

    def to_dict(self):
        return asdict(self)


@dataclass
class LatDurationReport:
    size: int
    iters: int
    t_avg: float
    tps: float

    def row(self):
        return format_lat_duration_row(self)

    def to_dict(self):
        return asdict(self)


def _round_up(value, alignment):
    return value if value % alignment == 0 else (value // alignment + 1) * alignment


def peak_delta(tposted, tcompleted, n, cq_mod=1, post_list=1, chunk_cells=1 << 22):
    """perftest's opt_delta: the smallest (tcompleted[j] - tposted[i]) // (j - i + 1) over stamped
    posts i (every ``post_list``-th) and signaled completions j >= i. Returns an int (ticks) or
    None when there is no window (n == 0)."""
    if n <= 0:
        return None
    tp = np.asarray(tposted, dtype=np.int64)[:n]
    tc = np.asarray(tcompleted, dtype=np.int64)[:n]
    # completion indices that exist: cq_mod-1, 2cq_mod-1, ... and the last one
    js = np.arange(cq_mod - 1, n, cq_mod, dtype=np.int64)
    if n % cq_mod:
        js = np.append(js, n - 1)
    best = None
    if cq_mod == 1 or n == 1:
        best = int(tc[0] - tp[0])   # perftest's starting value (tcompleted[0] exists only then)
    is_ = np.arange(0, n, post_list, dtype=np.int64)
    tcj = tc[js]
    rows = max(1, chunk_cells // max(1, len(js)))
    for start in range(0, len(is_), rows):
        ii = is_[start:start + rows]
        # mask j < ROUND_UP(i+1, cq_mod) - 1, i.e. windows that end before they start
        first_j = (ii + 1 + cq_mod - 1) // cq_mod * cq_mod - 1
        valid = js[None, :] >= np.minimum(first_j, n - 1)[:, None]
        span = js[None, :] - ii[:, None] + 1
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (tcj[None, :] - tp[ii][:, None]) // np.where(span > 0, span, 1)
        t = np.where(valid & (span > 0), t, np.iinfo(np.int64).max)
        m = int(t.min())
        if m != np.iinfo(np.int64).max and (best is None or m < best):
            best = m
    return best


def bw_report(tposted, tcompleted, size, iters, *, num_qps=1, cq_mod=1, post_list=1, no_peak=False,
              gbits=False, ticks_per_sec=TICKS_PER_SEC, size_factor=1):
    """A bandwidth row from post/completion stamps, computed as perftest's print_report_bw.

    ``tposted``/``tcompleted`` hold iters*num_qps stamps (ticks); with ``no_peak`` only index 0 of
    each is used (start and end of the run). ``size_factor`` is perftest's run_inf_bi_factor."""
    n = int(iters) * int(num_qps)
    fmt = GBIT if gbits else MB
    tsize = size_factor * int(size)
    if n <= 0:
        return BWReport(int(size), 0, 0.0, 0.0, 0.0, gbits)
    last = 0 if no_peak else n - 1
    total = int(tcompleted[last]) - int(tposted[0])
    if total <= 0:
        total = 1
    bw_avg = (tsize * n * float(ticks_per_sec)) / (total * fmt)
    rate = (n * float(ticks_per_sec)) / (total * 1e6)
    if no_peak:
        bw_peak = 0.0
    else:
        delta = peak_delta(tposted, tcompleted, n, cq_mod=cq_mod, post_list=post_list)
        if not delta or delta <= 0:
            delta = 1
        bw_peak = float(tsize * int(ticks_per_sec)) / float(delta * fmt)
    return BWReport(int(size), n, bw_peak, bw_avg, rate, gbits)


def bw_duration_report(t_start, t_end, size, iters, *, gbits=False, ticks_per_sec=TICKS_PER_SEC):
    """Duration mode (always noPeak): ``iters`` messages completed inside [t_start, t_end]."""
    return bw_report([t_start], [t_end], size, iters, no_peak=True, gbits=gbits,
                     ticks_per_sec=ticks_per_sec)


def _median_ticks(d, m):
    # perftest's get_median on the first m sorted deltas (integer mean for an even count)
    if (m - 1) % 2:
        return (int(d[m // 2]) + int(d[m // 2 - 1])) // 2
    return int(d[m // 2])


def lat_report(tposted, size, iters, *, rtt_factor=1, ticks_per_usec=TICKS_PER_USEC):
    """A latency row from per-iteration post stamps, computed as perftest's print_report_lat."""
    iters = int(iters)
    if iters < 2 + LAT_MEASURE_TAIL + 1:
        raise ValueError(f"a latency report needs at least {LAT_MEASURE_TAIL + 3} iterations, got {iters}")
    tp = np.asarray(tposted, dtype=np.int64)[:iters]
    d = np.sort(np.diff(tp))                      # iters - 1 deltas
    m = len(d) - LAT_MEASURE_TAIL
    q = float(ticks_per_usec) * rtt_factor
    us = d / q
    avg = float(np.sum(us[:m])) / m
    trunc = np.trunc(avg - us[:m]).astype(np.int64)   # perftest's `int temp_var`
    stdev = math.sqrt(float(np.sum(trunc * trunc)) / m)
    exact = float(np.sqrt(np.mean((us[:m] - avg) ** 2)))
    return LatReport(size=int(size), iters=iters, t_min=float(us[0]), t_max=float(us[m]),
                     t_typical=_median_ticks(d, m) / q, t_avg=avg, t_stdev=stdev,
                     p99=float(us[math.ceil(m * 0.99)]), p999=float(us[math.ceil(m * 0.999)]),
                     exact_stdev=exact)


def lat_duration_report(sample_ticks, size, iters, *, rtt_factor=1, ticks_per_usec=TICKS_PER_USEC):
    """Duration-mode latency row (print_report_lat_duration)."""
    iters = int(iters)
    sample_ticks = max(1, int(sample_ticks))
    usec = sample_ticks / float(ticks_per_usec)
    t_avg = usec / rtt_factor / iters if iters else 0.0
    tps = iters / (usec / 1e6)
    return LatDurationReport(int(size), iters, t_avg, tps)


def format_bw_row(r: BWReport):
    # perftest switches to 6 decimals for Gb/sec below 0.1 (REPORT_FMT_EXT)
    fmt = _BW_ROW_EXT if (r.gbits and r.bw_avg < 0.1) else _BW_ROW
    return fmt.format(size=r.size, iters=r.iters, peak=r.bw_peak, avg=r.bw_avg, rate=r.msg_rate)


def format_lat_row(r: LatReport):
    return _LAT_ROW.format(size=r.size, iters=r.iters, t_min=r.t_min, t_max=r.t_max, t_typical=r.t_typical,
                           t_avg=r.t_avg, t_stdev=r.t_stdev, p99=r.p99, p999=r.p999)


def format_lat_duration_row(r: LatDurationReport):
    return _LAT_DUR_ROW.format(size=r.size, iters=r.iters, t_avg=r.t_avg, tps=r.tps)


def bw_header(gbits=False):
    return BW_HEADER_GBIT if gbits else BW_HEADER_MB


def all_sizes(max_size=1 << 23, min_size=2):
    """perftest -a: 2, 4, ..., 2^23 bytes."""
    sizes = []
    s = min_size
    while s <= max_size:
        sizes.append(s)
        s <<= 1
    return sizes
