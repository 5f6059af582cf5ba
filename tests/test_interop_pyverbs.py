"""Interop with a verbs stack we did not write: Debian's pyverbs (rdma-core) in another process.

A pyrdma RC QP (this process) and a pyverbs RC QP (tests/peers/pyverbs_peer.py under the system
/usr/bin/python3) swap endpoints over a JSON-lines TCP exchange, then each side does an RDMA WRITE,
a SEND and a SEND_WITH_IMM into the other; both sides check their whole MR byte for byte (payloads
where planned, the fill byte everywhere else) and the immediate data in host order.
"""
import hashlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pyrdma as rd
from pyrdma.endpoint import Endpoint

SYSTEM_PYTHON = "/usr/bin/python3"
PEER = Path(__file__).resolve().parent / "peers" / "pyverbs_peer.py"
PROTO = "pyrdma-interop"
VERSION = 1
MAX_LINE = 1 << 16
TIMEOUT = 60.0          # each socket op / completion wait (the CI VM emulates its CPU: be generous)
MR_LENGTH = 1 << 18
OUR_FILL = 0x5A
PEER_FILL = 0xA5

# Offsets are into the receiver's MR; lengths are odd on purpose (multi-packet, unaligned tails).
PLAN = {
    "to_peer": {
        "write": {"offset": 4099, "length": 150_001, "seed": "pyrdma->pyverbs write"},
        "send": {"recv_offset": 163_840, "length": 20_007, "seed": "pyrdma->pyverbs send"},
        "send_imm": {"recv_offset": 200_704, "length": 777, "seed": "pyrdma->pyverbs send_imm",
                     "imm": 0xC0FFEE01},
    },
    "to_test": {
        "write": {"offset": 8_191, "length": 131_073, "seed": "pyverbs->pyrdma write"},
        "send": {"recv_offset": 147_456, "length": 33_333, "seed": "pyverbs->pyrdma send"},
        "send_imm": {"recv_offset": 217_088, "length": 1_001, "seed": "pyverbs->pyrdma send_imm",
                     "imm": 0x1234ABCD},
    },
    "peer_fill": PEER_FILL,
}


def pattern(seed, length):
    """Same bytes as pyverbs_peer.pattern: SHA-256 in counter mode over the seed string."""
    out = bytearray()
    key = str(seed).encode()
    counter = 0
    while len(out) < length:
        out += hashlib.sha256(key + counter.to_bytes(8, "little")).digest()
        counter += 1
    return np.frombuffer(bytes(out[:length]), np.uint8)


def _peer_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYENV", "VIRTUAL_ENV"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"    # the CI VM sees the source tree read-only
    return env


@pytest.fixture(scope="module")
def pyverbs_python():
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} not found (the pyverbs peer runs under the system Python)")
    try:
        probe = subprocess.run([SYSTEM_PYTHON, "-I", "-c", "import pyverbs.device, pyverbs.qp"],
                               capture_output=True, text=True, timeout=60, env=_peer_env())
    except subprocess.TimeoutExpired:
        pytest.skip(f"{SYSTEM_PYTHON} -c 'import pyverbs' timed out")
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"{SYSTEM_PYTHON} cannot import pyverbs (apt install python3-pyverbs): {last}")
    return SYSTEM_PYTHON


class Channel:
    """JSON lines over TCP, the test's end; mirrors pyverbs_peer.Channel."""

    def __init__(self, sock):
        self.sock = sock
        self.rfile = sock.makefile("rb")

    def send(self, msg_type, **fields):
        msg = {"proto": PROTO, "version": VERSION, "type": msg_type, **fields}
        self.sock.sendall(json.dumps(msg, sort_keys=True).encode() + b"\n")

    def recv(self, expected_type):
        try:
            line = self.rfile.readline(MAX_LINE + 1)
        except socket.timeout:
            raise AssertionError(f"timed out after {TIMEOUT:.0f} s waiting for the peer's "
                                 f"{expected_type!r} message") from None
        assert line, f"the peer closed the connection before sending {expected_type!r}"
        assert len(line) <= MAX_LINE and line.endswith(b"\n"), "oversized or truncated peer message"
        msg = json.loads(line)
        assert isinstance(msg, dict) and msg.get("proto") == PROTO, f"not a {PROTO} message: {line[:80]!r}"
        assert msg.get("version") == VERSION, f"peer speaks protocol version {msg.get('version')!r}"
        if msg.get("type") == "error":
            raise AssertionError(f"the pyverbs peer gave up: {msg.get('message')}")
        assert msg.get("type") == expected_type, f"expected {expected_type!r}, got {msg.get('type')!r}"
        return msg

    def close(self):
        try:
            self.rfile.close()
        finally:
            self.sock.close()


