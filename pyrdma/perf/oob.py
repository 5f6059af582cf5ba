"""Out-of-band exchange between a pyrdma-perf server and client, over one TCP connection.

Our own format, versioned: pyrdma.wire frames (magic b"PYRDMAPF", version, type, bounded length,
HMAC tag) of these types:

    HELLO, ENDPOINTS, SYNC, REPORT, BYE, ERROR

Each side's first frame is preceded by its GREETING (a nonce; see pyrdma.wire). With a job secret
(``$PYRDMA_JOB_SECRET`` on both sides) every frame is tagged, so the server adopts parameters and
sends its rkeys only to a client that knows the secret.

HELLO and REPORT payloads are JSON objects; ENDPOINTS is a count (u16) followed by that many
``pyrdma.Endpoint.to_bytes()`` records (each carrying the QP address and the MR addr/rkey/length);
SYNC carries a short tag both sides must agree on (a barrier: both send, then both receive);
ERROR carries a message the peer raised with, so one side's failure ends the other side cleanly.

The conversation (see pyrdma.perf.loops.run_test):
    client -> HELLO {test, params}        server -> HELLO {test, accepted params}
    both   -> ENDPOINTS (one per QP)      both connect their QPs, then SYNC "rts"
    per run (mode, size): SYNC "go:<mode>:<size>", run, REPORT exchange
    both   -> BYE
"""
from __future__ import annotations

import json
import socket
import struct
import time

from pyrdma.connect import ANY_ADDRESS, Listener, dial_one
from pyrdma.endpoint import WIRE_SIZE as ENDPOINT_SIZE, Endpoint
from pyrdma.errors import PeerError, UsageError, WireFormatError
from pyrdma.wire import GREETING, Doorman, Framing, Session, job_secret, send_all

MAGIC = b"PYRDMAPF"
WIRE_VERSION = 2
HELLO, ENDPOINTS, SYNC, REPORT, BYE, ERROR = range(1, 7)
TYPE_NAMES = {HELLO: "HELLO", ENDPOINTS: "ENDPOINTS", SYNC: "SYNC", REPORT: "REPORT", BYE: "BYE",
              ERROR: "ERROR"}
MAX_QPS = 16384                  # perftest's MAX_QP_NUM
MAX_JSON = 64 << 10              # HELLO and REPORT: a few hundred bytes in practice
MAX_PAYLOAD = 2 + MAX_QPS * ENDPOINT_SIZE
FRAMING = Framing("pyrdma-perf", MAGIC, WIRE_VERSION, TYPE_NAMES,
                  limits={HELLO: MAX_JSON, ENDPOINTS: MAX_PAYLOAD, SYNC: 256, REPORT: MAX_JSON, BYE: 0,
                          ERROR: 4096},
                  hint="; is the other side perftest? use --perftest-compat to talk to perftest")
HEADER_SIZE = FRAMING.header.size
DEFAULT_PORT = 18515


def encode_frame(msg_type, payload=b""):
    """An untagged frame (what a Channel without a secret sends after its greeting)."""
    try:
        return FRAMING.pack(msg_type, payload)
    except UsageError as exc:
        raise ValueError(str(exc)) from None


def decode_header(data):
    """(type, length) from a frame header; WireFormatError for anything that is not ours."""
    kind, _, length = FRAMING.parse_header(data, "peer")
    if kind == GREETING:
        raise WireFormatError("unexpected pyrdma-perf greeting")
    return kind, length


def encode_endpoints(endpoints):
    return struct.pack("!H", len(endpoints)) + b"".join(ep.to_bytes() for ep in endpoints)


def decode_endpoints(payload):
    if len(payload) < 2:
        raise WireFormatError("ENDPOINTS payload too short")
    (count,) = struct.unpack_from("!H", payload)
    if len(payload) != 2 + count * ENDPOINT_SIZE:
        raise WireFormatError(f"ENDPOINTS payload is {len(payload)} bytes, expected {2 + count * ENDPOINT_SIZE} "
                              f"for {count} endpoints")
    return [Endpoint.from_bytes(payload[2 + i * ENDPOINT_SIZE:2 + (i + 1) * ENDPOINT_SIZE]) for i in range(count)]


