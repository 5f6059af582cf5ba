"""The one framing helper for pyrdma's out-of-band wire formats (rendezvous, accept/connect, perf).

A frame is::

    magic    8s   names the format (b"PYRDMARV", b"PYRDMACN", b"PYRDMAPF")
    version  B    a peer speaking another version is refused with WireFormatError
    kind     B    one of the format's kinds (GREETING, 0, is the session opener of every format)
    reserved 2x
    fields        the format's own fixed header fields (network order)
    length   I    body bytes; never above the format's bound for that kind
    body
    tag      32s  HMAC-SHA256 of the frame (zeros when the job has no secret)

Reads never trust a length beyond the bound: a frame is refused from its header before its body is
read, and every read has a deadline. Every parse error is a WireFormatError (a peer that closes is
a PeerError, one that stalls an RDMATimeoutError), so a listener can drop a stranger and go on.

Sessions. Both ends open with a GREETING (flags, a fresh 16-byte nonce). With a job secret
(``PYRDMA_JOB_SECRET``, or given explicitly) every later frame carries an HMAC-SHA256 tag keyed by
the secret over: the format's magic, the sender's role, both nonces (the receiver's first), a
per-direction sequence number, the header and the body. A frame recorded from another connection
(a replay), sent back to its sender (a reflection) or out of order does not verify, and a peer
without the secret cannot produce one. Tags are compared with hmac.compare_digest.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets as _secrets
import selectors
import socket
import struct
import time

from pyrdma.errors import PeerError, RDMATimeoutError, UsageError, WireFormatError

SECRET_ENV = "PYRDMA_JOB_SECRET"
GREETING = 0
NONCE_SIZE = 16
TAG_SIZE = 32
_GREETING_BODY = struct.Struct("!B16s")       # flags, nonce
FLAG_SECRET = 1
# A peer gets this long to send its whole greeting and first message (slowloris bound); a
# legitimate peer sends them at once after connecting.
HANDSHAKE_TIMEOUT = 10.0

log = logging.getLogger("pyrdma.wire")


def job_secret(secret=None, environ=None):
    """The job's secret as bytes (explicit ``secret`` first, else ``$PYRDMA_JOB_SECRET``), or None."""
    if secret is None:
        secret = (os.environ if environ is None else environ).get(SECRET_ENV) or None
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise UsageError(f"a job secret must be a non-empty str or bytes, got {type(secret).__name__}")
    return bytes(secret)