def _endpoint_json(ep):
    return {"qpn": ep.qpn, "psn": ep.psn, "lid": ep.lid, "gid": ep.gid_str, "gid_index": ep.gid_index,
            "port": ep.port, "mtu": ep.mtu, "addr": ep.addr, "rkey": ep.rkey, "length": ep.length}


def _endpoint_from_json(d):
    return Endpoint(qpn=d["qpn"], psn=d["psn"], lid=d["lid"], gid=ipaddress.IPv6Address(d["gid"]).packed,
                    port=d["port"], gid_index=d["gid_index"], mtu=d["mtu"], addr=d["addr"], rkey=d["rkey"],
                    length=d["length"])


def _wait(cq, wcs, n):
    got = []
    while sum(len(w) for w in got) < n:
        k = cq.poll_wait(wcs[:n - sum(len(w) for w in got)], 1, timeout=TIMEOUT)
        got.append(wcs[:k].copy())
    out = np.concatenate(got)
    rd.check_wcs(out)
    return out


def _exchange(ctx, listener, peer):
    """Drive our side of the protocol; returns (peer hello, peer received, peer result) messages."""
    pd = rd.ProtectionDomain(ctx)
    try:
        send_cq = rd.CompletionQueue(ctx, 16)
        recv_cq = rd.CompletionQueue(ctx, 16)
        qp = rd.QueuePair(pd, rd.QPT_RC, send_cq, recv_cq, max_send_wr=8, max_recv_wr=8)
        target = np.full(MR_LENGTH, OUR_FILL, np.uint8)
        target_mr = rd.MemoryRegion(pd, target, rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE)
        source = np.zeros(MR_LENGTH, np.uint8)
        source_mr = rd.MemoryRegion(pd, source, rd.ACCESS_LOCAL_WRITE)
        wcs = np.empty(8, rd.WC_DTYPE)

        deadline = time.monotonic() + TIMEOUT
        while True:     # accept in short slices so a peer that died at start-up fails us at once
            try:
                sock, _ = listener.accept()
                break
            except socket.timeout:
                if peer.poll() is not None:
                    raise AssertionError(f"the pyverbs peer exited ({peer.returncode}) before "
                                         f"connecting") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"the pyverbs peer did not connect within {TIMEOUT:.0f} s") from None
        sock.settimeout(TIMEOUT)
        chan = Channel(sock)
        try:
            hello = chan.recv("hello")
            remote = _endpoint_from_json(hello["endpoint"])
            assert remote.length >= MR_LENGTH and remote.rkey, hello
            ours = ctx.gid_table(qp.port)
            types = {e.index: e.gid_type for e in ours}
            assert types.get(remote.gid_index) == types.get(qp.endpoint().gid_index), (
                f"peer uses GID {remote.gid_index} ({types.get(remote.gid_index)}), we use "
                f"{qp.endpoint().gid_index} ({types.get(qp.endpoint().gid_index)})")

            qp.to_init(access=rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE)
            to_test = PLAN["to_test"]
            qp.post_recv_buf(target_mr, to_test["send"]["recv_offset"], to_test["send"]["length"], wr_id=1)
            qp.post_recv_buf(target_mr, to_test["send_imm"]["recv_offset"], to_test["send_imm"]["length"],
                             wr_id=2)
            qp.connect(remote)
            chan.send("hello", endpoint=_endpoint_json(qp.endpoint(mr=target_mr)), plan=PLAN)
            chan.recv("ready")

            # Our WRITE, SEND, SEND_WITH_IMM into the peer's MR (sources laid out back to back).
            to_peer = PLAN["to_peer"]
            pos = 0
            for wr_id, op in ((11, "write"), (12, "send"), (13, "send_imm")):
                spec = to_peer[op]
                n = spec["length"]
                source[pos:pos + n] = pattern(spec["seed"], n)
                if op == "write":
                    qp.post_write(source_mr, pos, n, remote.addr + spec["offset"], remote.rkey, wr_id=wr_id)
                elif op == "send":
                    qp.post_send_buf(source_mr, pos, n, wr_id=wr_id)
                else:
                    qp.post_send_buf(source_mr, pos, n, wr_id=wr_id, imm=spec["imm"])
                pos += (n + 63) & ~63
            sent = _wait(send_cq, wcs, 3)
            assert list(sent["wr_id"]) == [11, 12, 13]
            assert list(sent["opcode"]) == [rd.WC_RDMA_WRITE, rd.WC_SEND, rd.WC_SEND]
            received = chan.recv("received")
            assert received.get("ok") is True, received

            # The peer's WRITE, SEND, SEND_WITH_IMM into ours.
            result = chan.recv("result")
            assert result.get("ok") is True, result
            try:
                got = _wait(recv_cq, wcs, 2)
                assert list(got["wr_id"]) == [1, 2]
                assert list(got["opcode"]) == [rd.WC_RECV, rd.WC_RECV]
                assert list(got["byte_len"]) == [to_test["send"]["length"], to_test["send_imm"]["length"]]
                assert list(got["qp_num"]) == [qp.qp_num] * 2
                assert not got["wc_flags"][0] & rd.WC_WITH_IMM
                assert got["wc_flags"][1] & rd.WC_WITH_IMM
                assert int(got["imm_data"][1]) == to_test["send_imm"]["imm"], hex(int(got["imm_data"][1]))
                expected = np.full(MR_LENGTH, OUR_FILL, np.uint8)
                for op in ("write", "send", "send_imm"):
                    spec = to_test[op]
                    off = spec["offset"] if op == "write" else spec["recv_offset"]
                    expected[off:off + spec["length"]] = pattern(spec["seed"], spec["length"])
                bad = np.flatnonzero(target != expected)
                assert bad.size == 0, (f"{bad.size} bytes differ in our MR, first at offset {bad[0]}: "
                                       f"got {target[bad[0]]}, expected {expected[bad[0]]}")
            except BaseException as exc:
                chan.send("done", ok=False, message=f"pyrdma side: {exc}"[:1000])
                raise
            chan.send("done", ok=True, message="all data verified on the pyrdma side")
            return hello, received, result
        finally:
            chan.close()
    finally:
        pd.close()


