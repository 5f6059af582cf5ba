"""Point-to-point channels the collective algorithms are written against (gloo's "pair").

The interface, per peer rank: ``send(peer, chunk)`` posts a chunk of the work buffer (at most
``max_message`` bytes); ``recv(peer, nbytes)`` waits for the next chunk from that peer (in order)
and returns a read-only view of it; ``release(peer)`` says that view was consumed; ``flush()``
waits until every posted send has left local memory. ``work(nbytes)`` hands out the reusable
buffer the chunks must live in.

RdmaTransport: one RC QP per peer. A chunk is an RDMA WRITE_WITH_IMM into one of the peer's
registered receive slots; the immediate carries slot and length. The receiver returns a credit
(a zero-byte WRITE_WITH_IMM) when it has consumed a slot, so a sender never overwrites a slot
that was not consumed. Everything is registered once: the slots at start-up, the work buffer when
it grows (the registration cache).

TcpTransport: the same contract over sockets, for machines without RDMA and for host tests.
"""
import queue
import socket
import struct
import threading
import time

import numpy as np

from pyrdma.errors import CompletionError, PeerError, RDMATimeoutError, UsageError

DEFAULT_SLOT_BYTES = 256 * 1024
DEFAULT_SLOTS = 8
_CREDIT = 1 << 31


def _mismatch(peer, got, expected):
    return UsageError(f"rank {peer} sent a {got}-byte chunk where {expected} bytes were expected: "
                      f"the ranks disagree on the buffer size, dtype or operation")


class RdmaTransport:
    """RC QPs to every peer, connected through ``exchange`` (an object with ``allgather(bytes)``)."""

    def __init__(self, rank, size, exchange, timeout=60.0, device=None, slot_bytes=DEFAULT_SLOT_BYTES,
                 slots=DEFAULT_SLOTS):
        import pyrdma as rd
        from pyrdma.endpoint import Endpoint, WIRE_SIZE

        self.rd = rd
        self.rank, self.size, self.timeout = rank, size, timeout
        self.max_message = slot_bytes
        self.slots = slots
        peers = [p for p in range(size) if p != rank]
        self.ctx = rd.Context(device)
        self.pd = rd.ProtectionDomain(self.ctx)
        depth = 2 * slots + 8
        self.cq = rd.CompletionQueue(self.ctx, max(64, min(4 * depth * max(1, len(peers)),
                                                           self.ctx.query_device().max_cqe)))
        self.sq_depth = depth
        self.qp, self.region, self.remote = {}, {}, {}
        self.credits = {p: slots for p in peers}
        self.send_seq = {p: 0 for p in peers}
        self.outstanding = {p: 0 for p in peers}
        self.arrivals = {p: [] for p in peers}
        self.peer_of_qpn = {}
        self._recv_wr = {}
        remote_access = rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE
        for p in peers:
            qp = rd.QueuePair(self.pd, rd.QPT_RC, self.cq, max_send_wr=depth, max_recv_wr=depth)
            qp.to_init()
            self._recv_wr[p] = rd.RecvWR([], wr_id=p)
            for _ in range(depth):
                qp.post_recv(self._recv_wr[p])
            self.qp[p] = qp
            self.region[p] = rd.MemoryRegion.allocate(self.pd, slot_bytes * slots, remote_access)
            self.peer_of_qpn[qp.qp_num] = p
        placeholder = Endpoint(qpn=0, psn=0)
        record = b"".join((self.qp[p].endpoint(mr=self.region[p]) if p != rank else placeholder).to_bytes()
                          for p in range(size))
        records = exchange.allgather(record)
        for p in peers:
            ep = Endpoint.from_bytes(records[p][rank * WIRE_SIZE:(rank + 1) * WIRE_SIZE])
            self.qp[p].to_rtr(ep)
            self.qp[p].to_rts()
            self.remote[p] = ep
        exchange.allgather(b"connected")   # nobody writes before every QP is ready to receive
        self._work = None
        self._work_mr = None
        self._wcs = np.empty(64, rd.WC_DTYPE)

    def work(self, nbytes):
        if self._work is None or self._work.nbytes < nbytes:
            if self._work_mr is not None:
                self._work_mr.close()
            size = max(4096, 1 << max(0, int(nbytes) - 1).bit_length())
            self._work_mr = self.rd.MemoryRegion.allocate(self.pd, size, self.rd.ACCESS_LOCAL_WRITE)
            self._work = self._work_mr.array()
        return self._work[:nbytes]

    def _progress(self, deadline, waiting_for):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerError(f"rank {waiting_for} did not answer within {self.timeout} s "
                            f"(dead or stalled?)", peer=waiting_for)
        try:
            n = self.cq.poll_wait(self._wcs, 1, timeout=min(remaining, 1.0))
        except RDMATimeoutError:
            return
        for wr_id, status, opcode, imm, qpn in zip(self._wcs["wr_id"][:n].tolist(), self._wcs["status"][:n].tolist(),
                                                   self._wcs["opcode"][:n].tolist(),
                                                   self._wcs["imm_data"][:n].tolist(),
                                                   self._wcs["qp_num"][:n].tolist()):
            peer = self.peer_of_qpn.get(qpn, wr_id)
            if status != self.rd.WC_SUCCESS:
                raise PeerError(f"link to rank {peer} failed: {self.rd.wc_status_name(status)} "
                                f"({self.rd.wc_status_str(status)}); the peer died or left", peer=peer)
            if opcode == self.rd.WC_RECV_RDMA_WITH_IMM:
                self.qp[peer].post_recv(self._recv_wr[peer])
                if imm & _CREDIT:
                    self.credits[peer] += imm & 0xFFFF
                else:
                    self.arrivals[peer].append((imm >> 24, imm & 0xFFFFFF))
            else:
                self.outstanding[peer] -= 1

    def send(self, peer, chunk):
        nbytes = chunk.nbytes
        if nbytes > self.max_message:
            raise UsageError(f"chunk of {nbytes} bytes exceeds the {self.max_message}-byte slots")
        deadline = time.monotonic() + self.timeout
        while self.credits[peer] == 0 or self.outstanding[peer] >= self.sq_depth:
            self._progress(deadline, peer)
        slot = self.send_seq[peer] % self.slots
        offset = chunk.ctypes.data - self._work.ctypes.data if nbytes else 0
        remote = self.remote[peer]
        self.qp[peer].post_write(self._work_mr, offset, nbytes, remote.addr + slot * self.max_message,
                                 remote.rkey, wr_id=peer, imm=(slot << 24) | nbytes)
        self.credits[peer] -= 1
        self.send_seq[peer] += 1
        self.outstanding[peer] += 1

    def recv(self, peer, nbytes):
        deadline = time.monotonic() + self.timeout
        while not self.arrivals[peer]:
            self._progress(deadline, peer)
        slot, got = self.arrivals[peer].pop(0)
        if got != nbytes:
            raise _mismatch(peer, got, nbytes)
        start = slot * self.max_message
        return self.region[peer].array()[start:start + got]

    def release(self, peer):
        deadline = time.monotonic() + self.timeout
        while self.outstanding[peer] >= self.sq_depth:
            self._progress(deadline, peer)
        remote = self.remote[peer]
        self.qp[peer].post_write(self._work_mr, 0, 0, remote.addr, remote.rkey, wr_id=peer, imm=_CREDIT | 1)
        self.outstanding[peer] += 1

    def flush(self):
        deadline = time.monotonic() + self.timeout
        for peer, count in self.outstanding.items():
            while self.outstanding[peer] > 0:
                self._progress(deadline, peer)

    def close(self):
        self.ctx.close()


