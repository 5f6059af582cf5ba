"""The benches' analysis on the host (pyrdma.perf.side_by_side, pyrdma.perf.allreduce_bench, which
bench/side_by_side.py and bench/allreduce_bench.py run): ratios, targets, table and plots from known rows."""
import multiprocessing
import os
import socket
import subprocess

import pytest

import pyrdma.testing
from pyrdma.perf import allreduce_bench, side_by_side


@pytest.fixture(scope="module")
def sbs():
    return side_by_side


def _bench(sbs, tmp_path):
    args = sbs.main.__globals__["argparse"].Namespace(
        out=str(tmp_path), tests=["write_bw", "write_lat"], bw_sizes=[64, 65536], lat_sizes=[2], port_base=1,
        iters_bw=10, iters_lat=10, timeout=1, dev="rxe0", gid=1, host="127.0.0.1", post_list=32)
    b = sbs.Bench(args)
    bw = lambda size, avg, rate: dict(size=size, iters=10, bw_peak=avg, bw_avg=avg, msg_rate=rate, gbits=False)
    lat = lambda typ, p99: dict(size=2, iters=10, t_min=1, t_max=9, t_typical=typ, t_avg=typ, t_stdev=0,
                                p99=p99, p999=p99)
    rows = [("write_bw", 64, "perftest", "-", bw(64, 10.0, 0.16)), ("write_bw", 64, "pyrdma", "loop", bw(64, 5.0, 0.08)),
            ("write_bw", 64, "pyrdma", "batched", bw(64, 8.0, 0.128)),
            ("write_bw", 65536, "perftest", "-", bw(65536, 100.0, 0.0016)),
            ("write_bw", 65536, "pyrdma", "loop", bw(65536, 90.0, 0.00144)),
            ("write_bw", 65536, "pyrdma", "batched", bw(65536, 98.0, 0.001568)),
            ("write_bw", 65536, "pyrdma", "interop", bw(65536, 97.0, 0.001552)),
            ("write_lat", 2, "perftest", "-", lat(10.0, 20.0)), ("write_lat", 2, "pyrdma", "loop", lat(12.0, 30.0)),
            ("write_lat", 2, "pyrdma", "batched", lat(11.0, 25.0))]
    for test, size, tool, mode, rep in rows:
        b.rows.append(dict(test=test, size=size, tool=tool, mode=mode, report=rep))
    return b


def test_ratios_and_targets(sbs, tmp_path):
    b = _bench(sbs, tmp_path)
    comps = b.comparisons()
    get = {(c["test"], c["size"], c["mode"], c["metric"]): c["ratio"] for c in comps}
    assert get[("write_bw", 65536, "batched", "bw_avg")] == pytest.approx(0.98)
    assert get[("write_bw", 64, "loop", "msg_rate")] == pytest.approx(0.5)
    assert get[("write_lat", 2, "loop", "t_typical")] == pytest.approx(1.2)
    # our client against perftest's server: compared where it ran, absent where it did not
    assert get[("write_bw", 65536, "interop", "bw_avg")] == pytest.approx(0.97)
    assert ("write_bw", 64, "interop", "bw_avg") not in get
    targets = {t["name"]: t for t in b.targets(comps)}
    assert [t["status"] for t in targets.values()] == ["MET"] * len(sbs.TARGETS)
    latency = next(t for name, t in targets.items() if "send_lat" in name)
    assert latency["cases"] == [("write_lat", 2, 1.2)]          # send_lat did not run: only write_lat counts
    b.rows[8]["report"]["t_typical"] = 21.0      # the loop write_lat row: 2.1x perftest
    assert [t["status"] for t in b.targets(b.comparisons()) if "send_lat" in t["name"]] == ["MISSED"]
    b.rows[8]["report"]["t_typical"] = 12.0
    b.rows[5]["report"]["bw_avg"] = 90.0       # the batched 64 KiB row
    assert b.targets(b.comparisons())[0]["status"] == "MISSED"