class Framing:
    """One wire format: its name (for messages), magic, version, kinds (name by number), extra header fields and the
    most body bytes each kind may carry (``limits``: kind -> bytes, or one number for all)."""

    def __init__(self, name, magic, version, kinds, fields="", limits=1 << 20, hint=""):
        if len(magic) != 8:
            raise ValueError("a magic is 8 bytes")
        self.name, self.magic, self.version = name, magic, version
        self.kinds = dict(kinds)
        self.kinds[GREETING] = "GREETING"
        self.hint = hint
        self.header = struct.Struct("!8sBBxx" + fields + "I")
        self.nfields = len(struct.Struct("!" + fields).unpack(bytes(struct.calcsize("!" + fields))))
        self._limits = limits

    def limit(self, kind):
        if kind == GREETING:
            return _GREETING_BODY.size
        return self._limits.get(kind, 0) if isinstance(self._limits, dict) else self._limits

    def pack(self, kind, body=b"", fields=(), tag=bytes(TAG_SIZE)):
        body = bytes(body)
        if kind not in self.kinds:
            raise UsageError(f"{self.name}: unknown frame kind {kind}")
        if len(body) > self.limit(kind):
            raise UsageError(f"{self.name}: a {self.kinds[kind]} of {len(body)} bytes exceeds its bound "
                             f"{self.limit(kind)}")
        return self.header.pack(self.magic, self.version, kind, *fields, len(body)) + body + tag

    def parse_header(self, data, who="peer"):
        """(kind, fields, body length) of a header; WireFormatError for anything not ours."""
        data = bytes(data)
        if len(data) != self.header.size:
            raise WireFormatError(f"{who}: short {self.name} header ({len(data)} of {self.header.size} bytes)")
        magic, version, kind, *rest = self.header.unpack(data)
        fields, length = tuple(rest[:-1]), rest[-1]
        if magic != self.magic:
            raise WireFormatError(f"{who} is not a {self.name} peer (it sent {data[:8]!r}){self.hint}")
        if version != self.version:
            raise WireFormatError(f"{who} speaks {self.name} version {version}, this pyrdma speaks "
                                  f"{self.version}")
        if kind not in self.kinds:
            raise WireFormatError(f"{who} sent an unknown {self.name} frame kind {kind}")
        if length > self.limit(kind):
            raise WireFormatError(f"{who} sent a {self.kinds[kind]} frame claiming {length} bytes "
                                  f"(at most {self.limit(kind)})")
        return kind, fields, length

    def frame_size(self, length):
        return self.header.size + length + TAG_SIZE

    def split(self, data, who="peer"):
        """(kind, fields, body, tag, header bytes, bytes used) of the first whole frame in ``data``,
        or None while it is incomplete (for non-blocking readers)."""
        if len(data) < self.header.size:
            return None
        head = bytes(data[:self.header.size])
        kind, fields, length = self.parse_header(head, who)
        end = self.frame_size(length)
        if len(data) < end:
            return None
        body = bytes(data[self.header.size:self.header.size + length])
        return kind, fields, body, bytes(data[end - TAG_SIZE:end]), head, end

    def recv(self, sock, who, deadline, limit=None):
        """One frame from a blocking socket by ``deadline`` (time.monotonic()):
        (kind, fields, body, tag, header bytes). ``limit`` lowers the body bound."""
        head = recv_exact(sock, self.header.size, who, deadline=deadline)
        kind, fields, length = self.parse_header(head, who)
        if limit is not None and length > limit:
            raise WireFormatError(f"{who} sent a {self.kinds[kind]} frame claiming {length} bytes "
                                  f"(at most {limit} here)")
        rest = recv_exact(sock, length + TAG_SIZE, who, deadline=deadline)
        return kind, fields, rest[:length], rest[length:], head


