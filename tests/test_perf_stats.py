"""perftest's report arithmetic (pyrdma.perf.stats): known stamps in, known columns out."""
import math

import numpy as np
import pytest

from pyrdma.perf import stats


def _stamps(deltas, start=1_000_000):
    return list(np.cumsum([start] + list(deltas)))


def test_latency_odd_sample():
    # 7 deltas (iters = 8); the two largest (7000, 10000) are dropped from the stats, m = 5
    tp = _stamps([1000, 3000, 2000, 5000, 4000, 10000, 7000])
    r = stats.lat_report(tp, 2, 8, rtt_factor=1)
    assert (r.size, r.iters) == (2, 8)
    assert r.t_min == 1.0
    assert r.t_max == 7.0            # d[m]: the second largest delta
    assert r.t_typical == 3.0        # median of 1..5 usec
    assert r.t_avg == 3.0
    assert r.t_stdev == pytest.approx(math.sqrt(2))   # int diffs 2,1,0,-1,-2
    assert r.p99 == 7.0 and r.p999 == 7.0             # d[ceil(5 * 0.99)] = d[5]


def test_latency_even_sample_and_half_round_trip():
    tp = _stamps([1000, 2000, 3000, 4000, 5000, 6000, 100000, 200000])   # m = 6
    r = stats.lat_report(tp, 64, 9, rtt_factor=2)
    assert r.t_typical == 1.75       # (d[3] + d[2]) // 2 = 3500 ns, halved
    assert r.t_min == 0.5
    assert r.t_max == 50.0           # 100000 ns / 2
    assert r.t_avg == pytest.approx(21000 / 6 / 2000)


def test_latency_median_integer_division():
    # perftest averages the middle pair in integer cycles: (1001 + 1002) // 2 = 1001
    tp = _stamps([1001, 1002, 1000, 1003, 9000, 9000])   # m = 4: 1000 1001 1002 1003
    assert stats.lat_report(tp, 2, 7).t_typical == 1.001


def test_stdev_truncates_like_perftest():
    tp = _stamps([1000, 1500, 2000, 50000, 60000])      # m = 3, avg 1.5 usec
    r = stats.lat_report(tp, 2, 6)
    assert r.t_avg == 1.5
    assert r.t_stdev == 0.0                               # int(0.5), int(0), int(-0.5) are all 0
    assert r.exact_stdev == pytest.approx(math.sqrt(0.5 / 3))


def test_latency_percentiles_on_large_sample():
    rng = np.random.default_rng(1)
    deltas = rng.integers(1000, 2000, size=10001)
    r = stats.lat_report(_stamps(deltas), 2, 10002)
    d = np.sort(deltas)
    m = len(d) - 2
    assert r.p99 == d[math.ceil(m * 0.99)] / 1000
    assert r.p999 == d[math.ceil(m * 0.999)] / 1000
    assert r.t_min == d[0] / 1000 and r.t_max == d[m] / 1000


def test_latency_needs_enough_iterations():
    with pytest.raises(ValueError):
        stats.lat_report([0, 1, 2, 3], 2, 4)


def test_bw_with_cq_moderation_peak_window():
    # 10 WRs, cq_mod 4: completions exist for WRs 3, 7 and the last (9)
    tposted = [i * 100 for i in range(10)]
    tcompleted = [0] * 10
    tcompleted[3], tcompleted[7], tcompleted[9] = 450, 800, 950
    assert stats.peak_delta(tposted, tcompleted, 10, cq_mod=4) == 50     # i = 9, j = 9
    r = stats.bw_report(tposted, tcompleted, 1 << 20, 10, cq_mod=4)
    assert r.bw_peak == pytest.approx(1e9 / 50)         # 1 MiB per 50 ns, in MiB/s
    assert r.bw_avg == pytest.approx(10 * 1e9 / 950)
    assert r.msg_rate == pytest.approx(10 * 1e9 / 950 / 1e6)
    assert r.iters == 10