def decode_json(payload, what="message"):
    """A JSON object from a peer's payload; WireFormatError for anything else (deep nesting too)."""
    try:
        obj = json.loads(bytes(payload).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireFormatError(f"bad JSON in {what}: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise WireFormatError(f"{what} is not a JSON object")
    return obj


class PeerFailed(PeerError):
    """The peer reported an error (an ERROR frame) and gave up."""


class Channel:
    """A framed, versioned, (with a secret) authenticated message channel over a connected TCP socket.

    ``role``: b"L" on the listening end, b"D" on the dialing end. ``secret`` defaults to
    ``$PYRDMA_JOB_SECRET``."""

    def __init__(self, sock, peer, timeout=60.0, role=b"D", secret=None, session=None):
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        sock.settimeout(timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        if session is not None:       # admitted by a Doorman: greetings done
            self.session, self._heard = session, True
            return
        self.session = Session(FRAMING, role, job_secret(secret))
        self._heard = False
        # both ends greet at once (a few bytes: never blocks); the peer's greeting is read before
        # our first tagged frame, which needs its nonce
        send_all(sock, self.session.greeting(), peer, self._deadline())

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _deadline(self):
        return time.monotonic() + self.timeout

    def _hear(self):
        if not self._heard:
            kind, _, body, _, _ = FRAMING.recv(self.sock, self.peer, self._deadline())
            if kind == ERROR:
                raise PeerFailed(f"peer {self.peer} failed: {body.decode(errors='replace')}", peer=self.peer)
            self.session.take_greeting(kind, body, self.peer)
            self._heard = True

    def send(self, msg_type, payload=b""):
        if msg_type == ERROR:    # a refusal goes untagged: the peer may not be a member, or silent
            frame = FRAMING.pack(ERROR, payload)
        else:
            self._hear()
            frame = self.session.pack(msg_type, payload)
        send_all(self.sock, frame, self.peer, self._deadline())

    def recv(self, expected=None):
        """Receive one frame; returns (type, payload). With ``expected``, anything else is an error."""
        self._hear()
        kind, _, payload, tag, head = FRAMING.recv(self.sock, self.peer, self._deadline())
        if kind == ERROR:
            raise PeerFailed(f"peer {self.peer} failed: {payload.decode(errors='replace')}", peer=self.peer)
        if kind == GREETING:
            raise WireFormatError(f"{self.peer} sent a second greeting")
        self.session.verify(head, payload, tag, self.peer)
        if expected is not None and kind != expected:
            raise WireFormatError(f"expected {TYPE_NAMES[expected]} from {self.peer}, got {TYPE_NAMES[kind]}")
        return kind, payload

    def send_json(self, msg_type, obj):
        self.send(msg_type, json.dumps(obj, sort_keys=True).encode())

    def recv_json(self, expected):
        _, payload = self.recv(expected)
        return decode_json(payload, f"{TYPE_NAMES[expected]} from {self.peer}")

    def exchange_json(self, msg_type, obj):
        self.send_json(msg_type, obj)
        return self.recv_json(msg_type)

    def exchange_endpoints(self, endpoints):
        self.send(ENDPOINTS, encode_endpoints(endpoints))
        _, payload = self.recv(ENDPOINTS)
        return decode_endpoints(payload)

    def sync(self, tag):
        """Barrier: returns once both sides reached sync(tag) with the same tag."""
        self.send(SYNC, tag.encode())
        _, payload = self.recv(SYNC)
        if payload.decode(errors="replace") != tag:
            raise WireFormatError(f"out of step with {self.peer}: we are at {tag!r}, "
                                  f"peer at {payload.decode(errors='replace')!r}")

    def fail(self, message):
        """Tell the peer we are giving up (best effort)."""
        try:
            self.send(ERROR, str(message).encode()[:4096])
        except Exception:
            pass

    def bye(self):
        self.send(BYE)
        try:
            self.recv(BYE)
        except PeerError:
            pass   # the peer may close right after its own BYE


def _admitted_hello(body, conn, admit):
    hello = decode_json(body, f"HELLO from {conn.who}")
    if admit is not None:
        admit(hello)
    return hello


def listen(port=DEFAULT_PORT, host=ANY_ADDRESS, timeout=60.0, secret=None, admit=None):
    """Server side: the first client on host:port whose HELLO passes ``admit(hello)`` (perftest's
    server also serves exactly one): (Channel, its HELLO object). Clients are admitted
    concurrently; a foreign, silent or unauthenticated one, or one whose HELLO is malformed or that
    ``admit`` refuses (a UsageError, said back to it), is dropped and the server waits on."""
    secret = job_secret(secret)
    deadline = time.monotonic() + timeout
    with Listener(host, port) as listener:
        door = Doorman(listener.sock, FRAMING, secret, ERROR)
        try:
            conn, hello = door.first(deadline, HELLO, lambda body, conn: _admitted_hello(body, conn, admit),
                                     f"client connected to {host}:{port} within {timeout:g} s")
            door.release(conn, timeout)
            return Channel(conn.sock, conn.who, timeout, session=conn.session), hello
        finally:
            door.close()


def dial(host, port=DEFAULT_PORT, timeout=60.0, secret=None):
    """Client side: connect to the server, retrying until ``timeout`` (it may not be listening yet)."""
    sock, _ = dial_one(host, port, timeout)
    return Channel(sock, f"{host}:{port}", timeout, role=b"D", secret=secret)