class TcpTransport:
    """The same contract over one TCP connection per pair; a reader thread per peer drains it."""

    def __init__(self, rank, size, exchange, timeout=60.0, host="127.0.0.1", slot_bytes=DEFAULT_SLOT_BYTES):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.max_message = slot_bytes
        self.inbox = {p: queue.Queue() for p in range(size) if p != rank}
        self.socks = {}
        listener = socket.create_server((host, 0))
        listener.settimeout(timeout)
        addresses = exchange.allgather(f"{host}:{listener.getsockname()[1]}".encode())
        try:
            for p in range(rank):   # connect to lower ranks, accept from higher ones
                h, port = addresses[p].decode().rsplit(":", 1)
                s = socket.create_connection((h, int(port)), timeout=timeout)
                s.sendall(struct.pack("!i", rank))
                self.socks[p] = s
            for _ in range(rank + 1, size):
                s, _ = listener.accept()
                s.settimeout(timeout)
                (p,) = struct.unpack("!i", self._read(s, 4))
                self.socks[p] = s
        finally:
            listener.close()
        self._readers = []
        for p, s in self.socks.items():
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._reader, args=(p, s), daemon=True)
            t.start()
            self._readers.append(t)
        self._work = None

    @staticmethod
    def _read(sock, n):
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return bytes(buf)

    def _reader(self, peer, sock):
        try:
            while True:
                (n,) = struct.unpack("!Q", self._read(sock, 8))
                self.inbox[peer].put(self._read(sock, n))
        except (OSError, ConnectionError):
            self.inbox[peer].put(None)   # the peer is gone

    def work(self, nbytes):
        if self._work is None or self._work.nbytes < nbytes:
            self._work = np.empty(max(4096, 1 << max(0, int(nbytes) - 1).bit_length()), np.uint8)
        return self._work[:nbytes]

    def send(self, peer, chunk):
        try:
            self.socks[peer].sendall(struct.pack("!Q", chunk.nbytes) + chunk.tobytes())
        except OSError as exc:
            raise PeerError(f"sending to rank {peer} failed: {exc}; the peer died or left", peer=peer) from None

    def recv(self, peer, nbytes):
        try:
            data = self.inbox[peer].get(timeout=self.timeout)
        except queue.Empty:
            raise PeerError(f"rank {peer} did not answer within {self.timeout} s (dead or stalled?)",
                            peer=peer) from None
        if data is None:
            self.inbox[peer].put(None)
            raise PeerError(f"rank {peer} closed its connection (died or left)", peer=peer)
        if len(data) != nbytes:
            raise _mismatch(peer, len(data), nbytes)
        return np.frombuffer(data, np.uint8)

    def release(self, peer):
        pass

    def flush(self):
        pass

    def close(self):
        for s in self.socks.values():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
