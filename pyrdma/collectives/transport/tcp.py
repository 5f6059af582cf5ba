"""TcpTransport: the transport contract over one TCP connection per pair of ranks."""
import collections
import functools
import hmac
import secrets
import socket
import struct
import threading
import time

import numpy as np

from pyrdma import _reduce
from pyrdma.collectives.schedule import consumer, execute
from pyrdma.collectives.transport.base import (_KIND_ABORT, _KIND_DATA, _REASONS, DEFAULT_TCP_MESSAGE, DESC,
                                               KINDS, NO_CULPRIT, PEER_FAILED, _as_desc, _grow, _OwnBuffer,
                                               _malformed, _Waits, abort_error, check_header, describe,
                                               too_long_error)
from pyrdma.collectives.work import HOST
from pyrdma.errors import PeerError, UsageError, WireFormatError

_HELLO = struct.Struct("!8sBxxxii16s")       # magic, version, rank, world size, the listener's token
_HELLO_MAGIC = b"PYRDMATC"
_HELLO_VERSION = 3                           # 2: data frames carry the collective's description; 3: token
_TOKEN_SIZE = 16
_FRAME = struct.Struct("!BxxxIQ")             # kind, 0 (abort: reason; control: epoch), length or value
_TCP_QUERY, _TCP_REPORT = 3, 4
MAX_TCP_MESSAGE = 1 << 30                     # the bound on max_message, so on any frame a peer may send
HELLO_TIMEOUT = 10.0                          # the longest an accepted connection may take to say hello
_KIND_AT, _SEND_KIND = 38, KINDS.index("send")  # where a description says its kind, and point-to-point's




def read_frame(sock, peer, max_message, size):
    """The next frame from ``peer``'s socket: (kind, a, b, description, payload), None at a clean end.
    Every field is checked against what the protocol can send (a data frame holds at most
    ``max_message`` bytes, ranks are < ``size``) before anything is allocated; anything else raises
    PeerError (``malformed`` set when the bytes were wrong rather than the connection)."""
    try:
        try:
            header = _recv_exact(sock, _FRAME.size, idle_ok=True)
        except EOFError:
            return None
        kind, a, b = _FRAME.unpack(header)
        desc = data = None
        if kind == _KIND_DATA:
            if b > max_message or a:
                raise _malformed(peer, f"a {b}-byte data frame, max_message is {max_message}")
            desc = bytes(_recv_exact(sock, DESC.size))
            data = _recv_exact(sock, b) if b else b""
        elif kind == _KIND_ABORT:
            if a not in _REASONS or not (b < size or b == NO_CULPRIT):
                raise _malformed(peer, f"an abort with reason {a} and culprit {b}")
        elif kind in (_TCP_QUERY, _TCP_REPORT):
            if a > 0xFFF or (b != 0 if kind == _TCP_QUERY else b >= size):
                raise _malformed(peer, f"a control frame of kind {kind} with epoch {a} and value {b}")
        else:
            raise _malformed(peer, f"unknown frame kind {kind}")
        return kind, a, b, desc, data
    except (OSError, EOFError) as exc:
        raise PeerError(f"the connection from rank {peer} broke ({exc or type(exc).__name__})", peer=peer) from None