def test_rounds_give_the_median_of_their_ratios_and_its_range(sbs, tmp_path, capsys):
    b = _bench(sbs, tmp_path)
    lat = lambda typ: dict(size=2, iters=10, t_min=1, t_max=9, t_typical=typ, t_avg=typ, t_stdev=0, p99=typ,
                           p999=typ)
    b.rows = [r for r in b.rows if r["test"] != "write_lat"]
    for rnd, (pt, ours) in enumerate([(10.0, 12.0), (10.0, 15.0), (20.0, 20.0)], 1):
        b.rows.append(dict(test="write_lat", size=2, tool="perftest", mode="-", report=lat(pt), round=rnd))
        b.rows.append(dict(test="write_lat", size=2, tool="pyrdma", mode="loop", report=lat(ours), round=rnd))
    c = next(c for c in b.comparisons() if (c["test"], c["mode"], c["metric"]) == ("write_lat", "loop", "t_typical"))
    # per round 1.2, 1.5, 1.0: the median ratio is 1.2, not the ratio of the medians (15 / 10)
    assert c["ratio"] == pytest.approx(1.2) and c["rounds"] == 3
    assert (c["ratio_min"], c["ratio_max"]) == (pytest.approx(1.0), pytest.approx(1.5))
    assert (c["perftest"], c["ours"]) == (10.0, 15.0)
    assert b.find("write_lat", 2, "pyrdma", "loop")["t_typical"] == 15.0
    comps = b.comparisons()
    sbs.print_table(comps, b.targets(comps))
    b.breakdowns = [dict(empty=0.1, bookkeeping=1.0, post=3.0, poll=6.0, python_op=9.5, batched_op=7.0),
                    dict(empty=0.1, bookkeeping=3.0, post=5.0, poll=8.0, python_op=13.5, batched_op=9.0)]
    sbs.print_latency(b, comps)
    out = capsys.readouterr().out
    assert "Medians over 3 round(s)" in out
    assert "write_lat          2 loop     t_typical         10.00        15.00    1.200   1.000-1.500" in out
    assert "write_lat        2 B  perftest    10.00  pyrdma    15.00     +5.00 us (1.200x, range 1.000-1.500)" in out
    assert "post      qp.post_write(...) from Python                          4.00" in out
    assert "API       post + poll from Python beyond the C path               3.50" in out
    assert "API + Python account for 5.50 us of one iteration" in out


def test_rounds_alternate_which_tool_runs_first(sbs, tmp_path, monkeypatch):
    b = _bench(sbs, tmp_path)
    b.args.tests, b.args.interop, b.args.rounds = ["write_lat"], False, 3
    monkeypatch.setattr(pyrdma.testing, "rc_resends", lambda dev, port, sysfs: None)
    calls = []
    monkeypatch.setattr(b, "ours", lambda test, sizes: calls.append((b.round, "pyrdma")))
    monkeypatch.setattr(b, "perftest", lambda test, size: calls.append((b.round, "perftest")))
    b.run()
    assert calls == [(1, "pyrdma"), (1, "perftest"), (2, "perftest"), (2, "pyrdma"), (3, "pyrdma"), (3, "perftest")]


def test_table_and_plots(sbs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    b = _bench(sbs, tmp_path)
    comps = b.comparisons()
    sbs.print_table(comps, b.targets(comps))
    out = capsys.readouterr().out
    assert "write_bw" in out and "ours/pt" in out and "[MET]" in out
    files = sbs.plot(b, str(tmp_path))
    assert {os.path.basename(f) for f in files} == {"bw_vs_size.png", "latency.png"}
    assert all(os.path.getsize(f) > 1000 for f in files)


def test_listening_reads_proc():
    from pyrdma.testing import tcp_listening
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not tcp_listening(port)
        s.listen(1)
        assert tcp_listening(port)


_LAT_HEADER = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]"
               "   99% percentile[usec]   99.9% percentile[usec]\n")