def test_peak_window_skips_completions_before_the_post():
    # i = 4 may only pair with j >= 7 (ROUND_UP(5, 4) - 1); pairing with j = 3 would be negative
    tposted = [0, 10, 20, 30, 1000, 1010, 1020, 1030]
    tcompleted = [0, 0, 0, 40, 0, 0, 0, 1040]
    assert stats.peak_delta(tposted, tcompleted, 8, cq_mod=4) == 10


def test_bw_post_list_stamps():
    # post lists of 4: only tposted[0] and tposted[4] are stamped; cq_mod = 4
    tposted = [0, -1, -1, -1, 400, -1, -1, -1]
    tcompleted = [-1, -1, -1, 800, -1, -1, -1, 1000]
    assert stats.peak_delta(tposted, tcompleted, 8, cq_mod=4, post_list=4) == 125   # (1000 - 0) // 8
    r = stats.bw_report(tposted, tcompleted, 4096, 8, cq_mod=4, post_list=4)
    assert r.bw_peak == pytest.approx(4096 * 1e9 / (125 * 2 ** 20))


def test_bw_units_mib_and_gbits():
    tposted = list(range(0, 1000, 10))
    tcompleted = [t + 50 for t in tposted]
    mb = stats.bw_report(tposted, tcompleted, 65536, 100)
    gb = stats.bw_report(tposted, tcompleted, 65536, 100, gbits=True)
    assert mb.bw_avg == pytest.approx(65536 * 100 * 1e9 / (1040 * 2 ** 20))   # MB = 2^20 (perftest)
    assert gb.bw_avg == pytest.approx(65536 * 100 * 1e9 / (1040 * 125e6))      # Gb = 10^9 bits
    assert mb.bw_peak == pytest.approx(65536 * 1e9 / (10 * 2 ** 20))           # 10 ns per message at best


def test_no_peak_uses_single_stamps():
    r = stats.bw_report([1000], [1000 + 10 ** 9], 8, 2000, no_peak=True)
    assert r.bw_peak == 0.0
    assert r.msg_rate == pytest.approx(0.002)
    assert r.bw_avg == pytest.approx(16000 / 2 ** 20)


def test_multi_qp_counts_all_messages():
    r = stats.bw_report([0], [10 ** 9], 1024, 100, num_qps=4, no_peak=True)
    assert r.iters == 400 and r.msg_rate == pytest.approx(400e-6)


def test_bidirectional_sum():
    a = stats.BWReport(65536, 1000, 10.0, 8.0, 0.1)
    b = stats.BWReport(65536, 1000, 11.0, 9.0, 0.2)
    s = a + b
    assert (s.bw_peak, s.bw_avg, s.msg_rate) == (21.0, 17.0, pytest.approx(0.3))


def test_lat_duration():
    r = stats.lat_duration_report(2 * 10 ** 9, 2, 100000, rtt_factor=2)
    assert r.t_avg == pytest.approx(10.0)      # 2 s / 100000 / 2 in usec
    assert r.tps == pytest.approx(50000.0)


def test_row_formats_match_printf():
    # oracle: the C printf layouts, evaluated by Python's %-formatting (which ignores 'l')
    r = stats.BWReport(65536, 5000, 1234.5678, 1200.004, 0.0192)
    assert r.row() == " %-7lu    %-10lu       %-7.2lf            %-7.2lf\t\t   %-7.6lf" % (
        65536, 5000, 1234.5678, 1200.004, 0.0192)
    g = stats.BWReport(8, 1000, 0.05, 0.04, 0.6, gbits=True)
    assert g.row() == " %-7lu    %lu           %-7.6lf            %-7.6lf            %-7.6lf" % (
        8, 1000, 0.05, 0.04, 0.6)
    lat = stats.LatReport(2, 1000, 1.0, 20.5, 1.5, 1.75, 0.5, 3.0, 20.5)
    assert lat.row() == (" %-7lu %lu          %-7.2f        %-7.2f      %-7.2f  \t       %-7.2f     \t%-7.2f"
                         "\t\t%-7.2f \t\t%-7.2f") % (2, 1000, 1.0, 20.5, 1.5, 1.75, 0.5, 3.0, 20.5)


def test_all_sizes():
    sizes = stats.all_sizes()
    assert sizes[0] == 2 and sizes[-1] == 1 << 23 and len(sizes) == 23
