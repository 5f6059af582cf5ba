"""TcpTransport: one TCP connection per pair of ranks, driven by the C engine's socket link.

Python sets the connections up (listening where the peers are told to connect, the hello with the
listener's token, the job secret through the exchange); then the connected sockets go to the C
engine (pyrdma._engine.Engine.over_sockets), which runs every schedule over them as it runs them
over queue pairs: the same slots, credits, headers and wait-for diagnosis, non-blocking sockets
polled without the GIL, header and payload written by one gathering sendmsg() and large payloads
read straight into their slot. Between ranks of one machine a collective's large payloads go as
their address, copied by the receiver out of the sender's process (_readable_peers, BY_ADDRESS_BYTES)."""
import fcntl
import hmac
import os
import secrets
import select
import socket
import struct
import termios
import time

import numpy as np

from pyrdma.collectives.transport.base import (DEFAULT_SLOTS, DEFAULT_TCP_MESSAGE, MAX_RDMA_MESSAGE,
                                               _as_desc, _EngineFailures, _grow, _OwnBuffer, _Waits,
                                               describe)
from pyrdma.collectives.work import HOST
from pyrdma.errors import PeerError, UsageError, WireFormatError

_HELLO = struct.Struct("!8sBxxxii16s")       # magic, version, rank, world size, the listener's token
_HELLO_MAGIC = b"PYRDMATC"
_HELLO_VERSION = 4                           # 3: token; 4: the engine's frames (the verbs link's messages)
_TOKEN_SIZE = 16
MAX_TCP_MESSAGE = MAX_RDMA_MESSAGE            # a frame's immediate carries the length, as over RDMA
HELLO_TIMEOUT = 10.0                          # the longest an accepted connection may take to say hello
HEADER_ROOM = 64                              # a slot: the header, then the payload (as over RDMA)
DEFAULT_SPIN = 200e-6
# Ranks on one machine: a message (a collective's or point-to-point) of at least this many bytes goes
# as its address, and its receiver copies it out of the sender's memory (process_vm_readv: one copy,
# where a socket makes two, and none of them the sender's CPU). PYRDMA_SOCKET_CMA=0 turns it off
# (UCX_TLS=^cma).
BY_ADDRESS_BYTES = 64 * 1024
# Where the ranks outnumber the CPUs a send by address waits for its reader to be scheduled, which
# can cost more than the copy it saves below this (4 ranks on 2 cores, torch scatter of 64 KiB
# blocks: 1.10-1.41x gloo's time in four runs by address, 0.85-0.99x by the socket)
BY_ADDRESS_BYTES_CROWDED = 1 << 20
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


