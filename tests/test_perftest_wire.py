"""perftest's TCP exchange (pyrdma.perf.perftest_wire) without a device: the record texts, the
version gate, and a whole conversation against a scripted peer that reads and writes exactly the
message sizes perftest 4.5's C code does, in its order."""
import socket
import struct
import subprocess
import sys
import threading

import pytest

from pyrdma.errors import PeerError, WireFormatError
from pyrdma.perf import perftest_wire as pw

GID = bytes([0] * 10 + [0xFF, 0xFF, 127, 0, 0, 1])
DEST = pw.Dest(lid=0, out_reads=16, qpn=0x11, psn=0xABCDEF, rkey=0x1234, vaddr=0x7F00DEADB000, gid=GID)


def test_record_with_gid_is_perftests_108_bytes():
    raw = pw.encode_dest(DEST, with_gid=True)
    assert len(raw) == 108 and raw.endswith(b":\0")
    # KEY_PRINT_FMT_GID: "%04x:%04x:%06x:%06x:%08x:%016llx:" then 16 x "%02x:" then "%08x:"
    assert raw.rstrip(b"\0") == (b"0000:0010:000011:abcdef:00001234:00007f00deadb000:"
                                 b"00:00:00:00:00:00:00:00:00:00:ff:ff:7f:00:00:01:00000000:")
    assert pw.decode_dest(raw, with_gid=True) == DEST
    assert pw.decode_dest(raw, with_gid=True).ipv4_mapped


def test_record_without_gid_is_perftests_59_bytes():
    d = pw.Dest(lid=0x1A, out_reads=4, qpn=0x123456, psn=1, rkey=0xFFFFFFFF, vaddr=1 << 40, srqn=7)
    raw = pw.encode_dest(d, with_gid=False)
    assert len(raw) == 59
    assert raw.rstrip(b"\0") == b"001a:0004:123456:000001:ffffffff:0000010000000000:00000007"
    assert pw.decode_dest(raw, with_gid=False) == d


def test_bad_records_name_the_problem():
    raw = pw.encode_dest(DEST, with_gid=True)
    with pytest.raises(WireFormatError, match="fields.*-x"):
        pw.decode_dest(raw[:59], with_gid=False)          # a GID record read as a GID-less one
    with pytest.raises(WireFormatError, match="not hex"):
        pw.decode_dest(raw.replace(b"abcdef", b"zzzzzz"), with_gid=True)
    with pytest.raises(WireFormatError, match="out of range"):
        pw.encode_dest(pw.Dest(lid=0, out_reads=0, qpn=1 << 30, psn=0, rkey=0, vaddr=1 << 70), with_gid=False)


def test_version_gate():
    assert pw.encode_version() == b"6.06" + b"\0" * 12
    assert pw.decode_version(b"6.10".ljust(16, b"\0")) == "6.10"
    with pytest.raises(WireFormatError, match="too old"):
        pw.decode_version(b"5.60".ljust(16, b"\0"))
    with pytest.raises(WireFormatError, match="is it perftest"):
        pw.decode_version(b"PYRDMAPF\x01\x01\0\0\0\0\0\0")


def test_report_is_big_endian():
    raw = pw.encode_report(65536, 5000, 1.5, 1.25, 0.02)
    assert raw[:8] == (65536).to_bytes(8, "big") and raw[16:24] == struct.pack(">d", 1.5)
    assert pw.decode_report(raw) == dict(size=65536, iters=5000, bw_peak=1.5, bw_avg=1.25, msg_rate=0.02)


