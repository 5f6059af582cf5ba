"""pyrdma-perf end to end on a real device (rxe0 in the test VM): server and client of every test
as subprocesses for a few iterations (with timeouts; always killed), checking sane non-zero
numbers, perftest-format output, JSON, and the transferred data (--check). Then --perftest-compat
against Debian's perftest binaries: our client with their server and their client with our server.
Each side prints what it learnt of the other in the key exchange, and perftest's server prints the
figures our client sent in the report exchange, so both directions of the wire format are checked
against a program we did not write."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from pyrdma.perf.parse import parse_output
from pyrdma.testing import again_if_perftest_clock_failed, free_port, tcp_listening

pytestmark = pytest.mark.device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 180


def _device_args():
    import pyrdma
    with pyrdma.Context() as ctx:
        return ["-d", ctx.name, "-x", str(ctx.best_gid_index(1))]


def _pair(server_cmd, client_cmd, port):
    """Run a server, and a client once the server listens on ``port`` (perftest's client does not
    retry); both are killed on the way out. Both must succeed; returns their outputs. A perftest
    that gave up on its clock runs again on a fresh port."""
    return again_if_perftest_clock_failed(_pair_once, server_cmd, client_cmd, port, free_port)


def _pair_once(server_cmd, client_cmd, port):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    srv = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                           env=env)
    cli = None
    try:
        deadline = time.monotonic() + 60
        while not tcp_listening(port) and srv.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        cli = subprocess.Popen(client_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=ROOT, env=env)
        try:
            out_c, _ = cli.communicate(timeout=TIMEOUT)
            out_s, _ = srv.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for p in (cli, srv):
                p.kill()
            pytest.fail(f"timed out; server said:\n{srv.communicate()[0]}\nclient said:\n{cli.communicate()[0]}")
    finally:
        for p in (cli, srv):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert cli.returncode == 0, f"client failed:\n{out_c}\nserver:\n{out_s}"
    assert srv.returncode == 0, f"server failed:\n{out_s}\nclient:\n{out_c}"
    return out_s, out_c


def _run(test, extra, tmp_path):
    port = free_port()
    base = [sys.executable, "-m", "pyrdma.perf", test, *_device_args(), "-p", str(port), "--check", *extra]
    out_s, out_c = _pair(base + ["--json", str(tmp_path / "server.json")],
                         base + ["--json", str(tmp_path / "client.json"), "127.0.0.1"], port)
    return out_s, out_c, json.loads((tmp_path / "client.json").read_text())


BW = [("write_bw", []), ("read_bw", []), ("send_bw", []), ("atomic_bw", []),
      ("atomic_bw", ["-A", "CMP_AND_SWAP"]), ("write_bw", ["-q", "2"]), ("write_bw", ["-b"])]


@pytest.mark.parametrize("test,extra", BW, ids=[f"{t}{''.join(e)}" for t, e in BW])
def test_bandwidth(test, extra, tmp_path):
    out_s, out_c, doc = _run(test, ["-n", "64", "--sizes", "64,16384", *extra], tmp_path)
    run = parse_output(out_c)
    assert run.kind == "bw" and "BW Test" in run.title
    sizes = [8] if test.startswith("atomic") else [64, 16384]
    for mode in ("loop", "batched"):
        rows = run.rows_for(mode)
        assert [r.size for r in rows] == sizes
        for r in rows:
            assert r.bw_avg > 0 and r.msg_rate > 0 and r.bw_peak >= r.bw_avg * 0.5
    assert "Data check      : OK" in out_c and "Data check      : OK" in out_s
    assert doc["test"] == test and len(doc["results"]) == 2 * len(sizes)
    if test != "send_bw":
        # perftest's server prints the client's numbers
        assert parse_output(out_s).rows_for("loop")[0].bw_avg == run.rows_for("loop")[0].bw_avg or "-b" in extra


LAT = [("write_lat", []), ("read_lat", []), ("send_lat", []), ("atomic_lat", []),
       ("write_lat", ["-I", "0"])]


@pytest.mark.parametrize("test,extra", LAT, ids=[f"{t}{''.join(e)}" for t, e in LAT])
def test_latency(test, extra, tmp_path):
    out_s, out_c, doc = _run(test, ["-n", "50", "--sizes", "2,4096" if not test.startswith("atomic") else "8",
                                    *extra], tmp_path)
    run = parse_output(out_c)
    assert run.kind == "lat" and "Latency Test" in run.title
    for mode in ("loop", "batched"):
        for r in run.rows_for(mode):
            assert r.iters == 50
            assert 0 < r.t_min <= r.t_typical <= r.t_max
            assert r.t_min <= r.t_avg and r.p99 >= r.t_typical
    assert "Data check      : OK" in out_c
    if test in ("write_lat", "send_lat"):
        assert "Data check      : OK" in out_s          # both sides receive in a ping-pong
        assert parse_output(out_s).rows_for("loop")


def test_duration_mode(tmp_path):
    out_s, out_c, doc = _run("write_bw", ["-D", "2", "-s", "4096", "--mode", "batched"], tmp_path)
    (row,) = parse_output(out_c).rows_for("batched")
    assert row.iters > 0 and row.bw_avg > 0 and row.bw_peak == 0.0     # duration: no peak, as perftest
    out_s, out_c, doc = _run("write_lat", ["-D", "2", "--mode", "loop"], tmp_path)
    run = parse_output(out_c)
    assert run.kind == "lat_duration" and run.rows[0].t_avg > 0 and run.rows[0].tps > 0


def test_mismatched_tests_fail_cleanly(tmp_path):
    port = str(free_port())
    dev = _device_args()
    srv = subprocess.Popen([sys.executable, "-m", "pyrdma.perf", "write_bw", *dev, "-p", port],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        time.sleep(0.2)
        cli = subprocess.run([sys.executable, "-m", "pyrdma.perf", "read_bw", *dev, "-p", port, "127.0.0.1"],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert cli.returncode != 0
        srv.wait(timeout=30)
        assert srv.returncode != 0
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


# ---- against perftest itself (--perftest-compat) ---------------------------------------------------

ITERS = "200"


def _perftest(test):
    path = shutil.which(f"ib_{test}")
    if path is None:
        pytest.fail(f"ib_{test} not found: scripts/setup.sh installs Debian's perftest")
    return path


def _same_qps(a, b):
    """a's view of its remote is b's view of itself (QPN, PSN, and for RDMA the rkey and address)."""
    for key in ("qpn", "psn", "rkey", "vaddr"):
        assert a.remote[key] == b.local[key], f"{key}: {a.remote} vs {b.local}"


@pytest.mark.parametrize("test", ["write_bw", "read_bw"])
def test_our_client_with_perftest_server(test):
    port, dev = free_port(), _device_args()
    common = [*dev, "-s", "65536", "-n", ITERS, "-p", str(port)]
    out_s, out_c = _pair([_perftest(test), *common],
                         [sys.executable, "-m", "pyrdma.perf", test, "--perftest-compat", "--mode", "batched",
                          *common, "127.0.0.1"], port)
    srv, cli = parse_output(out_s), parse_output(out_c)
    _same_qps(srv, cli)
    _same_qps(cli, srv)
    (ours,) = cli.rows_for("batched")
    (theirs,) = srv.rows_for(None)          # perftest's server prints the client's report
    assert ours.size == theirs.size == 65536 and theirs.iters == int(ITERS)
    assert ours.bw_avg > 0 and theirs.bw_avg == pytest.approx(ours.bw_avg, abs=0.01)
    assert theirs.msg_rate == pytest.approx(ours.msg_rate, abs=1e-6)


@pytest.mark.parametrize("test", ["write_bw", "read_bw"])
def test_perftest_client_with_our_server(test, tmp_path):
    port, dev = free_port(), _device_args()
    common = [*dev, "-s", "4096", "-n", ITERS, "-p", str(port)]
    out_s, out_c = _pair([sys.executable, "-m", "pyrdma.perf", test, "--perftest-compat", *common,
                          "--json", str(tmp_path / "server.json")],
                         [_perftest(test), *common, "127.0.0.1"], port)
    srv, cli = parse_output(out_s), parse_output(out_c)
    _same_qps(srv, cli)
    _same_qps(cli, srv)
    (theirs,) = cli.rows_for(None)
    (shown,) = srv.rows_for(None)           # our server prints the perftest client's report
    assert theirs.size == shown.size == 4096 and theirs.bw_avg > 0
    assert shown.bw_avg == pytest.approx(theirs.bw_avg, abs=0.01)
    assert "perftest 6.06 exchange" in out_s