class TcpTransport(_OwnBuffer, _Waits, _EngineFailures):
    """The same contract over one TCP connection per pair of ranks.

    ``host``: the address this rank listens on and advertises (default: the address it used to
    reach the rendezvous, from ``exchange.advertise_host``, else 127.0.0.1). ``max_message`` (<= 4
    MiB) and ``slots`` are the engine's, as over RDMA: ``slots`` receive slots of ``max_message``
    bytes per peer; ``spin`` seconds of polling the sockets precede sleeping in poll()."""

    name = "tcp"

    def __init__(self, rank, size, exchange, timeout=60.0, host=None, max_message=DEFAULT_TCP_MESSAGE,
                 slots=DEFAULT_SLOTS, spin=DEFAULT_SPIN):
        self.rank, self.size = rank, size
        self._init_waits(timeout)
        self.max_message, self.slots, self.spin = int(max_message), int(slots), spin
        if not 1 <= self.max_message <= MAX_TCP_MESSAGE:
            raise UsageError(f"max_message must be within 1..{MAX_TCP_MESSAGE}, got {max_message}")
        if not 1 <= self.slots <= 0xFFFF:
            raise UsageError(f"slots must be within 1..65535, got {slots}")
        self.send_window = self.slots
        self.peers = [p for p in range(size) if p != rank]
        self._desc = describe(0, "")
        self._rdesc = None
        self._closed = False
        self.socks = {}                      # peer -> socket
        self._own = self._work = self._shadow = None
        self._own_region = None
        self._kind = HOST
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
            machine = _machine()
            records = exchange.allgather(f"{self.max_message} {host}:{listener.getsockname()[1]} "
                                         f"{self._token.hex()} {self.slots} {machine}".encode())
            addresses, tokens, same_machine = [], [], []
            for p, rec in enumerate(records):
                fields = rec.decode(errors="replace").split(" ")
                if len(fields) != 5 or len(fields[2]) != 2 * _TOKEN_SIZE:
                    raise WireFormatError(f"rank {p}'s TCP transport record is malformed: {bytes(rec)[:80]!r}")
                message, address, token, slots, theirs = fields
                if p != self.rank and machine != "-" and theirs == machine:
                    same_machine.append(p)
                if p != self.rank and (message, slots) != (str(self.max_message), str(self.slots)):
                    raise UsageError(f"rank {p} uses max_message={message} and slots={slots}, rank {self.rank} "
                                     f"{self.max_message} and {self.slots}: all ranks must be given the same")
                try:
                    tokens.append(bytes.fromhex(token))
                except ValueError:
                    raise WireFormatError(f"rank {p}'s TCP transport record has a malformed token") from None
                addresses.append(address)
            self._connect_all(listener, addresses, tokens)
            for s in self.socks.values():
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            readable = self._readable_peers(same_machine)
            for s in self.socks.values():
                s.setblocking(False)
            from pyrdma._engine import Engine
            self.slot_stride = (HEADER_ROOM + self.max_message + 63) & ~63
            self.slot_array = np.zeros(max(1, len(self.peers) * self.slots * self.slot_stride), np.uint8)
            fds = [-1 if p == rank else self.socks[p].fileno() for p in range(size)]
            self.engine = Engine.over_sockets(fds, self.slot_array, rank, size, self.slots, self.slot_stride,
                                              self.max_message, self.timeout, spin)
            self.engine.by_address_bytes = BY_ADDRESS_BYTES_CROWDED if self.engine.crowded else BY_ADDRESS_BYTES
            for p, (pid, reads_ours) in readable.items():
                if pid or reads_ours:
                    self.engine.by_address(p, pid, reads_ours)
        except BaseException:
            for s in self.socks.values():
                s.close()
            raise
        finally:
            listener.close()
        self.buffer(0)

    def _readable_peers(self, peers):
        """{peer: (its pid if this process can read its memory else 0, whether it can read ours)}
        for ``peers`` (said to be on this machine): each proves its pid by holding the random bytes
        this rank sent it where this rank then reads them out of that process, so that a member
        cannot point us at another process's memory. Where process_vm_readv is not allowed (a
        seccomp filter, Yama's ptrace scope, another pid namespace) the proof fails and the
        socket carries the data."""
        if not peers:
            return {}
        from pyrdma._engine import read_memory_of
        mine = {p: secrets.token_bytes(16) for p in peers}
        held = np.zeros((self.size, 16), np.uint8)          # theirs, where they read them
        for p in peers:
            self.socks[p].settimeout(self.timeout)
        self._say(peers, lambda p: mine[p])
        for p, got in self._hear(peers, 16).items():
            held[p] = np.frombuffer(got, np.uint8)
        self._say(peers, lambda p: _PROOF.pack(os.getpid(), held[p].ctypes.data))
        pids = {}
        for p, got in self._hear(peers, _PROOF.size).items():
            pid, addr = _PROOF.unpack(got)
            pids[p] = pid if pid > 0 and read_memory_of(pid, addr, 16) == mine[p] else 0
        self._say(peers, lambda p: b"\1" if pids[p] else b"\0")
        return {p: (pids[p], got == b"\1") for p, got in self._hear(peers, 1).items()}

    def _say(self, peers, message):
        for p in peers:
            try:
                self.socks[p].sendall(message(p))
            except OSError as exc:
                raise PeerError(f"rank {self.rank} cannot reach rank {p}: {exc}", peer=p) from None

    def _hear(self, peers, n):
        heard = {}
        for p in peers:
            try:
                heard[p] = _recv_exact(self.socks[p], n)
            except (OSError, EOFError) as exc:
                raise PeerError(f"rank {p} did not finish setting up the connection to rank {self.rank}: "
                                f"{exc or 'it closed'}", peer=p) from None
        return heard

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
            self.own_region(nbytes)
            self._work, self._kind = self._own, HOST
        else:
            self._work, self._kind = lend[start:start + nbytes], kind
        return self._work

    def own_region(self, nbytes):
        """This transport's own work buffer, grown to at least ``nbytes``, as the one-call path
        takes it (pyrdma._hostcalls.HostRegion: a grown buffer's old region is marked closed)."""
        from pyrdma._engine import HostRegion
        if self._own is None or self._own.nbytes < nbytes:
            if self._own_region is not None:
                self._own_region.closed = True
            self._own = np.empty(_grow(nbytes), np.uint8)
            self._own_region = HostRegion(self._own)
        return self._own_region

    def registration(self, lend, kind=HOST):
        """(region, 0) of a lent host array: nothing to register over TCP."""
        from pyrdma._engine import HostRegion
        return HostRegion(lend), 0

    def set_tag(self, desc, recv_desc=None):
        self._desc = _as_desc(desc)
        self._rdesc = None if recv_desc is None else _as_desc(recv_desc)

    parked_ticket = None     # a send never waits for its receive here (no rendezvous: the slots take it)

    def run(self, schedule, dtype=0, op=0, consume=None, park=False, out=None):
        """Execute ``schedule`` on the work area in the C engine: one call, without the GIL.
        Returns the length of the point-to-point message it received (None if none). Memory that
        consumes in Python (a GPU work area, gpu_path="direct") runs on a host copy of it: the
        sockets move host memory only. ``out``: a second work area of host memory (Run's)."""
        work = self._work
        if consume is not None:
            if self._shadow is None or self._shadow.nbytes < work.nbytes:
                self._shadow = np.empty(_grow(work.nbytes), np.uint8)
            host = self._shadow[:work.nbytes]
            host[...] = np.asarray(self._kind.read(work)).reshape(-1).view(np.uint8)
        else:
            host = work
        if self.failure is None:
            addr = HOST.address(host) if host.nbytes else HOST.address(self.slot_array)
            extra = () if out is None else (0, False, HOST.address(out) if out.nbytes else addr, out.nbytes)
            if self.engine.run(self.engine.program(schedule), addr, host.nbytes, 0, self._desc, dtype, op, None,
                               self.background, self._rdesc, *extra):
                self.engine_failed()
        if self.failure is not None:
            raise self.failure
        if consume is not None:
            self._kind.write(work, host)
        return self.engine.received if self._rdesc is not None else None

    def finish_sends(self, seconds):
        """Let each peer's kernel take what we wrote (at most ``seconds``) before close(): a socket
        closed with bytes it has not read resets its connection, which drops what the peer has not
        received yet, so a rank that closes right after a collective would fail another rank
        still reading that collective's last blocks. So our end is shut for writing (the end of
        the stream follows the data) and what arrives is read and dropped until each peer has
        acknowledged all we sent, or ended its own stream (it is closing too)."""
        deadline = time.monotonic() + seconds
        waiting = list(self.socks.values())
        for s in waiting:
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        while waiting:
            for s in list(waiting):
                try:
                    done = not s.recv(1 << 16, socket.MSG_DONTWAIT)      # b"": its stream ended
                except BlockingIOError:
                    done = _unacknowledged(s) == 0
                except OSError:
                    done = True
                if done:
                    waiting.remove(s)
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            select.select(waiting, [], [], min(0.005, left))

    def close(self):
        """Graceful: stop sending, so that each peer sees our end, then close."""
        if self._closed:
            return
        self._closed = True
        for s in self.socks.values():
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        for s in self.socks.values():
            s.close()

    def _link_error(self, peer, err, _):
        why = "the connection closed" if not err else f"the connection broke ({os.strerror(err)})"
        return PeerError(f"rank {peer} is gone: {why} (it died, or closed its communicator)", peer=peer)


_PROOF = struct.Struct("!iQ")          # a pid, and where its memory holds the bytes it was sent


def by_address_allowed():
    """Whether the environment lets ranks of one machine copy out of each other's memory
    (PYRDMA_SOCKET_CMA=0 forbids it)."""
    return os.environ.get("PYRDMA_SOCKET_CMA", "1") != "0"


def _machine():
    """What names this machine's running kernel (its boot id), or "-": PYRDMA_SOCKET_CMA=0, or none."""
    if not by_address_allowed():
        return "-"
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip().replace(" ", "") or "-"
    except OSError:
        return "-"


def _unacknowledged(sock):
    """The bytes written to ``sock`` that its peer's kernel has not acknowledged yet (0 where the
    system does not say)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        return 0


def _recv_exact(sock, n):
    """Exactly n bytes (the hello). EOFError when the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the peer closed the connection" + (" mid-message" if got else ""))
        got += k
    return bytes(buf) if n <= 64 else buf
