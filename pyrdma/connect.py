"""Bring up an RC QP pair between two processes or hosts in two calls: accept() and connect().

The peers swap Endpoint records (versioned, validated: see pyrdma.endpoint) over one TCP
connection, move their QPs to RTS, then confirm with a one-byte handshake so neither side
posts before the other is ready.
"""
import socket
import time

from pyrdma.endpoint import WIRE_SIZE, Endpoint
from pyrdma.errors import PeerError, RDMATimeoutError, WireFormatError

DEFAULT_PORT = 18515
_READY = b"R"


class Connection:
    """An RC QP in RTS connected to a peer; ``remote`` is the peer's Endpoint (with its MR, if any)."""

    def __init__(self, qp, remote, local):
        self.qp = qp
        self.remote = remote
        self.local = local

    def close(self):
        self.qp.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def recv_exact(sock, n, peer, during="the endpoint exchange"):
    """Exactly ``n`` bytes from ``sock``: RDMATimeoutError when its timeout passes with nothing
    received, PeerError when the peer closes or the connection fails."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise RDMATimeoutError(f"peer {peer} sent nothing for {sock.gettimeout()} s during {during}",
                                   call="recv") from None
        except OSError as exc:
            raise PeerError(f"connection to {peer} failed during {during}: {exc}", peer=peer) from None
        if not chunk:
            raise PeerError(f"peer {peer} closed the connection during {during}", peer=peer)
        buf += chunk
    return bytes(buf)


def exchange_endpoints(sock, local, peer="peer"):
    """Send our Endpoint and receive the peer's over ``sock``; validates the peer's record."""
    sock.sendall(local.to_bytes())
    return Endpoint.from_bytes(recv_exact(sock, WIRE_SIZE, peer))


def _bring_up(sock, pd, cq, mr, peer, qp_kwargs):
    from pyrdma._verbs.qp import QueuePair, QPT_RC
    qp = QueuePair(pd, QPT_RC, cq, **qp_kwargs)
    try:
        local = qp.endpoint(mr=mr)
        remote = exchange_endpoints(sock, local, peer)
        qp.connect(remote)
        sock.sendall(_READY)
        if recv_exact(sock, 1, peer) != _READY:
            raise WireFormatError(f"peer {peer} sent a bad ready byte")
    except BaseException:
        qp.close()
        raise
    return Connection(qp, remote, local)


def accept_one(host, port, timeout, who="peer"):
    """Listen on host:port for exactly one TCP connection; (socket, "addr:port") or
    RDMATimeoutError after ``timeout`` seconds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1)
        listener.settimeout(timeout)
        try:
            sock, addr = listener.accept()
        except socket.timeout:
            raise RDMATimeoutError(f"no {who} connected to {host}:{port} within {timeout} s",
                                   call="accept") from None
    return sock, f"{addr[0]}:{addr[1]}"


def accept(pd, cq, port=DEFAULT_PORT, host="0.0.0.0", mr=None, timeout=30.0, **qp_kwargs):
    """Wait (up to ``timeout`` s) for one connect() on ``host:port``; returns a Connection."""
    sock, where = accept_one(host, port, timeout)
    with sock:
        sock.settimeout(timeout)
        return _bring_up(sock, pd, cq, mr, where, qp_kwargs)


def dial_one(host, port, timeout):
    """Connect to host:port, retrying until ``timeout`` (the peer may not be listening yet);
    (socket, deadline) or RDMATimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            return sock, deadline
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RDMATimeoutError(f"could not reach {host}:{port} within {timeout} s: {exc}",
                                       call="connect") from None
            time.sleep(0.05)


def connect(pd, cq, host, port=DEFAULT_PORT, mr=None, timeout=30.0, **qp_kwargs):
    """Connect to a peer's accept() at ``host:port``, retrying until ``timeout``; returns a Connection."""
    sock, deadline = dial_one(host, port, timeout)
    with sock:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        return _bring_up(sock, pd, cq, mr, f"{host}:{port}", qp_kwargs)
