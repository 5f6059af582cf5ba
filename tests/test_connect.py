"""RC between two processes with accept()/connect(), and the endpoint wire format."""
import multiprocessing as mp
import socket
import threading
import time

import numpy as np
import pytest

import pyrdma as rd
from pyrdma.endpoint import Endpoint, WIRE_SIZE
from pyrdma.testing import free_port

# A spawned child imports numpy and pyrdma first: slow under software emulation.
STARTUP_TIMEOUT = 180


def test_endpoint_round_trip():
    ep = Endpoint(qpn=17, psn=0xABCDEF, lid=3, gid=bytes(range(16)), port=1, gid_index=1, mtu=5,
                  addr=0x7FFF0000, rkey=0x1234, length=4096)
    data = ep.to_bytes()
    assert len(data) == WIRE_SIZE
    assert Endpoint.from_bytes(data) == ep


@pytest.mark.parametrize("data, match", [
    (b"GET / HTTP/1.1\r\n\r\n" + bytes(40), "not a pyrdma endpoint"),
    (b"PYRDMAEP\x09" + bytes(WIRE_SIZE - 9), "version 9 not supported"),
    (b"PYRDMAEP\x01" + bytes(10), "expected"),
    (b"", "not a pyrdma endpoint"),
])
def test_endpoint_rejects_foreign_messages(data, match):
    with pytest.raises(rd.WireFormatError, match=match):
        Endpoint.from_bytes(data)


def test_endpoint_rejects_bad_fields():
    with pytest.raises(rd.WireFormatError, match="qpn"):
        Endpoint(qpn=1 << 24, psn=0)
    with pytest.raises(rd.WireFormatError, match="GID"):
        Endpoint(qpn=1, psn=0, gid=b"short")


def _server(port, q, host="0.0.0.0", secret=None):
    try:
        with rd.Context() as ctx:
            pd = rd.ProtectionDomain(ctx)
            cq = rd.CompletionQueue(ctx, 64)
            buf = np.zeros(1 << 20, np.uint8)
            mr = rd.MemoryRegion(pd, buf, rd.ACCESS_ALL)
            conn = rd.accept(pd, cq, port=port, host=host, mr=mr, timeout=STARTUP_TIMEOUT, secret=secret)
            conn.qp.post_recv_buf(mr, 0, 16, wr_id=1)
            wcs = np.empty(4, rd.WC_DTYPE)
            n = cq.poll_wait(wcs, 1, timeout=30)   # the client's "done" SEND
            rd.check_wcs(wcs[:n])
            expected = (np.arange(1 << 20) * 7 % 256).astype(np.uint8)
            q.put(("ok", bool(np.array_equal(buf[1 << 19:], expected[1 << 19:])), buf[:16].tobytes()))
            conn.close()
    except Exception as exc:   # report to the parent instead of dying silently
        q.put(("error", repr(exc), b""))


def _reachable(host, port):
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def _strangers(host, port, stop):
    """Connect-and-close, garbage and a wrong-secret dialer at accept() while the member comes."""
    from pyrdma.connect import dial_exchange
    while not stop.is_set():
        try:
            socket.create_connection((host, port), timeout=2).close()
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            with socket.create_connection((host, port), timeout=5) as s:
                dial_exchange(s, "accept", Endpoint(qpn=1, psn=1), b"wrong", time.monotonic() + 5)
        except (OSError, rd.RDMAError):
            pass
        stop.wait(0.2)


@pytest.mark.device
@pytest.mark.parametrize("host, secret", [("0.0.0.0", None), ("127.0.0.2", b"pair-secret")])
def test_rc_between_two_processes(host, secret):
    port = free_port()
    ctxmp = mp.get_context("spawn")
    q = ctxmp.Queue()
    server = ctxmp.Process(target=_server, args=(port, q, host, secret), daemon=True)
    server.start()
    stop = threading.Event()
    if host != "0.0.0.0":    # accept() listens on the address given only (a probe is a stranger to it)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not _reachable(host, port):
            assert time.monotonic() < deadline and server.is_alive(), "accept() never listened"
            time.sleep(0.2)
        assert not _reachable("127.0.0.1", port)
    if secret:   # strangers knock while the member connects; accept() admits only the member
        threading.Thread(target=_strangers, args=(host, port, stop), daemon=True).start()
    try:
        with rd.Context() as ctx:
            pd = rd.ProtectionDomain(ctx)
            cq = rd.CompletionQueue(ctx, 64)
            src = (np.arange(1 << 20) * 7 % 256).astype(np.uint8)
            mr = rd.MemoryRegion(pd, src, rd.ACCESS_ALL)
            dial = "127.0.0.1" if host == "0.0.0.0" else host
            conn = rd.connect(pd, cq, dial, port=port, mr=mr, timeout=STARTUP_TIMEOUT, secret=secret)
            assert conn.remote.length == 1 << 20 and conn.remote.rkey
            half = 1 << 19
            conn.qp.post_write(mr, half, half, conn.remote.addr + half, conn.remote.rkey, wr_id=1)
            conn.qp.post_send_buf(mr, 0, 16, wr_id=2)
            wcs = np.empty(4, rd.WC_DTYPE)
            got = 0
            while got < 2:
                n = cq.poll_wait(wcs, 1, timeout=30)
                rd.check_wcs(wcs[:n])
                got += n
            status, same, head = q.get(timeout=STARTUP_TIMEOUT)
            assert status == "ok", same
            assert same and head == src[:16].tobytes()
            conn.close()
    finally:
        stop.set()
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
            server.join(5)


@pytest.mark.device
def test_connect_rejects_a_foreign_peer():
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))
    with listener, rd.Context() as ctx:
        pd = rd.ProtectionDomain(ctx)
        cq = rd.CompletionQueue(ctx, 4)

        def speak_http():
            sock, _ = listener.accept()
            with sock:
                sock.recv(100)
                sock.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n".ljust(WIRE_SIZE, b" "))
        t = threading.Thread(target=speak_http, daemon=True)
        t.start()
        with pytest.raises(rd.WireFormatError, match="not a pyrdma connect peer"):
            rd.connect(pd, cq, "127.0.0.1", port=port, timeout=10)
        t.join(10)
        pd.close()


@pytest.mark.device
def test_connect_times_out_without_peer():
    with rd.Context() as ctx:
        pd = rd.ProtectionDomain(ctx)
        cq = rd.CompletionQueue(ctx, 4)
        with pytest.raises(rd.RDMATimeoutError, match="could not reach"):
            rd.connect(pd, cq, "127.0.0.1", port=free_port(), timeout=0.5)
