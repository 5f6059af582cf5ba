"""pyrdma-perf on the host: argument parsing and defaults (perftest's), and the TCP exchange."""
import socket
import struct
import threading

import pytest

from pyrdma import Endpoint, PeerError, WireFormatError
from pyrdma.perf import cli, oob, side
from pyrdma.testing import free_port


def _cfg(*argv):
    return cli.Config(cli.build_parser().parse_intermixed_args(list(argv)))


def test_test_names_and_roles():
    assert _cfg("write_bw").test == "write_bw" and _cfg("write_bw").is_server
    c = _cfg("ib_read_lat", "-d", "rxe0", "-x", "1", "10.0.0.1")
    assert (c.test, c.is_server, c.host, c.args.ib_dev, c.args.gid_index) == ("read_lat", False, "10.0.0.1", "rxe0", 1)
    assert _cfg("send-lat").test == "send_lat"
    with pytest.raises(SystemExit):
        _cfg("ib_foo_bw")


def test_perftest_defaults():
    bw = _cfg("write_bw")
    assert (bw.sizes, bw.iters, bw.tx_depth) == ([65536], 5000, 128)
    assert bw.cq_mod_for(65536) == 1          # perftest disables CQ moderation above 8 KiB
    assert bw.cq_mod_for(8192) == 100
    lat = _cfg("write_lat")
    assert (lat.sizes, lat.iters, lat.tx_depth) == ([2], 1000, 1)
    assert _cfg("read_bw").iters == 1000
    assert _cfg("atomic_bw", "-s", "64").sizes == [8]
    assert _cfg("send_bw").rx_depth == 512


def test_dependencies_like_force_dependencies():
    c = _cfg("write_bw", "-n", "50")
    assert c.tx_depth == 50                   # tx depth never above the iteration count
    assert c.cq_mod_for(64) == 50             # CQ moderation never above the tx depth
    c = _cfg("write_bw", "-a")
    assert c.sizes[0] == 2 and c.sizes[-1] == 1 << 23
    assert c.cq_mod_for(1 << 20) == 100       # -a keeps CQ moderation for big sizes
    assert _cfg("write_bw", "-Q", "10", "-s", "65536").cq_mod_for(65536) == 10
    assert _cfg("write_bw", "-n", "30000").no_peak   # perftest: no peak above 20000 iterations
    assert _cfg("write_bw", "-D", "4").no_peak
    with pytest.raises(SystemExit):
        _cfg("write_bw", "-n", "3")
    with pytest.raises(SystemExit):
        _cfg("write_bw", "-D", "2", "-f", "1")


def test_flags():
    c = _cfg("write_bw", "-s", "4096", "-n", "100", "-q", "4", "-t", "64", "-p", "20000", "--report_gbits",
             "-b", "-F", "--mode", "batched", "--json", "out.json", "-l", "16", "192.168.0.2")
    assert (c.sizes, c.iters, c.num_qps, c.tx_depth, c.args.port, c.gbits, c.bidir, c.modes, c.post_list) == \
        ([4096], 100, 4, 64, 20000, True, True, ["batched"], 16)
    assert c.args.json_path == "out.json" and c.args.cpu_freq
    assert _cfg("write_bw", "--mode", "both").modes == ["loop", "batched"]
    assert _cfg("write_bw").modes == ["loop", "batched"]
    assert _cfg("send_bw", "--sizes", "64,4096").sizes == [64, 4096]
    assert _cfg("write_lat", "-q", "4").num_qps == 1     # latency tests use one QP
    assert _cfg("write_bw", "--report-gbits", "--ib-dev", "mlx5_0", "--gid-index", "3").args.gid_index == 3


def test_qp_timeout_like_perftest_u():
    assert _cfg("write_bw").args.qp_timeout == 14
    assert _cfg("write_bw", "-u", "20").args.qp_timeout == 20
    assert _cfg("write_bw", "--qp-timeout", "18").args.qp_timeout == 18
    for bad in ("0", "32"):
        with pytest.raises(SystemExit, match="qp-timeout must be within 1..31"):
            _cfg("write_bw", "-u", bad)


def test_inline_default_follows_perftest():
    assert side._default_inline(_cfg("write_lat"), 0x02C9) == 220
    assert side._default_inline(_cfg("send_lat"), 0x02C9) == 236
    assert side._default_inline(_cfg("write_lat"), 0xFFFFFF) == 0    # rxe: unknown vendor
    assert side._default_inline(_cfg("write_bw"), 0x02C9) == 0
    assert side._default_inline(_cfg("write_lat", "-I", "64"), 0xFFFFFF) == 64