def _scripted_perftest_server(sock, log):
    """The server half of ib_write_bw's exchange, message by message as perftest_communication.c
    does it: read the client's message of a fixed size, then write ours of the same size."""
    def xchg(size, reply):
        got = b""
        while len(got) < size:
            chunk = sock.recv(size - len(got))
            if not chunk:
                raise EOFError
            got += chunk
        log.append(got)
        if reply is not None:
            sock.sendall(reply)

    xchg(16, b"6.06".ljust(16, b"\0"))                                  # exchange_versions
    xchg(4, struct.pack("!i", 8192))                                    # check_sys_data: cycle buffer
    xchg(4, struct.pack("!i", 128))                                     # cache line
    xchg(2, b"3\0")                                                     # check_mtu: IBV_MTU_1024
    theirs = pw.encode_dest(pw.Dest(0, 1, 0x77, 0x42, 0x99, 0x1000, GID), True)
    for _ in range(3):                                                  # keys, keys again, after RTR
        xchg(108, theirs)
    xchg(108, theirs)                                                   # the client has finished
    for value in (b"\0" * 8,) * 5:                                      # xchg_bw_reports
        xchg(8, value)
    xchg(108, theirs)                                                   # ctx_close_connection
    xchg(5, None)                                                       # "done"


def test_client_conversation_matches_perftests_message_sizes():
    a, b = socket.socketpair()
    log = []
    t = threading.Thread(target=_scripted_perftest_server, args=(b, log), daemon=True)
    t.start()
    conv = pw.Conversation(a, "scripted", client=True, timeout=10)
    assert conv.versions() == "6.06"
    assert conv.sys_data(4096) == (8192, 128)           # both keep the larger
    assert conv.mtu(5) == 3                             # and the smaller MTU
    peer = conv.keys(DEST, True)
    assert (peer.qpn, peer.psn, peer.rkey, peer.vaddr, peer.gid) == (0x77, 0x42, 0x99, 0x1000, GID)
    conv.keys(DEST, True)
    conv.keys(DEST, True)
    conv.keys(DEST, True)
    got = conv.reports(dict(size=65536, iters=200, bw_peak=10.0, bw_avg=9.5, msg_rate=0.15))
    assert got == dict(size=0, iters=0, bw_peak=0.0, bw_avg=0.0, msg_rate=0.0)
    conv.finish(DEST, True)
    t.join(10)
    assert not t.is_alive()
    assert [len(m) for m in log] == [16, 4, 4, 2, 108, 108, 108, 108, 8, 8, 8, 8, 8, 108, 5]
    assert log[3] == b"5\0" and log[-1] == b"done\0"
    assert pw.decode_dest(log[4], True) == DEST
    report = pw.decode_report(b"".join(log[8:13]))
    assert report["size"] == 65536 and report["bw_avg"] == 9.5
    b.close()


def test_server_conversation_reads_first_and_survives_a_vanished_peer():
    a, b = socket.socketpair()
    server = pw.Conversation(a, "client", client=False, timeout=10)
    b.sendall(pw.encode_version("6.06"))
    assert server.versions() == "6.06"
    assert b.recv(16) == pw.encode_version()
    b.close()
    with pytest.raises(PeerError, match="closed the connection"):
        server.sys_data(4096)