class TcpTransport(_OwnBuffer, _Waits):
    """The same contract over one TCP connection per pair of ranks.

    ``host``: the address this rank listens on and advertises (default: the address it used to
    reach the rendezvous, from ``exchange.advertise_host``, else 127.0.0.1). Only the thread that
    runs the collective writes to the sockets; reader threads only read."""

    name = "tcp"

    def __init__(self, rank, size, exchange, timeout=60.0, host=None, max_message=DEFAULT_TCP_MESSAGE):
        self.rank, self.size = rank, size
        self._init_waits(timeout)
        self.max_message = int(max_message)
        # a send blocks in sendall(): one ahead keeps the reductions overlapping the transfers
        self.send_window = 1
        if not 1 <= self.max_message <= MAX_TCP_MESSAGE:
            raise UsageError(f"max_message must be within 1..{MAX_TCP_MESSAGE}, got {max_message}")
        self.peers = [p for p in range(size) if p != rank]
        self._desc = self._rdesc = describe(0, "")
        self._closed = False
        self._cond = threading.Condition()
        self.links = {}                      # peer -> _Link, once connected
        self.queries = {}                    # peer -> epoch of its unanswered QUERY (answered by _step)
        self.socks = {}                      # peer -> socket, while connecting
        self._awaited = ()                   # the queue the current wait waits on (_check_peer)
        self._own = self._work = None
        self._kind = HOST
        self.buffer(0)
        host = host or getattr(exchange, "advertise_host", None) or "127.0.0.1"
        try:      # listen only where the peers are told to connect
            listener = socket.create_server((host, 0))
        except OSError:     # an advertised address that is not this machine's (NAT): every interface
            listener = socket.create_server(("0.0.0.0", 0))
        # A random token per listener, given to the members only through the exchange (authenticated
        # when the job has a secret): a connection must present it, so a stranger who reaches the
        # port first cannot take a rank's place.
        self._token = secrets.token_bytes(_TOKEN_SIZE)
        try:
            listener.settimeout(self.timeout)
            records = exchange.allgather(
                f"{self.max_message} {host}:{listener.getsockname()[1]} {self._token.hex()}".encode())
            addresses, tokens = [], []
            for p, rec in enumerate(records):
                fields = rec.decode(errors="replace").split(" ")
                if len(fields) != 3 or len(fields[2]) != 2 * _TOKEN_SIZE:
                    raise WireFormatError(f"rank {p}'s TCP transport record is malformed: {bytes(rec)[:80]!r}")
                message, address, token = fields
                if p != self.rank and message != str(self.max_message):
                    raise UsageError(f"rank {p} uses max_message={message}, rank {self.rank} {self.max_message}: "
                                     f"all ranks must be given the same")
                try:
                    tokens.append(bytes.fromhex(token))
                except ValueError:
                    raise WireFormatError(f"rank {p}'s TCP transport record has a malformed token") from None
                addresses.append(address)
            self._connect_all(listener, addresses, tokens)
        except BaseException:
            for s in self.socks.values():
                s.close()
            raise
        finally:
            listener.close()
        self._readers = []
        self.links = {p: _Link(s) for p, s in self.socks.items()}
        for p, s in self.socks.items():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(self.timeout)
            t = threading.Thread(target=self._reader, args=(p, s), daemon=True, name=f"pyrdma-tcp-{rank}<-{p}")
            t.start()
            self._readers.append(t)

    def _connect_all(self, listener, addresses, tokens):
        end = time.monotonic() + self.timeout
        for p in range(self.rank):   # connect to lower ranks, accept from higher ones
            host, _, port = addresses[p].rpartition(":")
            try:
                s = socket.create_connection((host, int(port)), timeout=max(0.1, end - time.monotonic()))
            except OSError as exc:
                raise PeerError(f"rank {self.rank} cannot connect to rank {p} at {host}:{port}: {exc}",
                                peer=p) from None
            s.sendall(_HELLO.pack(_HELLO_MAGIC, _HELLO_VERSION, self.rank, self.size, tokens[p]))
            self.socks[p] = s
        while len(self.socks) < self.size - 1:
            listener.settimeout(max(0.01, end - time.monotonic()))
            try:
                s, addr = listener.accept()
            except socket.timeout:
                missing = [p for p in range(self.rank + 1, self.size) if p not in self.socks]
                raise PeerError(f"ranks {missing} did not connect to rank {self.rank} within {self.timeout:g} s",
                                peer=missing[0]) from None
            # a silent stranger may hold up the others for HELLO_TIMEOUT at most
            s.settimeout(max(0.01, min(HELLO_TIMEOUT, end - time.monotonic())))
            try:
                magic, version, p, size, token = _HELLO.unpack(_recv_exact(s, _HELLO.size))
            except (OSError, EOFError):
                s.close()
                continue
            if magic != _HELLO_MAGIC or version != _HELLO_VERSION or size != self.size \
                    or not self.rank < p < self.size or p in self.socks \
                    or not hmac.compare_digest(token, self._token):
                s.close()     # a stranger (or a second claim of a rank): dropped, the group goes on
                continue
            self.socks[p] = s

    # ---- the interface ------------------------------------------------------------------------

    def work_area(self, nbytes, lend=None, start=0, kind=HOST):
        """``lend[start:start + nbytes]`` in place (memory of ``kind``, work.HostMemory's protocol),
        else this transport's own buffer (>= nbytes)."""
        if lend is None:
            if self._own is None or self._own.nbytes < nbytes:
                self._own = np.empty(_grow(nbytes), np.uint8)
            self._work, self._kind = self._own, HOST
        else:
            self._work, self._kind = lend[start:start + nbytes], kind
        return self._work

    def set_tag(self, desc, recv_desc=None):
        self._desc = _as_desc(desc)
        self._rdesc = self._desc if recv_desc is None else _as_desc(recv_desc)

    parked_ticket = None     # a send never waits for its receive here (the peer's reader drains it)

    def run(self, schedule, dtype=0, op=0, consume=None, park=False):
        """Execute ``schedule`` on the work area, in Python (schedule.execute). Returns the length
        of the point-to-point message it received (None if none)."""
        if consume is None:
            consume = consumer(self._work, functools.partial(_reduce.reduce_bytes, dtype=dtype, op=op))
        return execute(self, schedule, consume)

    def can_send(self, peer):
        return True   # the peer's reader thread drains its socket, so a send never waits on it

    def send(self, peer, offset, nbytes):
        if nbytes > self.max_message:
            raise UsageError(f"message of {nbytes} bytes exceeds max_message={self.max_message}")
        if self.failure is not None:
            raise self.failure
        header = _FRAME.pack(_KIND_DATA, 0, nbytes) + self._desc
        chunk = self._kind.read(self._work[offset:offset + nbytes])
        if nbytes <= 65536:
            self._send_bytes(peer, header + chunk.tobytes())
        else:
            self._send_bytes(peer, header)
            self._send_bytes(peer, memoryview(chunk))

    def recv(self, peer, nbytes):
        inbox = self.links[peer].inbox
        if not inbox:
            self._awaited = inbox
            self._wait(lambda: len(inbox) > 0, peer, f"a {nbytes}-byte message")
        with self._cond:
            desc, data = inbox.popleft()
        if desc != self._rdesc or len(data) != nbytes:
            check_header(peer, self.rank, desc, len(data), self._rdesc, nbytes)
        return np.frombuffer(data, np.uint8)

    def recv_upto(self, peer, nbytes):
        """(data, the message's whole length) of the next chunk of a point-to-point message from
        ``peer``: at most ``nbytes``; its description's count is the sender's to say."""
        inbox = self.links[peer].unexpected
        if not inbox:
            self._awaited = inbox
            self._wait(lambda: len(inbox) > 0, peer, f"a message of up to {nbytes} bytes")
        with self._cond:
            desc, data = inbox.popleft()
        mine = self._rdesc
        if desc[:8] != mine[:8] or desc[16:] != mine[16:]:
            check_header(peer, self.rank, desc, len(data), mine[:8] + desc[8:16] + mine[16:], nbytes)
        return np.frombuffer(data, np.uint8), DESC.unpack(desc)[1]     # its lengths: _Message checks

    def too_long(self, peer, nbytes, capacity):
        return too_long_error(peer, self.rank, nbytes, capacity)

    def release(self, peer):
        pass

    def wait_sends(self, peer=None):
        pass   # sendall() returned: the kernel has the bytes

    def abort(self, culprit, reason):
        frame = _FRAME.pack(_KIND_ABORT, reason, culprit)
        for p, link in self.links.items():
            s = link.sock
            if link.gone is not None or (p == culprit and reason == PEER_FAILED):
                continue
            try:
                s.settimeout(1.0)
                s.sendall(frame)
            except OSError:
                pass

    def close(self):
        """Graceful: stop sending, let each peer's reader see our end, wait briefly for theirs."""
        if self._closed:
            return
        self._closed = True
        for s in self.socks.values():
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        end = time.monotonic() + min(self.timeout, 2.0)
        for t in self._readers:
            t.join(max(0.0, end - time.monotonic()))
        for s in self.socks.values():
            s.close()

    # ---- internals ----------------------------------------------------------------------------

    def _send_bytes(self, peer, data):
        sock = self.links[peer].sock
        try:
            sock.sendall(data)
        except socket.timeout:
            raise PeerError(f"rank {peer} took no data from rank {self.rank} for {self.timeout:g} s "
                            f"(dead or stalled?)", peer=peer) from None
        except OSError as exc:
            raise PeerError(f"rank {peer} is gone: sending to it failed ({exc})", peer=peer) from None

    def _check_peer(self, peer):
        link = self.links[peer]
        if link.gone is not None and not self._awaited:
            raise PeerError(f"rank {peer} is gone: {link.gone} (it died, or closed its communicator)",
                            peer=peer)

    def _send_query(self, peer, epoch):
        try:
            self._send_bytes(peer, _FRAME.pack(_TCP_QUERY, epoch, 0))
        except PeerError:
            pass

    def _step(self, seconds):
        with self._cond:
            if not self.queries and self.failure is None:
                self._cond.wait(max(0.0, seconds))
            queries, self.queries = self.queries, {}
        for p, epoch in queries.items():   # answer "what are you waiting for?" from the wait loop
            if self.waiting_on is not None:
                try:
                    self._send_bytes(p, _FRAME.pack(_TCP_REPORT, epoch, self.waiting_on))
                except PeerError:
                    pass

    def _reader(self, peer, sock):
        why = "the connection closed"
        try:
            while True:
                frame = read_frame(sock, peer, self.max_message, self.size)
                if frame is None:
                    break
                kind, a, b, desc, data = frame
                with self._cond:
                    if kind == _KIND_DATA:
                        link = self.links[peer]
                        (link.unexpected if desc[_KIND_AT] == _SEND_KIND else link.inbox).append((desc, data))
                    elif kind == _KIND_ABORT:
                        if self.failure is None:
                            self.failure = abort_error(peer, b, a)
                    elif kind == _TCP_QUERY:
                        self.queries[peer] = a
                    elif a == self.epoch:
                        self.reports[peer] = b
                    self._cond.notify_all()
        except PeerError as exc:
            why = str(exc)
            if getattr(exc, "malformed", False):
                # the stream is out of step for good: drop it and fail the group now
                with self._cond:
                    if self.failure is None:
                        self.failure = exc
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        except Exception as exc:      # never die silently: a reader that stops must say why
            why = f"its reader failed ({type(exc).__name__}: {exc})"
        with self._cond:
            self.links[peer].gone = why
            self._cond.notify_all()

    def interrupt(self):
        super().interrupt()
        with self._cond:
            self._cond.notify_all()


class _Link:
    """All state of the connection to one peer."""
    __slots__ = ("sock", "inbox", "unexpected", "gone")

    def __init__(self, sock):
        self.sock = sock
        # (description, payload) of arrived data frames: the collectives' in their order, and apart
        # from them the point-to-point messages (MPI's unexpected-message queue), so a message sent
        # by isend before a collective waits for its receive after it, and is never taken for the
        # collective's
        self.inbox = collections.deque()
        self.unexpected = collections.deque()
        self.gone = None                     # why the connection ended, once it has


def _recv_exact(sock, n, idle_ok=False):
    """Exactly n bytes. EOFError on a clean end before the first byte (idle_ok: a timeout before
    the first byte just waits on)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            if idle_ok and got == 0:
                continue
            raise
        if k == 0:
            raise EOFError("the peer closed the connection" + (" mid-message" if got else ""))
        got += k
    return bytes(buf) if n <= 64 else buf