def recv_exact(sock, n, peer, during="the out-of-band exchange", deadline=None):
    """Exactly ``n`` bytes from ``sock`` (read as they arrive; nothing allocated ahead): by
    ``deadline`` (time.monotonic()) if given, else within the socket's timeout between chunks.
    RDMATimeoutError when time runs out, PeerError when the peer closes or the connection fails."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RDMATimeoutError(f"{peer} did not send {n} bytes in time during {during}", call="recv")
            sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except socket.timeout:
            raise RDMATimeoutError(f"{peer} sent nothing for {sock.gettimeout()} s during {during}",
                                   call="recv") from None
        except OSError as exc:
            raise PeerError(f"connection to {peer} failed during {during}: {exc}", peer=peer) from None
        if not chunk:
            raise PeerError(f"{peer} closed the connection during {during}", peer=peer)
        buf += chunk
    return bytes(buf)


def send_all(sock, data, peer, deadline=None):
    if deadline is not None:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        sock.sendall(data)
    except socket.timeout:
        raise RDMATimeoutError(f"{peer} did not take our data in time", call="send") from None
    except OSError as exc:
        raise PeerError(f"cannot send to {peer}: {exc}", peer=peer) from None


class Session:
    """The tagging state of one connection: our role and nonce, the peer's nonce, both sequence
    numbers. ``role`` is b"L" for the listening end, b"D" for the dialing end."""

    def __init__(self, framing, role, secret=None):
        self.framing, self.role = framing, role
        self.peer_role = b"D" if role == b"L" else b"L"
        self.secret = secret
        self.nonce = _secrets.token_bytes(NONCE_SIZE)
        self.peer_nonce = None
        self.sent = self.received = 0

    def greeting(self):
        body = _GREETING_BODY.pack(FLAG_SECRET if self.secret else 0, self.nonce)
        return self.framing.pack(GREETING, body, fields=(0,) * self.framing.nfields)

    def take_greeting(self, kind, body, who):
        """Accept the peer's GREETING; WireFormatError when the two ends disagree about a secret."""
        if kind != GREETING or len(body) != _GREETING_BODY.size:
            raise WireFormatError(f"{who} did not open with a {self.framing.name} greeting")
        flags, self.peer_nonce = _GREETING_BODY.unpack(body)
        theirs = bool(flags & FLAG_SECRET)
        if theirs != bool(self.secret):
            mine = "has" if self.secret else "has no"
            raise WireFormatError(f"{who} {'uses' if theirs else 'does not use'} a job secret and this process "
                                  f"{mine} {SECRET_ENV}: set the same secret on every member")

    def _tag(self, sender, first_nonce, second_nonce, seq, head, body):
        if not self.secret:
            return bytes(TAG_SIZE)
        mac = hmac.new(self.secret, digestmod=hashlib.sha256)
        for part in (self.framing.magic, sender, first_nonce, second_nonce, struct.pack("!Q", seq), head, body):
            mac.update(part)
        return mac.digest()

    def pack(self, kind, body=b"", fields=()):
        if self.peer_nonce is None:
            raise UsageError(f"{self.framing.name}: a tagged frame before the greetings")
        frame = self.framing.pack(kind, body, fields)
        head = frame[:self.framing.header.size]
        tag = self._tag(self.role, self.peer_nonce, self.nonce, self.sent, head, bytes(body))
        self.sent += 1
        return frame[:-TAG_SIZE] + tag

    def verify(self, head, body, tag, who):
        """Check the tag of a received frame (in order); WireFormatError when it does not verify."""
        if self.peer_nonce is None:
            raise WireFormatError(f"{who} sent a frame before its greeting")
        want = self._tag(self.peer_role, self.nonce, self.peer_nonce, self.received, head, body)
        self.received += 1
        if self.secret and not hmac.compare_digest(want, bytes(tag)):
            raise WireFormatError(f"{who} failed authentication (wrong {SECRET_ENV}, or not a member of this job)")

    # blocking helpers for the simple (one connection, in order) users
    def open(self, sock, who, deadline, error_kind=None):
        """Send our greeting, read the peer's (a refusal of ``error_kind`` raises PeerError)."""
        send_all(sock, self.greeting(), who, deadline)
        kind, _, body, _, _ = self.framing.recv(sock, who, deadline)
        if error_kind is not None and kind == error_kind:
            raise PeerError(f"{who}: {body.decode(errors='replace')}", peer=who)
        self.take_greeting(kind, body, who)

    def send(self, sock, who, kind, body=b"", fields=(), deadline=None):
        send_all(sock, self.pack(kind, body, fields), who, deadline)

    def recv(self, sock, who, deadline, limit=None, error_kind=None):
        """(kind, fields, body) of the next frame, its tag verified. A frame of ``error_kind`` (the
        format's untagged refusal) raises PeerError with its text."""
        kind, fields, body, tag, head = self.framing.recv(sock, who, deadline, limit)
        if kind == GREETING:
            raise WireFormatError(f"{who} sent a second greeting")
        if error_kind is not None and kind == error_kind:
            raise PeerError(f"{who}: {body.decode(errors='replace')}", peer=who)
        self.verify(head, body, tag, who)
        return kind, fields, body