def test_compat_refuses_tests_it_cannot_run():
    for test, why in (("send_bw", "write_bw and read_bw"), ("write_lat", "write_bw and read_bw")):
        out = subprocess.run([sys.executable, "-m", "pyrdma.perf", test, "--perftest-compat", "127.0.0.1"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and why in out.stderr
    out = subprocess.run([sys.executable, "-m", "pyrdma.perf", "write_bw", "--perftest-compat", "--check",
                          "127.0.0.1"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--check needs a pyrdma-perf peer" in out.stderr


def test_values_from_a_peer_are_bounded():
    # float() takes these; perftest never sends them
    for text in (b"nan", b"inf", b"1e9", b"6.06.1"):
        with pytest.raises(WireFormatError, match="where perftest sends its version"):
            pw.decode_version(text.ljust(16, b"\0"))
    # the peer's cycle buffer sizes our buffer: a huge or odd one is refused, not allocated
    assert pw.check_sys_data(8192, 128, 4096, 64) == (8192, 128)
    for cycle, line in ((1 << 30, 64), (0x7FFFFFFF, 64), (-4096, 64), (3000, 64), (4096, 1 << 20), (4096, 0)):
        with pytest.raises(WireFormatError):
            pw.check_sys_data(cycle, line, 4096, 64)
    raw = pw.encode_dest(DEST, with_gid=True).replace(b"000011", b"fffffffffff", 1)
    with pytest.raises(WireFormatError, match="out of range|fields"):
        pw.decode_dest(raw[:pw.KEY_MSG_SIZE_GID], with_gid=True)
    with pytest.raises(WireFormatError, match="40"):
        pw.decode_report(bytes(12))


# ---- -R: the binary key record of perftest's rdma_cm exchange --------------------------------------

def test_rdma_cm_key_record_is_perftests_struct_in_network_order():
    from pyrdma.perf import rdmacm
    gid = bytes(range(16))
    d = pw.Dest(lid=0x12, out_reads=16, qpn=0x123456, psn=0xABCDEF, rkey=0xDEADBEEF, vaddr=0x1122334455667788,
                gid=gid, srqn=7)
    raw = rdmacm.encode_dest_binary(d, gid_index=3)
    assert len(raw) == 56                              # sizeof(struct pingpong_dest) on x86-64
    assert raw[0:4] == b"\0\0\0\x12" and raw[4:8] == b"\0\0\0\x10"
    assert raw[8:12] == bytes.fromhex("00123456") and raw[12:16] == bytes.fromhex("00abcdef")
    assert raw[16:20] == bytes.fromhex("deadbeef")
    assert raw[24:32] == bytes.fromhex("1122334455667788")    # after 4 bytes of alignment padding
    assert raw[32:48] == gid and raw[48:52] == b"\0\0\0\x07" and raw[52:56] == b"\0\0\0\x03"
    assert rdmacm.decode_dest_binary(raw) == d


def test_rdma_cm_key_record_is_checked():
    from pyrdma.perf import rdmacm
    with pytest.raises(WireFormatError, match="56"):
        rdmacm.decode_dest_binary(b"\0" * 55)
    bad = bytearray(rdmacm.encode_dest_binary(pw.Dest(0, 0, 1, 1, 1, 1)))
    bad[8:12] = b"\x01\0\0\0"                          # a QPN above 24 bits
    with pytest.raises(WireFormatError, match="qpn"):
        rdmacm.decode_dest_binary(bytes(bad))


def test_rdma_cm_refuses_what_perftest_cannot_follow():
    """-R runs every test, but not -b, --check, or (where both sides run in step) two modes or -D:
    refused before anything is opened."""
    for args, why in ((["write_bw", "-b"], "-R does not run -b"),
                      (["send_bw", "--check"], "--check needs a pyrdma-perf peer"),
                      (["send_lat", "--mode", "both"], "choose --mode loop or --mode batched"),
                      (["write_lat", "-D", "4"], "-R runs write_lat for -n iterations, not -D")):
        r = subprocess.run([sys.executable, "-m", "pyrdma.perf", *args, "-R", "127.0.0.1"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and why in r.stderr, (args, r.stderr)


def test_rdma_cm_scripts_follow_perftest():
    """Each test's handshakes (perftest 4.5's main()s): the passive servers wait for the client's run,
    the send tests meet before each size, write_lat leaves without a last handshake."""
    from pyrdma.perf import cli, compat
    assert set(compat.SCRIPTS) == set(cli.TESTS)
    s = compat.SCRIPTS
    for test in ("write_bw", "read_bw", "atomic_bw"):
        assert s[test].setup == ("keys", "rtr", "each", "first") and s[test].reports and not s[test].server_runs
    for test in ("send_bw", "send_lat"):
        assert s[test].setup == ("keys", "rtr", "first", "each") and s[test].server_runs and s[test].sync_before
    assert s["send_bw"].sync_after and not s["send_lat"].sync_after
    for test in ("write_lat", "read_lat", "atomic_lat"):
        assert s[test].setup == ("first", "keys", "rtr", "each", "first") and not s[test].sync_before
    assert s["write_lat"].server_runs and not s["write_lat"].close
    assert not s["read_lat"].server_runs and s["read_lat"].close
    # --mode's default: both tables, but one pass where a perftest peer runs in step
    cfg = cli.Config(cli.build_parser().parse_intermixed_args(["send_lat", "-R", "127.0.0.1"]))
    assert cfg.modes == ["loop", "batched"]
    from pyrdma.perf.rdmacm import RdmaCmSide
    assert RdmaCmSide(cfg).cfg.modes == ["loop"]
