"""perftest's own TCP exchange (Debian perftest 4.5, src/perftest_communication.c), so pyrdma-perf
can be the client of an ``ib_write_bw``/``ib_read_bw`` server, or the server for their client.

The conversation of a unidirectional BW test, each step "client writes, then reads" on the client
and "reads, then writes" on the server, with fixed-size messages and no framing:

    version      16 bytes, NUL-padded text ("6.06"); the peer refuses anything below 5.70
    cycle buffer 4-byte int, network order (the page size; both keep the larger)
    cache line   4-byte int, network order
    MTU          2 bytes: the ibv_mtu enum printed with "%d" (one digit and a NUL)
    keys         once per QP: one "pingpong_dest" text record (below)
    keys again   once per QP after the QPs reach RTR, then once more for QP 0 as a barrier
    ... the client runs the test; the server waits in the next handshake ...
    keys         QP 0 (the client has finished)
    report       size u64, iters u64, bw_peak, bw_avg, msgRate_avg as big-endian doubles
    keys + "done\\0" and close

A pingpong_dest record is printf text: with a GID (RoCE, or -x on InfiniBand) 108 bytes,
``lid:out_reads:qpn:psn:rkey:vaddr:`` in hex, 16 GID bytes in hex, ``srqn:`` and a NUL; without a
GID 59 bytes, ``lid:out_reads:qpn:psn:rkey:vaddr:srqn`` and a NUL.
"""
from __future__ import annotations

import ipaddress
import re
import struct
from dataclasses import dataclass

from pyrdma.errors import PeerError, WireFormatError
from pyrdma.wire import recv_exact

# The version text perftest 4.5-0.17 sends. Peers gate features on it: >= 5.70 is required by
# the server, >= 5.33 makes the report's iteration count 64-bit, >= 5.31 makes the MTU 2 bytes.
WIRE_VERSION = "6.06"
MIN_PEER_VERSION = 5.70
VERSION_BYTES = 16
KEY_MSG_SIZE = 59
KEY_MSG_SIZE_GID = 108
DEFAULT_CACHE_LINE = 64
DONE = b"done\0"
_REPORT = struct.Struct("!QQddd")
# What a peer may announce: the cycle buffer is a page size (perftest's "the larger of the two"
# sizes our buffer, so a huge one would be an allocation the peer chose), the cache line likewise.
MAX_CYCLE_BUFFER = 1 << 21
MAX_CACHE_LINE = 4096
# field bounds of a key record: lid, out_reads, qpn, psn, rkey, vaddr (and srqn)
_DEST_LIMITS = (("lid", 1 << 16), ("out_reads", 1 << 16), ("qpn", 1 << 24), ("psn", 1 << 24),
                ("rkey", 1 << 32), ("vaddr", 1 << 64))
_VERSION = re.compile(r"\d{1,3}\.\d{1,3}")


@dataclass(frozen=True)
class Dest:
    """perftest's struct pingpong_dest: what one side tells the other about one QP."""
    lid: int
    out_reads: int
    qpn: int
    psn: int
    rkey: int
    vaddr: int
    gid: bytes = bytes(16)
    srqn: int = 0

    @property
    def ipv4_mapped(self):
        return ipaddress.IPv6Address(self.gid).ipv4_mapped is not None


def encode_dest(dest, with_gid):
    head = (f"{dest.lid:04x}:{dest.out_reads:04x}:{dest.qpn:06x}:{dest.psn:06x}:{dest.rkey:08x}:"
            f"{dest.vaddr:016x}")
    if with_gid:
        text = head + ":" + "".join(f"{b:02x}:" for b in dest.gid) + f"{dest.srqn:08x}:"
        size = KEY_MSG_SIZE_GID
    else:
        text = head + f":{dest.srqn:08x}"
        size = KEY_MSG_SIZE
    raw = text.encode()
    if len(raw) >= size:
        raise WireFormatError(f"perftest key record too long ({len(raw)} bytes): a field is out of range")
    return raw.ljust(size, b"\0")


def decode_dest(raw, with_gid):
    text = bytes(raw).split(b"\0", 1)[0].decode("ascii", errors="replace")
    fields = text.rstrip(":").split(":")
    want = 6 + 16 + 1 if with_gid else 7
    if len(fields) != want:
        what = "with" if with_gid else "without"
        raise WireFormatError(f"perftest key record {text!r} has {len(fields)} fields, expected {want} "
                              f"(a record {what} GID; do both sides use a GID index, -x?)")
    if not all(re.fullmatch(r"[0-9a-fA-F]{1,16}", f) for f in fields):
        raise WireFormatError(f"perftest key record {text!r} is not hex")
    values = [int(f, 16) for f in fields]
    for (name, limit), value in zip(_DEST_LIMITS, values):
        if value >= limit:
            raise WireFormatError(f"perftest key record {text!r}: {name} {value:#x} is out of range")
    if values[-1] >= 1 << 32:
        raise WireFormatError(f"perftest key record {text!r}: srqn is out of range")
    gid = bytes(values[6:22]) if with_gid else bytes(16)
    if with_gid and any(v > 0xFF for v in values[6:22]):
        raise WireFormatError(f"perftest key record {text!r} has a GID byte above 0xff")
    return Dest(lid=values[0], out_reads=values[1], qpn=values[2], psn=values[3], rkey=values[4],
                vaddr=values[5], gid=gid, srqn=values[-1])