@pytest.mark.device
def test_rc_write_and_send_both_ways_with_pyverbs(pyverbs_python):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    with listener, rd.Context() as ctx:
        cmd = [pyverbs_python, "-I", str(PEER), "--connect", f"127.0.0.1:{port}", "--device", ctx.name,
               "--port", "1", "--timeout", str(TIMEOUT)]
        peer = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_peer_env())
        failure = None
        try:
            hello, received, result = _exchange(ctx, listener, peer)
            rc = peer.wait(timeout=TIMEOUT)
        except BaseException as exc:    # noqa: B036 -- re-raised below with the peer's output
            failure = exc
        finally:
            if failure is not None and peer.poll() is None:
                try:            # it usually exits by itself with a message once we fail: let it say why
                    peer.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if peer.poll() is None:
                peer.kill()
            try:
                out, err = peer.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                out, err = "", "(peer output unavailable: it did not exit after kill)"
        if failure is not None:
            if isinstance(failure, (KeyboardInterrupt, SystemExit)):
                raise failure
            raise AssertionError(f"{failure}\n--- pyverbs peer (exit {peer.returncode}) stdout ---\n{out}"
                                 f"--- stderr ---\n{err}") from failure
    assert rc == 0, f"pyverbs peer exited {rc}\nstdout: {out}\nstderr: {err}"
    assert "pyverbs_peer: ok" in out, out
    assert hello["implementation"].startswith("pyverbs"), hello
    assert received["bytes"] == sum(s["length"] for s in PLAN["to_peer"].values())
    assert result["bytes"] == sum(s["length"] for s in PLAN["to_test"].values())
    print(out.strip(), file=sys.stderr)