def bind_address(host):
    """(family, address) a listener for ``host`` binds: the address ``host`` names, so a loopback
    name stays on loopback; "" / "0.0.0.0" / "::" mean every interface (IPv4 / IPv6)."""
    if host in ("", "0.0.0.0", None):
        return socket.AF_INET, "0.0.0.0"
    if host == "::":
        return socket.AF_INET6, "::"
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise UsageError(f"cannot resolve {host!r} to an address to listen on: {exc}") from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)   # IPv4 first, as the dialers try
    family, address = infos[0][0], infos[0][4][0]
    if _is_own_hostname(host) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos):
        # Debian's /etc/hosts maps the machine's own name to 127.0.1.1, while other hosts resolve
        # that name to its real address: a MASTER_ADDR naming this host must be reachable from them.
        log.warning("pyrdma: %r is this host's name but resolves here to loopback %s; listening on "
                    "every interface so that other hosts can reach it (give an address to restrict)",
                    host, address)
        return family, "0.0.0.0" if family == socket.AF_INET else "::"
    return family, address


def _is_own_hostname(host):
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        pass
    return host.lower() in {socket.gethostname().lower(), socket.getfqdn().lower()} and host != "localhost"


def listen(host, port, backlog=128):
    """A listening socket bound to the address ``host`` names (see bind_address)."""
    family, address = bind_address(host)
    try:
        return socket.create_server((address, port), family=family, backlog=backlog)
    except OSError as exc:
        raise UsageError(f"cannot listen on {address}:{port}: {exc}") from None


def drop(sock, who, why):
    """Close a stranger's connection and say so (the job goes on)."""
    log.warning("pyrdma: dropped connection from %s: %s", who, why)
    try:
        sock.close()
    except OSError:
        pass


class Admitted:
    """A connection the Doorman is admitting: its socket, "addr:port", Session, and by when it must
    have sent its greeting and first frame."""

    def __init__(self, sock, who, session, deadline):
        self.sock, self.who, self.session, self.deadline = sock, who, session, deadline
        self.buf = bytearray()
        self.greeted = False


