"""pyrdma-perf --perftest-compat against Debian's perftest binaries on a real device (rxe0 in the
test VM): our client with their server and their client with our server. Each side prints what it
learnt of the other in the key exchange, and perftest's server prints the figures our client sent
in the report exchange, so both directions of the wire format are checked against a program we did
not write."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from pyrdma.perf.parse import parse_output
from pyrdma.testing import tcp_listening

pytestmark = pytest.mark.device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 180
ITERS = "200"


def _device_args():
    import pyrdma
    with pyrdma.Context() as ctx:
        return ["-d", ctx.name, "-x", str(ctx.best_gid_index(1))]


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _perftest(test):
    path = shutil.which(f"ib_{test}")
    if path is None:
        pytest.fail(f"ib_{test} not found: scripts/setup.sh installs Debian's perftest")
    return path


def _pair(server_cmd, client_cmd, port):
    """Run a server then a client (always killed on the way out); both outputs."""
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
    return parse_output(out_s), parse_output(out_c), out_s, out_c


def _same_qps(a, b):
    """a's view of its remote is b's view of itself (QPN, PSN, and for RDMA the rkey and address)."""
    for key in ("qpn", "psn", "rkey", "vaddr"):
        assert a.remote[key] == b.local[key], f"{key}: {a.remote} vs {b.local}"


@pytest.mark.parametrize("test", ["write_bw", "read_bw"])
def test_our_client_with_perftest_server(test):
    port, dev = _free_port(), _device_args()
    common = [*dev, "-s", "65536", "-n", ITERS, "-p", str(port)]
    srv, cli, out_s, out_c = _pair(
        [_perftest(test), *common],
        [sys.executable, "-m", "pyrdma.perf", test, "--perftest-compat", "--mode", "batched", *common,
         "127.0.0.1"], port)
    _same_qps(srv, cli)
    _same_qps(cli, srv)
    (ours,) = cli.rows_for("batched")
    (theirs,) = srv.rows_for(None)          # perftest's server prints the client's report
    assert ours.size == theirs.size == 65536 and theirs.iters == int(ITERS)
    assert ours.bw_avg > 0 and theirs.bw_avg == pytest.approx(ours.bw_avg, abs=0.01)
    assert theirs.msg_rate == pytest.approx(ours.msg_rate, abs=1e-6)


@pytest.mark.parametrize("test", ["write_bw", "read_bw"])
def test_perftest_client_with_our_server(test, tmp_path):
    port, dev = _free_port(), _device_args()
    common = [*dev, "-s", "4096", "-n", ITERS, "-p", str(port)]
    srv, cli, out_s, out_c = _pair(
        [sys.executable, "-m", "pyrdma.perf", test, "--perftest-compat", *common,
         "--json", str(tmp_path / "server.json")],
        [_perftest(test), *common, "127.0.0.1"], port)
    _same_qps(srv, cli)
    _same_qps(cli, srv)
    (theirs,) = cli.rows_for(None)
    (shown,) = srv.rows_for(None)           # our server prints the perftest client's report
    assert theirs.size == shown.size == 4096 and theirs.bw_avg > 0
    assert shown.bw_avg == pytest.approx(theirs.bw_avg, abs=0.01)
    assert "perftest 6.06 exchange" in out_s

