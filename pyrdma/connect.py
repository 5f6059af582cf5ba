"""Bring up an RC QP pair between two processes or hosts in two calls: accept() and connect().

The peers greet each other, swap Endpoint records (versioned, validated: see pyrdma.endpoint) in
pyrdma.wire frames over one TCP connection, move their QPs to RTS, then confirm with a READY frame
so neither side posts before the other is ready. With a job secret (``secret=``, default
``$PYRDMA_JOB_SECRET``) every frame carries an HMAC tag over both sides' nonces, and the accepting
side sends its endpoint (with the rkey of its memory) only to a dialer that proved the secret.
"""
import socket
import time

from pyrdma.endpoint import WIRE_SIZE, Endpoint
from pyrdma.errors import PeerError, RDMATimeoutError, UsageError, WireFormatError
from pyrdma.wire import Doorman, Framing, Session, drop, job_secret, listen, log, recv_exact

__all__ = ["Connection", "Listener", "accept", "connect", "recv_exact", "dial_one"]

DEFAULT_PORT = 18515
# The address accept() and the perf server listen on when given none: every interface, as rping
# and perftest's server do. Give the address of the RDMA interface (or 127.0.0.1) to stay on it.
ANY_ADDRESS = "0.0.0.0"
ENDPOINT, READY, ERROR = 1, 2, 3
FRAMING = Framing("pyrdma connect", b"PYRDMACN", 1, {ENDPOINT: "ENDPOINT", READY: "READY", ERROR: "ERROR"},
                  limits={ENDPOINT: WIRE_SIZE, READY: 0, ERROR: 4096})


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


class Listener:
    """A TCP listener bound to the address ``host`` names (ANY_ADDRESS: every interface)."""

    def __init__(self, host, port, backlog=16):
        self.host, self.sock = host, listen(host, port, backlog)
        self.port = self.sock.getsockname()[1]

    def accept(self, deadline, who="peer"):
        """The next TCP connection by ``deadline`` (time.monotonic()): (socket, "addr:port"), or
        RDMATimeoutError."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RDMATimeoutError(f"no {who} connected to {self.host}:{self.port} in time", call="accept")
            self.sock.settimeout(remaining)
            try:
                sock, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError as exc:      # e.g. out of descriptors: try again until the deadline
                log.warning("pyrdma: accept on %s:%s failed: %s", self.host, self.port, exc)
                time.sleep(0.05)
                continue
            return sock, f"{addr[0]}:{addr[1]}"

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def accept_one(host, port, timeout, who="peer"):
    """Listen on host:port for exactly one TCP connection; (socket, "addr:port") or
    RDMATimeoutError after ``timeout`` seconds."""
    with Listener(host, port) as listener:
        return listener.accept(time.monotonic() + timeout, who)


def _recv(session, sock, who, deadline, want):
    """The next frame of kind ``want`` (its body), tag verified; PeerError for the peer's ERROR."""
    kind, _, body = session.recv(sock, who, deadline, error_kind=ERROR)
    if kind != want:
        raise WireFormatError(f"{who} sent {FRAMING.kinds[kind]} where {FRAMING.kinds[want]} belongs")
    return body


def accept(pd, cq, port=DEFAULT_PORT, host=ANY_ADDRESS, mr=None, timeout=30.0, secret=None, **qp_kwargs):
    """Wait (up to ``timeout`` s) for one connect() on ``host:port``; returns a Connection.

    Listens on the address ``host`` names only (default ANY_ADDRESS, every interface, as rping;
    "127.0.0.1" keeps it on loopback). Connections are admitted concurrently; one that is foreign,
    malformed, silent for ``wire.HANDSHAKE_TIMEOUT`` s or fails authentication is dropped (logged)
    and accept() goes on waiting; our endpoint is sent only after the dialer's verified. ``secret`` (default
    ``$PYRDMA_JOB_SECRET``): both sides must have the same one."""
    from pyrdma._verbs.qp import QueuePair, QPT_RC
    secret = job_secret(secret)
    deadline = time.monotonic() + timeout
    with Listener(host, port) as listener:
        qp = QueuePair(pd, QPT_RC, cq, **qp_kwargs)
        try:
            local = qp.endpoint(mr=mr)
            sock, who, session, remote = accept_verified(listener, local, secret, deadline)
            with sock:
                return _finish(qp, session, sock, who, remote, local, deadline)
        except BaseException:
            qp.close()
            raise


def accept_verified(listener, local, secret, deadline):
    """The first dialer on ``listener`` that greets, proves the secret and sends a valid endpoint
    by ``deadline``; it is sent ``local`` in return. Strangers are dropped (logged) while others
    go on (pyrdma.wire.Doorman). Returns (socket, "addr:port", Session, the dialer's Endpoint)."""
    door = Doorman(listener.sock, FRAMING, secret, ERROR)
    try:
        while True:
            conn, remote = door.first(deadline, ENDPOINT, lambda body, conn: Endpoint.from_bytes(body),
                                      f"peer connected to {listener.host}:{listener.port} in time")
            door.release(conn, max(0.1, deadline - time.monotonic()))
            try:
                conn.session.send(conn.sock, conn.who, ENDPOINT, local.to_bytes(), deadline=deadline)
            except (PeerError, RDMATimeoutError) as exc:   # it left after proving itself: wait on
                drop(conn.sock, conn.who, str(exc))
                continue
            except BaseException:
                conn.sock.close()
                raise
            return conn.sock, conn.who, conn.session, remote
    finally:
        door.close()


def _finish(qp, session, sock, who, remote, local, deadline):
    qp.connect(remote)
    session.send(sock, who, READY, deadline=max(deadline, time.monotonic() + 1.0))
    _recv(session, sock, who, max(deadline, time.monotonic() + 1.0), READY)
    return Connection(qp, remote, local)


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


def dial_exchange(sock, who, local, secret, deadline):
    """The dialing side's greeting and endpoint swap over ``sock``: (Session, the peer's Endpoint)."""
    session = Session(FRAMING, b"D", secret)
    session.open(sock, who, deadline, error_kind=ERROR)
    session.send(sock, who, ENDPOINT, local.to_bytes(), deadline=deadline)
    return session, Endpoint.from_bytes(_recv(session, sock, who, deadline, ENDPOINT))


def connect(pd, cq, host, port=DEFAULT_PORT, mr=None, timeout=30.0, secret=None, **qp_kwargs):
    """Connect to a peer's accept() at ``host:port``, retrying until ``timeout``; returns a Connection.
    ``secret`` (default ``$PYRDMA_JOB_SECRET``) must be the accepting side's."""
    from pyrdma._verbs.qp import QueuePair, QPT_RC
    secret = job_secret(secret)
    if not isinstance(port, int) or not 0 < port < 65536:
        raise UsageError(f"port must be within 1..65535, got {port!r}")
    sock, deadline = dial_one(host, port, timeout)
    who = f"{host}:{port}"
    with sock:
        qp = QueuePair(pd, QPT_RC, cq, **qp_kwargs)
        try:
            local = qp.endpoint(mr=mr)
            session, remote = dial_exchange(sock, who, local, secret, deadline)
            return _finish(qp, session, sock, who, remote, local, deadline)
        except BaseException:
            qp.close()
            raise