class Doorman:
    """Admits members on a listening socket, many connections at once (one thread, a selector):
    greets each, reads its greeting and first frame (tag verified, length bounded by the format or
    ``limit``) within ``handshake`` s of connecting, and hands that frame to the caller. Anything
    else (a stray connect-and-close, a silent or trickling connection, foreign bytes, a wrong
    secret) is dropped, logged and noted in ``refused``; the caller goes on. With more than
    ``max_pending`` connections still greeting, the oldest is dropped, so a flood cannot keep a
    member out. ``error_kind`` is the format's untagged refusal frame."""

    def __init__(self, listener, framing, secret, error_kind, limit=None, handshake=HANDSHAKE_TIMEOUT,
                 max_pending=64, fields=()):
        self.listener, self.framing, self.secret = listener, framing, secret
        self.error_kind, self.limit, self.handshake, self.max_pending = error_kind, limit, handshake, max_pending
        self.fields = tuple(fields) or (0,) * framing.nfields
        self.refused = []
        self.pending = {}            # socket -> Admitted
        self.watched = {}            # socket -> Admitted the caller holds
        listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)

    def refuse(self, conn, why, tell=True):
        """Drop ``conn`` (telling it why, best effort) and note it."""
        self._forget(conn)
        self.refused.append(why if why.startswith(conn.who) else f"{conn.who}: {why}")
        del self.refused[:-8]
        if tell:
            try:
                conn.sock.setblocking(False)
                conn.sock.send(self.framing.pack(self.error_kind, f"refused: {why}".encode()[:4096], self.fields))
            except (OSError, UsageError):
                pass
        drop(conn.sock, conn.who, why)

    def _forget(self, conn):
        if self.pending.pop(conn.sock, None) is not None or self.watched.pop(conn.sock, None) is not None:
            self.sel.unregister(conn.sock)

    def watch(self, conn):
        """Keep an eye on an admitted connection the caller holds: next() reports it "gone" if it
        closes or speaks out of turn (a member sends nothing while it waits)."""
        self.watched[conn.sock] = conn
        self.sel.register(conn.sock, selectors.EVENT_READ, conn)

    def release(self, conn, timeout):
        """Hand ``conn`` over to the caller for blocking use (no longer watched)."""
        self._forget(conn)
        conn.sock.setblocking(True)
        conn.sock.settimeout(timeout)
        return conn

    def next(self, deadline):
        """("frame", conn, kind, fields, body) for the next connection's verified first frame,
        ("gone", conn) for a watched one that closed, or None at ``deadline``."""
        while True:
            now = time.monotonic()
            for conn in [c for c in self.pending.values() if c.deadline <= now]:
                self.refuse(conn, f"did not greet and speak within {self.handshake:g} s of connecting")
            if now >= deadline:
                return None
            wake = min([deadline] + [c.deadline for c in self.pending.values()])
            for key, _ in self.sel.select(max(0.0, wake - now)):
                if key.fileobj is self.listener:
                    self._accept()
                    continue
                conn = key.data
                if conn.sock in self.watched:
                    self._forget(conn)
                    return "gone", conn
                if conn.sock not in self.pending:   # refused earlier in this round of events
                    continue
                got = self._read(conn)
                if got is not None:
                    return ("frame", conn) + got

    def first(self, deadline, kind, parse, waiting_for):
        """The first connection whose opening frame is ``kind`` and whose body ``parse(body, conn)`` accepts,
        by ``deadline``: (Admitted, what parse returned). Any other is refused (a WireFormatError or
        UsageError from parse is said back to it) and the wait goes on; RDMATimeoutError naming
        ``waiting_for`` and the refusals when time runs out."""
        while True:
            event = self.next(deadline)
            if event is None:
                also = f" (refused: {'; '.join(self.refused)})" if self.refused else ""
                raise RDMATimeoutError(f"no {waiting_for}{also}", call="accept")
            _, conn, got, _, body = event
            try:
                if got != kind:
                    raise WireFormatError(f"sent {self.framing.kinds[got]} where {self.framing.kinds[kind]} belongs")
                value = parse(body, conn)
            except (WireFormatError, UsageError) as exc:
                self.refuse(conn, str(exc))
                continue
            return conn, value

    def _read(self, conn):
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            self.refuse(conn, f"connection failed: {exc}", tell=False)
            return None
        if not data:
            self.refuse(conn, "closed before joining", tell=False)
            return None
        conn.buf += data
        try:
            while True:
                got = self.framing.split(conn.buf, conn.who)
                if got is None:
                    return None
                kind, fields, body, tag, head, used = got
                del conn.buf[:used]
                if not conn.greeted:
                    conn.session.take_greeting(kind, body, conn.who)
                    conn.greeted = True
                    continue
                if kind == GREETING:
                    raise WireFormatError(f"{conn.who} sent a second greeting")
                if self.limit is not None and len(body) > self.limit:
                    raise WireFormatError(f"{conn.who} sent a {len(body)}-byte {self.framing.kinds[kind]} "
                                          f"(at most {self.limit})")
                conn.session.verify(head, body, tag, conn.who)
                if conn.buf:
                    raise WireFormatError(f"{conn.who} sent more than its first message")
                self._forget(conn)
                return kind, fields, body
        except WireFormatError as exc:
            self.refuse(conn, str(exc))
            return None

    def _accept(self):
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:    # e.g. out of descriptors: the admitted ones go on
                log.warning("pyrdma: accept failed: %s", exc)
                return
            who = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if len(self.pending) >= self.max_pending:
                self.refuse(min(self.pending.values(), key=lambda c: c.deadline),
                            "too many connections greeting at once")
            conn = Admitted(sock, who, Session(self.framing, b"L", self.secret),
                            time.monotonic() + self.handshake)
            sock.setblocking(False)
            try:
                sock.send(conn.session.greeting())   # a few bytes into an empty socket buffer
            except OSError as exc:
                drop(sock, who, f"cannot greet: {exc}")
                continue
            self.pending[sock] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def close(self):
        """Drop the connections still greeting or watched (not the listener)."""
        for conn in list(self.pending.values()) + list(self.watched.values()):
            self._forget(conn)
            conn.sock.close()
        self.sel.close()