def test_server_adopts_client_parameters():
    client = _cfg("write_bw", "-n", "200", "--sizes", "64,128", "--mode", "loop", "host")
    server = _cfg("write_bw")
    server.adopt(client.run_params())
    assert (server.sizes, server.iters, server.modes, server.tx_depth) == ([64, 128], 200, ["loop"], 128)


def test_alt_hex_like_printf():
    assert side._alt_hex(0, 4) == "0000"
    assert side._alt_hex(0x11, 6) == "0x0011"
    assert side._alt_hex(0x2e0, 8) == "0x0002e0"


# -- out-of-band exchange ---------------------------------------------------------------------------

@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ca, cb = oob.Channel(a, "a", timeout=5), oob.Channel(b, "b", timeout=5)
    yield ca, cb
    ca.close()
    cb.close()


def test_frames_and_json(pair):
    a, b = pair
    a.send_json(oob.HELLO, {"test": "write_bw", "sizes": [2, 4]})
    assert b.recv_json(oob.HELLO) == {"test": "write_bw", "sizes": [2, 4]}
    frame = oob.encode_frame(oob.SYNC, b"go")
    assert frame[:8] == b"PYRDMAPF" and frame[8] == oob.WIRE_VERSION
    assert oob.decode_header(frame[:oob.HEADER_SIZE]) == (oob.SYNC, 2)


def test_endpoints_roundtrip(pair):
    a, b = pair
    eps = [Endpoint(qpn=0x11 + i, psn=0x1234, gid=bytes(10) + b"\xff\xff\x7f\x00\x00\x01", gid_index=1,
                    addr=0x7F0000001000, rkey=0x2E0, length=1 << 20) for i in range(3)]
    t = threading.Thread(target=lambda: b.send(oob.ENDPOINTS, oob.encode_endpoints(eps[::-1])))
    t.start()
    got = a.exchange_endpoints(eps)
    t.join()
    assert got == eps[::-1]
    with pytest.raises(WireFormatError):
        oob.decode_endpoints(struct.pack("!H", 2) + eps[0].to_bytes())


def test_sync_barrier(pair):
    a, b = pair
    t = threading.Thread(target=b.sync, args=("go:loop:64",))
    t.start()
    a.sync("go:loop:64")
    t.join()
    b.send(oob.SYNC, b"go:loop:128")
    with pytest.raises(WireFormatError, match="out of step"):
        a.sync("go:loop:64")


def test_foreign_and_versioned_peers_refused(pair):
    a, b = pair
    b.sock.sendall(b"0000:0000:000011:123456:000002e0:00007f0000001000:" + bytes(60))   # perftest keys
    with pytest.raises(WireFormatError, match="not a pyrdma-perf peer"):
        a.recv()
    bad_version = oob.FRAMING.header.pack(b"PYRDMAPF", oob.WIRE_VERSION + 1, oob.HELLO, 0)
    with pytest.raises(WireFormatError, match="version"):
        oob.decode_header(bad_version)
    with pytest.raises(WireFormatError, match="kind"):
        oob.decode_header(oob.FRAMING.header.pack(b"PYRDMAPF", oob.WIRE_VERSION, 99, 0))


def test_peer_error_and_close(pair):
    a, b = pair
    b.fail("device exploded")
    with pytest.raises(oob.PeerFailed, match="device exploded"):
        a.recv(oob.REPORT)
    b.close()
    with pytest.raises(PeerError):
        a.recv(oob.REPORT)


def test_wrong_message_type(pair):
    a, b = pair
    b.send_json(oob.REPORT, {})
    with pytest.raises(WireFormatError, match="expected HELLO"):
        a.recv_json(oob.HELLO)


def test_listen_and_dial_on_loopback():
    port = free_port()
    result = {}

    def server():
        ch, result["hello"] = oob.listen(port, host="127.0.0.1", timeout=10)
        with ch:
            ch.send_json(oob.HELLO, {"ok": True})
            ch.bye()

    t = threading.Thread(target=server)
    t.start()
    with oob.dial("127.0.0.1", port, timeout=10) as ch:    # retries until the server listens
        assert ch.exchange_json(oob.HELLO, {"test": "send_lat"}) == {"ok": True}
        ch.bye()
    t.join(10)
    assert result["hello"] == {"test": "send_lat"}


def test_main_reports_unknown_test():
    with pytest.raises(SystemExit):
        cli.main(["nonsense_bw"])