_LAT_GOOD = _LAT_HEADER + " 2       500          30.50          516.95       41.60    54.16    61.32    480.39    516.95\n"
# what ib_send_lat printed in the emulated VM when its TSC calibration failed
_LAT_UNCALIBRATED = ("Correlation coefficient r^2: 0.755485 < 0.9\n" + _LAT_HEADER +
                     " 2       500          inf            inf          inf      inf     -nan     inf     inf\n")


@pytest.mark.parametrize("outputs, runs, failure", [
    ([_LAT_UNCALIBRATED, _LAT_GOOD], 2, None),
    ([_LAT_UNCALIBRATED] * 3, 3, "clock calibration failed 3 times"),
    (["ib_send_lat: some other error\n", _LAT_GOOD], 1, "0 rows"),
])
def test_perftest_runs_again_when_its_clock_calibration_failed(sbs, tmp_path, monkeypatch, outputs, runs, failure):
    b = _bench(sbs, tmp_path)
    b.rows.clear()
    calls = []

    def run_pair(server, client, port, timeout, log):
        assert server[server.index("-p") + 1] == client[client.index("-p") + 1] == str(port)
        calls.append(port)
        return 0, "", 0, outputs[len(calls) - 1]

    monkeypatch.setattr(sbs, "run_pair", run_pair)
    monkeypatch.setattr(sbs.shutil, "which", lambda name: "/usr/bin/" + name)
    b.perftest("send_lat", 2)
    assert len(calls) == runs and len(set(calls)) == runs      # a fresh port for each run
    if failure is None:
        assert b.failures == [] and [r["report"]["t_typical"] for r in b.rows] == [41.6]
    else:
        assert len(b.failures) == 1 and failure in b.failures[0] and b.rows == []


def test_resend_counters_are_taken_around_every_run(sbs, tmp_path, monkeypatch, capsys):
    b = _bench(sbs, tmp_path)
    b.args.tests, b.args.interop = ["write_bw"], True
    readings = iter([{"completer_retry_err": n, "duplicate_request": 10 * n} for n in (0, 3, 3, 3, 3, 5, 5, 5)])
    monkeypatch.setattr(pyrdma.testing, "rc_resends", lambda dev, port, sysfs: next(readings))
    for name in ("ours", "perftest", "interop"):
        monkeypatch.setattr(b, name, lambda *a: None)
    b.run()
    assert [(r["tool"], r["sizes"], r["completer_retry_err"], r["duplicate_request"]) for r in b.resends] == [
        ("pyrdma", [64, 65536], 3, 30), ("perftest", [64], 0, 0), ("perftest", [65536], 2, 20),
        ("interop", [64, 65536], 0, 0)]
    assert "RC retries (ACK timeouts; they slow the run that has them): pyrdma 64,65536B: 3, " \
           "perftest 65536B: 2" in capsys.readouterr().out
    monkeypatch.setattr(pyrdma.testing, "rc_resends", lambda dev, port, sysfs: None)   # a device without them
    b.resends.clear()
    b.run()
    assert b.resends == []


@pytest.fixture(scope="module")
def arb():
    return allreduce_bench


def _round(ib, mpi_8m, ring_8m, rd_64k, mpi_64k):
    # rows as sweep() gives them: (bytes, algorithm, seconds, (user s, sys s))
    return dict(rows=[(65536, "ring", 2 * rd_64k, (1e-3, 1e-3)), (65536, "rd", rd_64k, (1e-3, 1e-3)),
                      (8 << 20, "ring", ring_8m, (0.02, 0.2)), (8 << 20, "rd", 2 * ring_8m, (0.02, 0.2))],
                mpi={65536: mpi_64k, 8 << 20: mpi_8m}, mpi_note="OpenMPI+UCX rc_verbs on rxe0", resends={},
                ib_write_bw=ib, ib_write_bw_bidir=ib and 2 * ib)


