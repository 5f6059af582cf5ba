"""Out-of-band exchange between a pyrdma-perf server and client, over one TCP connection.

Our own format, versioned. Every message is a frame::

    magic   8s   b"PYRDMAPF"
    version B    WIRE_VERSION (a peer speaking another version is refused with WireFormatError)
    type    B    HELLO, ENDPOINTS, SYNC, REPORT, BYE, ERROR
    length  I    payload bytes (network order), at most MAX_PAYLOAD
    payload

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

from pyrdma.connect import accept_one, dial_one, recv_exact
from pyrdma.endpoint import WIRE_SIZE as ENDPOINT_SIZE, Endpoint
from pyrdma.errors import PeerError, WireFormatError

MAGIC = b"PYRDMAPF"
WIRE_VERSION = 1
HELLO, ENDPOINTS, SYNC, REPORT, BYE, ERROR = range(1, 7)
TYPE_NAMES = {HELLO: "HELLO", ENDPOINTS: "ENDPOINTS", SYNC: "SYNC", REPORT: "REPORT", BYE: "BYE",
              ERROR: "ERROR"}
_HEADER = struct.Struct("!8sBBI")
MAX_PAYLOAD = 16 << 20
DEFAULT_PORT = 18515


def encode_frame(msg_type, payload=b""):
    if msg_type not in TYPE_NAMES:
        raise ValueError(f"unknown message type {msg_type}")
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return _HEADER.pack(MAGIC, WIRE_VERSION, msg_type, len(payload)) + bytes(payload)


def decode_header(data):
    """(type, length) from a frame header; WireFormatError for anything that is not ours."""
    if len(data) != _HEADER.size:
        raise WireFormatError(f"short frame header ({len(data)} of {_HEADER.size} bytes)")
    magic, version, msg_type, length = _HEADER.unpack(data)
    if magic != MAGIC:
        raise WireFormatError(f"not a pyrdma-perf peer (got {data[:8]!r}); is the other side perftest? "
                              "use --perftest-compat to talk to perftest")
    if version != WIRE_VERSION:
        raise WireFormatError(f"pyrdma-perf wire version {version} not supported (this side speaks "
                              f"{WIRE_VERSION})")
    if msg_type not in TYPE_NAMES:
        raise WireFormatError(f"unknown pyrdma-perf message type {msg_type}")
    if length > MAX_PAYLOAD:
        raise WireFormatError(f"frame claims {length} payload bytes (max {MAX_PAYLOAD})")
    return msg_type, length


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


class PeerFailed(PeerError):
    """The peer reported an error (an ERROR frame) and gave up."""


class Channel:
    """A framed, versioned message channel over a connected TCP socket."""

    def __init__(self, sock, peer, timeout=60.0):
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        sock.settimeout(timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _recv_exact(self, n):
        return recv_exact(self.sock, n, self.peer, during="the pyrdma-perf exchange")

    def send(self, msg_type, payload=b""):
        try:
            self.sock.sendall(encode_frame(msg_type, payload))
        except OSError as exc:
            raise PeerError(f"cannot send to {self.peer}: {exc}", peer=self.peer) from None

    def recv(self, expected=None):
        """Receive one frame; returns (type, payload). With ``expected``, anything else is an error."""
        msg_type, length = decode_header(self._recv_exact(_HEADER.size))
        payload = self._recv_exact(length) if length else b""
        if msg_type == ERROR and expected != ERROR:
            raise PeerFailed(f"peer {self.peer} failed: {payload.decode(errors='replace')}", peer=self.peer)
        if expected is not None and msg_type != expected:
            raise WireFormatError(f"expected {TYPE_NAMES[expected]} from {self.peer}, got {TYPE_NAMES[msg_type]}")
        return msg_type, payload

    def send_json(self, msg_type, obj):
        self.send(msg_type, json.dumps(obj, sort_keys=True).encode())

    def recv_json(self, expected):
        _, payload = self.recv(expected)
        try:
            obj = json.loads(payload.decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise WireFormatError(f"bad JSON in {TYPE_NAMES[expected]} from {self.peer}: {exc}") from None
        if not isinstance(obj, dict):
            raise WireFormatError(f"{TYPE_NAMES[expected]} from {self.peer} is not a JSON object")
        return obj

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


def listen(port=DEFAULT_PORT, host="0.0.0.0", timeout=60.0):
    """Server side: accept one client on host:port (perftest's server also serves exactly one)."""
    sock, where = accept_one(host, port, timeout, who="client")
    return Channel(sock, where, timeout)


def dial(host, port=DEFAULT_PORT, timeout=60.0):
    """Client side: connect to the server, retrying until ``timeout`` (it may not be listening yet)."""
    sock, _ = dial_one(host, port, timeout)
    return Channel(sock, f"{host}:{port}", timeout)