def encode_version(version=WIRE_VERSION):
    return version.encode().ljust(VERSION_BYTES, b"\0")[:VERSION_BYTES]


def decode_version(raw):
    text = bytes(raw).split(b"\0", 1)[0].decode("ascii", errors="replace")
    if not _VERSION.fullmatch(text):     # float() would take "nan", "inf", "1e9"
        raise WireFormatError(f"peer sent {bytes(raw)[:16]!r} where perftest sends its version; "
                              "is it perftest (or pyrdma-perf --perftest-compat)?")
    try:
        number = float(text)
    except ValueError:
        raise WireFormatError(f"peer sent {bytes(raw)[:16]!r} where perftest sends its version; "
                              "is it perftest (or pyrdma-perf --perftest-compat)?") from None
    if number < MIN_PEER_VERSION:
        raise WireFormatError(f"perftest {text} is too old: its exchange differs before version "
                              f"{MIN_PEER_VERSION:.2f}")
    return text


def encode_report(size, iters, bw_peak, bw_avg, msg_rate):
    return _REPORT.pack(size, iters, bw_peak, bw_avg, msg_rate)


def decode_report(raw):
    if len(raw) != _REPORT.size:
        raise WireFormatError(f"perftest report is {len(raw)} bytes, expected {_REPORT.size}")
    size, iters, bw_peak, bw_avg, msg_rate = _REPORT.unpack(raw)
    return dict(size=size, iters=iters, bw_peak=bw_peak, bw_avg=bw_avg, msg_rate=msg_rate)


def check_sys_data(rem_cycle, rem_line, cycle_buffer, cache_line):
    """(cycle buffer, cache line) to use given the peer's: the larger of each, within bounds (a
    peer's value sizes our buffer, so it is never trusted beyond MAX_CYCLE_BUFFER)."""
    if not 0 < rem_cycle <= MAX_CYCLE_BUFFER or rem_cycle & (rem_cycle - 1):
        raise WireFormatError(f"peer's cycle buffer {rem_cycle} is not a power of two within 1..{MAX_CYCLE_BUFFER}")
    if not 0 < rem_line <= MAX_CACHE_LINE:
        raise WireFormatError(f"peer's cache line {rem_line} is not within 1..{MAX_CACHE_LINE}")
    return max(cycle_buffer, rem_cycle), max(cache_line, rem_line)


class Conversation:
    """perftest's exchange over one connected TCP socket; ``client`` decides who speaks first."""

    def __init__(self, sock, peer, client, timeout=60.0):
        self.sock = sock
        self.peer = peer
        self.client = client
        self.timeout = timeout
        self.peer_version = None
        sock.settimeout(timeout)

    def set_timeout(self, seconds):
        self.timeout = seconds
        self.sock.settimeout(seconds)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def _recv_exact(self, n):
        return recv_exact(self.sock, n, self.peer, during="perftest's exchange (perftest prints why it left)")

    def _send(self, data):
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise PeerError(f"cannot send to {self.peer}: {exc}", peer=self.peer) from None

    def exchange(self, data):
        """perftest's ctx_xchg_data: same-size messages, the client writes first."""
        if self.client:
            self._send(data)
            return self._recv_exact(len(data))
        got = self._recv_exact(len(data))
        self._send(data)
        return got

    def versions(self):
        self.peer_version = decode_version(self.exchange(encode_version()))
        return self.peer_version

    def sys_data(self, cycle_buffer, cache_line=DEFAULT_CACHE_LINE):
        """(cycle buffer, cache line) both sides then use: the larger of each."""
        rem_cycle = struct.unpack("!i", self.exchange(struct.pack("!i", cycle_buffer)))[0]
        rem_line = struct.unpack("!i", self.exchange(struct.pack("!i", cache_line)))[0]
        return check_sys_data(rem_cycle, rem_line, cycle_buffer, cache_line)

    def mtu(self, active_mtu):
        """The ibv_mtu enum both sides use: the smaller of the two when the peer's is valid."""
        raw = self.exchange(b"%d\0" % active_mtu)
        try:
            rem = int(raw.split(b"\0", 1)[0])
        except ValueError:
            raise WireFormatError(f"peer sent MTU {raw!r}") from None
        return rem if 1 <= rem <= 5 and rem < active_mtu else active_mtu

    def keys(self, mine, with_gid):
        """One handshake (ctx_hand_shake): our Dest for the peer's."""
        return decode_dest(self.exchange(encode_dest(mine, with_gid)), with_gid)

    def reports(self, mine):
        """Swap BW reports (a dict as decode_report gives); returns the peer's."""
        raw = encode_report(mine["size"], mine["iters"], mine["bw_peak"], mine["bw_avg"], mine["msg_rate"])
        # perftest swaps the five 8-byte fields one message at a time
        return decode_report(b"".join(self.exchange(raw[i:i + 8]) for i in range(0, len(raw), 8)))

    def finish(self, mine, with_gid):
        """ctx_close_connection: a last handshake, then both sides write "done" and close."""
        self.keys(mine, with_gid)
        self._send(DONE)
        self.close()