def test_allreduce_bench_takes_each_ratio_within_its_round(arb):
    """A ratio compares figures of one round (the device drifts between rounds): round 2 is twice
    as slow in everything, so every ratio is the same in both rounds, and the verdicts use the best
    algorithm per size."""
    size = (8 << 20) / 1e9
    rounds = [_round(size / 0.2, 0.25, 0.2 / 0.95, 0.003, 0.0036),
              _round(size / 0.4, 0.5, 0.4 / 0.95, 0.006, 0.0072)]
    table = arb.summarize(rounds, ranks=2)
    by = {(r["bytes"], r["algorithm"]): r for r in table}
    ring8 = by[(8 << 20, "ring")]
    assert ring8["vs_ib_write_bw"] == pytest.approx(0.95)
    assert ring8["vs_ib_write_bw_range"] == pytest.approx([0.95, 0.95])
    assert ring8["vs_mpi"] == pytest.approx(0.25 / (0.2 / 0.95))
    assert ring8["time_us"] == pytest.approx((0.2 + 0.4) / 0.95 / 2 * 1e6)   # median of two rounds
    assert by[(65536, "rd")]["vs_mpi"] == pytest.approx(1.2)
    verdicts = {name: verdict for name, verdict, _ in arb.targets(table)}
    assert verdicts == {"busbw >= 0.9x ib_write_bw at >= 8 MiB": "MET", "time <= 1.0x MPI at every size": "MET"}
    # MPI faster at 64 KiB in one round only: the median of two ratios (1.2 and 0.6) is 0.9
    rounds[1]["mpi"][65536] = 0.0036
    verdicts = {name: (verdict, detail) for name, verdict, detail in arb.targets(arb.summarize(rounds, ranks=2))}
    verdict, detail = verdicts["time <= 1.0x MPI at every size"]
    assert verdict == "MISSED" and "65536 B rd 0.900 (rounds 0.600-1.200)" in detail


def test_allreduce_bench_without_anchors_says_so(arb):
    rounds = [_round(None, None, 0.2, 0.003, None)]
    rounds[0]["mpi"] = {}
    table = arb.summarize(rounds, ranks=2)
    assert all(r["vs_mpi"] is None and r["vs_ib_write_bw"] is None for r in table)
    assert [v for _, v, _ in arb.targets(table)] == ["n/a", "n/a"]


def test_the_overlap_baseline_computes_only_while_its_traffic_runs(arb, monkeypatch):
    """The compute loops start (a spawn takes seconds in the VM) before the traffic does, and a
    baseline whose traffic ended before the loops did is flagged, not taken for one."""
    ctx = multiprocessing.get_context("spawn")
    events = []
    rate, covered = arb._compute_beside(ctx, 2, 0.3, lambda: events.append("start"), lambda: events.append("stop"),
                                        lambda: events.append("alive?") or True)
    assert rate > 0 and covered
    assert events == ["start", "alive?", "stop"]
    rate, covered = arb._compute_beside(ctx, 1, 0.3, lambda: None, lambda: None, lambda: False)
    assert rate > 0 and not covered


def test_the_overlap_target_is_the_median_of_the_rounds_with_a_baseline(arb):
    def measured(ratio, ratio_bw, covered=True):
        return dict(ratio=ratio, ratio_ib_write_bw=ratio_bw,
                    baselines_covered=dict(allreduce=True, ib_write_bw=covered))
    # per round the stricter baseline: 0.88, 0.95; the third round's baseline is no baseline
    name, verdict, detail = arb.overlap_target([measured(1.1, 0.88), measured(0.95, 0.97), measured(0.5, 0.5, False)])
    assert verdict == "MET" and "0.915" in detail and "1 round(s) without a baseline" in detail, detail
    assert arb.overlap_target([measured(1.1, 0.85), measured(0.8, 0.97), measured(1.0, 0.95)])[1] == "MISSED"
    assert arb.overlap_target([measured(1.3, 1.3, False)])[1] == "NO BASELINE"


def test_mpi_runs_under_the_placement_of_our_ranks(arb, monkeypatch):
    """Both sides of a ratio run under one placement: a core per rank where the ranks fit on the
    CPUs (mpirun's default), else neither side is bound; mpirun gets the choice spelled out."""
    monkeypatch.setattr(arb.os, "sched_getaffinity", lambda pid: {3, 1})
    assert arb.cores_for(2) == [1, 3] and arb.cores_for(3) is None
    cmds = []

    def run(cmd, **kwargs):
        cmds.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"rows": [[8, 1e-05]]}\n', stderr="")
    monkeypatch.setattr(arb.subprocess, "run", run)
    for size, bind in ((2, "core"), (4, "none")):
        assert arb.mpi_sweep(size, [8], 3, "rxe0")[0] == {8: 1e-05}
        assert cmds[-1][cmds[-1].index("--bind-to") + 1] == bind


def _rank_value(rank, size, master, failing_rank):
    if rank == failing_rank:
        raise ValueError("a bad plan, on purpose")
    return rank, size, master.startswith("127.0.0.1:")


def _rank_exits(rank, size, master):
    if rank == 1:
        os._exit(3)                     # no value, no exception: a crash as the parent sees it
    return rank


def test_spawn_ranks_gives_the_values_by_rank_and_names_a_rank_that_fails():
    assert allreduce_bench.spawn_ranks(_rank_value, 2, (None,), timeout=120) == [(0, 2, True), (1, 2, True)]
    with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: a bad plan, on purpose"):
        allreduce_bench.spawn_ranks(_rank_value, 2, (1,), timeout=120)
    with pytest.raises(RuntimeError, match=r"exit codes \[(0|None), 3\]"):
        allreduce_bench.spawn_ranks(_rank_exits, 2, timeout=120)


def test_tcp_bench_runs_beside_sockperf_and_iperf3(tmp_path):
    """bench/tcp_bench.py, briefly: pyrdma's ping-pong and stream over TCP beside sockperf's and
    iperf3's on this host, each figure measured (positive) and the ratios taken from them."""
    import json
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "tcp.json"
    run = subprocess.run([sys.executable, os.path.join(root, "bench", "tcp_bench.py"), "--sizes", "16",
                          "--stream-bytes", str(1 << 20), "--seconds", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    latency = [r for r in rows if r["test"] == "latency"]
    assert [r["bytes"] for r in latency] == [16]
    for r in latency:
        assert r["pyrdma_us"] > 0 and r["sockperf_us"] > 0 and r["ratio"] == r["pyrdma_us"] / r["sockperf_us"]
    bws = [r for r in rows if r["test"] == "bandwidth"]
    # the socket link's own stream, then the default's where it went by address (this machine's ranks)
    assert [r["path"] for r in bws] in (["sockets"], ["sockets", "by address"]), bws
    for bw in bws:
        assert bw["pyrdma_Bps"] > 0 and bw["iperf3_Bps"] > 0 and bw["ratio"] == bw["iperf3_Bps"] / bw["pyrdma_Bps"]
    assert "sockperf ping-pong" in run.stdout and "iperf3" in run.stdout


def test_torch_bench_takes_each_ratio_within_its_round():
    """bench/torch_backend_bench.py's cell: per round the slowest rank of each backend, the ratio the
    median of the per-round ratios (not the ratio of medians); a backend's error is the cell's."""
    import importlib.util
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "bench", "torch_backend_bench.py")
    spec = importlib.util.spec_from_file_location("torch_backend_bench", path)
    tb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tb)
    # rounds: pyrdma's slowest 2, 9, 4; gloo's 4, 3, 8 -> ratios 0.5, 3.0, 0.5
    row = tb._cell("scatter", 8, [[[1.0, 9.0, 4.0], [2.0, 1.0, 3.0]], [[4.0, 3.0, 1.0], [1.0, 2.0, 8.0]]])
    assert row["round_ratios"] == [0.5, 3.0, 0.5]
    assert row["pyrdma_vs_gloo"] == 0.5 and row["pyrdma_s"] == 4.0 and row["gloo_s"] == 4.0
    failed = tb._cell("gather", 8, [[[1.0], ["RuntimeError: no"]], [[1.0], [1.0]]])
    assert failed["pyrdma_s"] == "RuntimeError: no" and failed["pyrdma_vs_gloo"] is None
    assert tb.targets([failed], None)[0]["verdict"] == "FAIL"
