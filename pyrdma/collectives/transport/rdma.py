"""RdmaTransport: RC QPs to every peer; the data path is the C engine (pyrdma._engine)."""
import collections
import ctypes

import numpy as np

from pyrdma.collectives.transport.base import (DEFAULT_QP_TIMEOUT,
                                               DEFAULT_RDMA_MESSAGE, DEFAULT_SLOTS, MAX_RDMA_MESSAGE,
                                               USER_MR_CACHE, _as_desc, _grow, _OwnBuffer,
                                               _EngineFailures, _Waits, describe)
from pyrdma.collectives.work import HOST
from pyrdma.errors import PeerError, RDMAError, UsageError, WireFormatError

DEFAULT_RENDEZVOUS_BYTES = 1 << 20
HEADER_ROOM = 64           # a slot: the header, then the payload (64-byte aligned)
# A message this long (the header room and up to 192 payload bytes) goes inline: the NIC copies it
# at the post, so the collective need not wait for its ACK before it returns.
MAX_INLINE = 256
# Vendor IDs of the software RDMA devices, Soft-RoCE (rxe) and Soft-iWARP (siw): their CPU does
# the data movement of an RDMA operation, at both ends, in the context of the rank that posts it.
SOFTWARE_VENDORS = frozenset((0xFFFFFF, 0x626D74))


def _slot_consumer(consume, slots, base):
    """The engine's callback (kind, offset, nbytes, aux, offset from the slots' address ``base``)
    over schedule's consume(). A message the engine kept aside (Engine._keep) lies outside the slots."""
    def callback(kind, off, nbytes, aux, at):
        if 0 <= at <= len(slots) - nbytes:
            data = slots[at:at + nbytes]
        else:
            data = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(base + at), np.uint8)
        consume(kind, (off, nbytes, aux), data)
    return callback


class RdmaTransport(_OwnBuffer, _Waits, _EngineFailures):
    """RC QPs to every peer, connected through ``exchange`` (anything with ``allgather(bytes)``).

    ``max_message`` (<= 4 MiB) is the slot size, ``slots`` the slots per peer; ``spin`` seconds of
    polling, yielding the CPU between polls, precede sleeping on the completion channel (a wake-up
    costs more than a short spin; the yields hand the CPU to other ranks where they outnumber the
    cores); ``qp_timeout`` is the QPs' local ACK timeout exponent (1..31, as NCCL_IB_TIMEOUT);
    point-to-point messages of ``rendezvous_bytes`` or more (0: none) go by rendezvous (the
    package's docstring)."""

    name = "rdma"

    def __init__(self, rank, size, exchange, timeout=60.0, device=None, max_message=DEFAULT_RDMA_MESSAGE,
                 slots=DEFAULT_SLOTS, spin=200e-6, port=1, gid_index=None, qp_timeout=DEFAULT_QP_TIMEOUT,
                 rendezvous_bytes=DEFAULT_RENDEZVOUS_BYTES):
        import pyrdma as rd
        from pyrdma.endpoint import Endpoint, WIRE_SIZE

        if not 0 < max_message <= MAX_RDMA_MESSAGE:
            raise UsageError(f"max_message must be within 1..{MAX_RDMA_MESSAGE}, got {max_message}")
        if slots < 1 or slots > 0xFFFF:
            raise UsageError(f"slots must be within 1..65535, got {slots}")
        if not 1 <= qp_timeout <= 31:
            raise UsageError(f"qp_timeout must be within 1..31 (4.096 us * 2^qp_timeout), got {qp_timeout}")
        self.rd = rd
        self.rank, self.size = rank, size
        self._init_waits(timeout)
        self.max_message, self.slots, self.spin = int(max_message), int(slots), spin
        self.qp_timeout = int(qp_timeout)
        self._rendezvous_bytes = int(rendezvous_bytes or 0)
        self.slot_stride = (HEADER_ROOM + self.max_message + 63) & ~63
        self.peers = [p for p in range(size) if p != rank]
        self._closed = False
        self._desc = describe(0, "")
        self._rdesc = None
        if not isinstance(port, int) or not 1 <= port <= 255:
            raise UsageError(f"port must be a port number within 1..255, got {port!r}")
        if gid_index is not None and (not isinstance(gid_index, int) or gid_index < 0):
            raise UsageError(f"gid_index must be a non-negative integer (or None: the best one), got {gid_index!r}")
        self.ctx = rd.Context(device)
        try:
            self._setup(rd, Endpoint, WIRE_SIZE, exchange, port, gid_index)
        except BaseException:
            self.ctx.close()
            raise

    def _check_gid(self, port, gid_index):
        """UsageError unless ``gid_index`` names a GID of ``port`` (an all-zero entry is unused)."""
        nports = self.ctx.query_device().phys_port_cnt
        where = f"device {self.ctx.name!r}"
        if port > nports:
            raise UsageError(f"{where} has {nports} port(s); port {port} does not exist")
        if gid_index is None:
            return
        length = self.ctx.query_port(port).gid_tbl_len
        if gid_index >= length:
            raise UsageError(f"gid_index {gid_index} is out of range: port {port} of {where} has {length} GIDs")
        try:
            gid = self.ctx.query_gid(port, gid_index)
        except RDMAError as exc:
            raise UsageError(f"gid_index {gid_index} is not a GID of port {port} of {where}: {exc}") from None
        if not any(bytes(gid)):
            raise UsageError(f"gid_index {gid_index} of port {port} of {where} is an empty GID table entry")

    def _setup(self, rd, Endpoint, WIRE_SIZE, exchange, port, gid_index):
        self._check_gid(port, gid_index)
        npeers = len(self.peers)
        self.pd = rd.ProtectionDomain(self.ctx)
        self.channel = rd.CompChannel(self.ctx)
        # data <= slots in flight (one WR each: header and payload gathered), credits <= slots /
        # batch, plus control and abort messages
        self.sq_depth = 2 * self.slots + 8
        self.rq_depth = 2 * self.slots + 8
        attr = self.ctx.query_device()
        max_cqe = attr.max_cqe
        software_here = attr.vendor_id in SOFTWARE_VENDORS
        cqe = max(16, min(max_cqe, npeers * (self.sq_depth + self.rq_depth) + 16))
        self.cq = rd.CompletionQueue(self.ctx, cqe, channel=self.channel)
        self.credit_batch = max(1, self.slots // 2)
        # credits bound what is in flight; every free slot may take a message ahead
        self.send_window = self.slots
        # Receive slots of every peer in one registration; peer p owns [slot_base[p], + per_peer).
        # After them a 64-byte mailbox per peer, where it answers our rendezvous (the Engine).
        per_peer = self.slots * self.slot_stride
        self.slot_mr = rd.MemoryRegion.allocate(self.pd, max(1, npeers) * (per_peer + HEADER_ROOM),
                                                rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE)
        self.slot_array = self.slot_mr.array()
        # The headers of the messages in flight: one per credit and peer, reused slot by slot (a
        # credit comes back only after its message, and so its header, has arrived); then one room
        # per peer for our rendezvous answers.
        self.header_mr = rd.MemoryRegion.allocate(self.pd, max(1, npeers) * (self.slots + 1) * HEADER_ROOM,
                                                  rd.ACCESS_LOCAL_WRITE)
        self.links = {}                      # peer -> _Link
        self.max_inline = MAX_INLINE
        for p in self.peers:
            qp = self._queue_pair(rd, port, gid_index)
            qp.to_init()     # the port is the QP's already; to_init(port=) would re-pick the GID
            recv = rd.RecvWR([], wr_id=p << 2)    # WRITE_WITH_IMM consumes a receive but no buffer
            for _ in range(self.rq_depth):
                qp.post_recv(recv)
            self.links[p] = _Link(qp)
        self._own_mr = self._own = None
        self._work_mr = self._work = None
        self._work_offset = 0          # where the work area starts in _work_mr
        self._sync = HOST.sync         # the work area's kind's: before the NIC reads it
        # Callers' buffers registered by work_area, most recent last. Each MR keeps its buffer
        # alive, so its address range cannot be freed and handed to other memory while cached.
        self._user_mrs = collections.OrderedDict()
        # parked rendezvous sends (run's ``park``), not settled yet: {ticket: registration}, and the
        # registrations the cache let go while they still needed them (closed once settled)
        self._parked = {}
        self._evicted = []
        self.buffer(0)
        placeholder = Endpoint(qpn=0, psn=0)
        record = b"".join((placeholder if p == self.rank else self.links[p].qp.endpoint(mr=self.slot_mr)).to_bytes()
                          for p in range(self.size))
        records = exchange.allgather(record + bytes((software_here,)))
        for p in self.peers:
            rec = records[p]
            if len(rec) != self.size * WIRE_SIZE + 1 or rec[-1] > 1:
                raise WireFormatError(f"rank {p} sent a {len(rec)}-byte connection record, expected "
                                      f"{self.size * WIRE_SIZE + 1} (different world size or pyrdma version?)")
            ep = Endpoint.from_bytes(rec[self.rank * WIRE_SIZE:(self.rank + 1) * WIRE_SIZE])
            if ep.length != self.slot_mr.length:
                raise UsageError(f"rank {p} registered {ep.length} bytes of receive slots, rank {self.rank} "
                                 f"{self.slot_mr.length}: the ranks were given different max_message or slots")
            link = self.links[p]
            link.qp.to_rtr(ep)
            link.qp.to_rts(timeout=self.qp_timeout)
            # our slots in the peer's region: it orders its peers by rank, skipping itself
            their_index = self.rank if self.rank < p else self.rank - 1
            link.remote = (ep.addr + their_index * self.slots * self.slot_stride, ep.rkey)
        # every rank's answer, so that the cost model chooses alike on all of them
        self.software = any(rec[-1] for rec in records)
        from pyrdma._engine import Engine
        mine = _Link(None)                    # no QP to itself
        links = [self.links.get(p, mine) for p in range(self.size)]
        self.engine = Engine(self.cq, [link.qp for link in links], self.slot_mr, self.header_mr,
                             [link.remote for link in links], self.rank, self.size,
                             self.slots, self.slot_stride, self.max_message, self.sq_depth, self.timeout, self.spin,
                             self.max_inline, self._rendezvous_bytes)
        exchange.allgather(b"rdma-connected")   # nobody writes before every QP is ready to receive

    def _queue_pair(self, rd, port, gid_index):
        """An RC QP to a peer: two gather entries (header room and payload), and inline sends of
        up to MAX_INLINE bytes where the device takes them (self.max_inline: what it gave)."""
        kwargs = dict(max_send_wr=self.sq_depth, max_recv_wr=self.rq_depth, max_send_sge=2, port=port,
                      gid_index=gid_index)
        if self.max_inline:
            try:
                qp = rd.QueuePair(self.pd, rd.QPT_RC, self.cq, max_inline_data=self.max_inline, **kwargs)
                self.max_inline = min(self.max_inline, qp.max_inline_data)
                return qp
            except RDMAError:
                self.max_inline = 0
        return rd.QueuePair(self.pd, rd.QPT_RC, self.cq, **kwargs)

    # ---- the interface ------------------------------------------------------------------------

    @property
    def rendezvous_bytes(self):
        return self.engine.rendezvous_bytes

    @rendezvous_bytes.setter
    def rendezvous_bytes(self, nbytes):
        self.engine.rendezvous_bytes = nbytes

    def work_area(self, nbytes, lend=None, start=0, kind=HOST):
        """The work area of the next collective: ``lend[start:start + nbytes]`` in place (a flat
        uint8 array: sends go straight from it), else this transport's own registered buffer of at
        least ``nbytes``. A lent array is registered (by its ``kind``, work.HostMemory's protocol)
        on first use and stays registered (and alive) among the USER_MR_CACHE most recent, so
        calls on the same memory pay nothing."""
        if lend is None:
            self._drain()                    # a one-call run's sends from it may be in flight
            self._work_mr = self.own_region(nbytes)
            self._work, self._work_offset = self._own, 0
            self._sync = HOST.sync
            return self._work
        mr, base = self.registration(lend, kind)
        self._work = lend[start:start + nbytes]
        self._work_mr, self._work_offset = mr, base + start
        # the NIC reads GPU memory behind CUDA's back: what the stream wrote there must be done first
        self._sync = kind.sync
        return self._work

    def own_region(self, nbytes):
        """The MemoryRegion of this transport's own work buffer, grown to at least ``nbytes`` (a
        grown buffer replaces, and closes, the old one)."""
        if self._own is None or self._own.nbytes < nbytes:
            if self._own_mr is not None:
                self._drain()
                self._own_mr.close()
            # remote write: a rendezvous message is written straight into it; remote read: a
            # scatter's blocks are read from it (schedule's OFFER/FETCH)
            self._own_mr = self.rd.MemoryRegion.allocate(self.pd, _grow(nbytes), self.rd.ACCESS_LOCAL_WRITE
                                                         | self.rd.ACCESS_REMOTE_WRITE | self.rd.ACCESS_REMOTE_READ)
            self._own = self._own_mr.array()
        return self._own_mr

    def _drain(self, seconds=0.0):
        """Wait for the sends that read this transport's own buffer (a one-call run returns without
        waiting for them: Engine.defer_sends)."""
        engine = getattr(self, "engine", None)        # (none yet while the transport sets up)
        # (a failed group's calls raise its error themselves; nothing more goes out)
        if engine is not None and engine.failure() is None and engine.drain(seconds):
            raise self.engine_failed()

    def finish_sends(self, seconds):
        """Let the sends already posted complete (at most ``seconds``) before the connections go:
        close() would flush them unsent. Their failure is left to close()."""
        try:
            self._drain(seconds)
        except RDMAError:
            pass

    def registration(self, lend, kind=HOST):
        """(MemoryRegion, offset of ``lend`` in it) of a lent array of memory of ``kind``, from the
        cache of the USER_MR_CACHE most recent registrations."""
        addr = kind.address(lend)
        size = lend.nbytes
        access = kind.access(lend)
        for (key_addr, key_len), (mr, key_offset) in self._user_mrs.items():
            if key_addr <= addr and addr + size <= key_addr + key_len and (not access or mr.access & access == access):
                self._user_mrs.move_to_end((key_addr, key_len))
                return mr, key_offset + addr - key_addr
        mr, base = kind.register(self.pd, lend, access)
        stale = self._user_mrs.pop((addr, size), None)     # registered before without remote write
        if stale is not None:
            self._let_go(stale[0])
        self._user_mrs[(addr, size)] = (mr, base)
        while len(self._user_mrs) > USER_MR_CACHE:
            self._let_go(self._user_mrs.popitem(last=False)[1][0])
        return mr, base

    def _let_go(self, mr):
        if any(mr is held for held in self._parked.values()):
            self._evicted.append(mr)      # a parked send still writes from it
        else:
            mr.close()

    def finished(self, ticket):
        """Whether the parked send of ``ticket`` needs no more waiting (settle() returns at once)."""
        count, peer = ticket
        return ticket not in self._parked or not (count == self.engine.parks and self.engine.parked() == peer) \
            and self.engine.state(peer)["data_outstanding"] == 0

    def set_tag(self, desc, recv_desc=None):
        self._desc = _as_desc(desc)
        self._rdesc = None if recv_desc is None else _as_desc(recv_desc)

    def run(self, schedule, dtype=0, op=0, consume=None, park=False, out=None):
        """Execute ``schedule`` (schedule.Schedule) on the work area in the C engine: one call,
        without the GIL. ``dtype``/``op``: pyrdma._reduce codes; ``consume(kind, chunk, data)``:
        the consumer of received chunks where the work area's kind consumes in Python (GPU memory;
        None: reduced and copied in C). ``park``: the run is an isend from a lent work area, whose
        rendezvous may stay pending after it (the engine's ``park``); ``parked_ticket`` is then
        what settle() takes to finish it (else None).
        ``out``: a second work area of host memory (Run's), registered as lent ones are.
        Returns the length of the point-to-point message it received (None if none)."""
        self._sync()
        callback = None if consume is None else _slot_consumer(consume, self.slot_array, self.slot_mr.addr)
        park = park and self._work_mr is not self._own_mr     # our own buffer is the next call's
        self.parked_ticket = None
        for ticket in [k for k in self._parked if self.finished(k)]:
            self.settle(ticket)           # written and done meanwhile: let its registration go
        if self.failure is None:
            parks = self.engine.parks
            extra = ()
            if out is not None:
                out_mr, out_offset = self.registration(out) if out.nbytes else (self._work_mr, self._work_offset)
                extra = (out_mr.addr + out_offset, out.nbytes, out_mr.lkey, out_mr.rkey)
            failed = self.engine.run(self.engine.program(schedule), self._work_mr.addr + self._work_offset,
                                     self._work.nbytes, self._work_mr.lkey, self._desc, dtype, op, callback,
                                     self.background, self._rdesc, self._work_mr.rkey, park, *extra)
            if failed:
                self.engine_failed()
            elif self.engine.parks != parks:
                self.parked_ticket = (self.engine.parks, self.engine.parked())
                self._parked[self.parked_ticket] = self._work_mr
        if self.failure is not None:
            raise self.failure
        return self.engine.received if self._rdesc is not None else None

    def settle(self, ticket):
        """Finish the send a run left parked (its ``parked_ticket``): its memory is the caller's
        again when this returns."""
        if ticket not in self._parked:
            return
        count, peer = ticket
        # the newest parked send may still wait for its answer; an older one was written before a
        # newer one could begin (one at a time), so only its writes may still be in flight
        if self.failure is None and self.engine.settle(peer, self.background, count == self.engine.parks):
            self.engine_failed()
        if self.failure is not None:
            raise self.failure
        del self._parked[ticket]
        held = list(self._parked.values())
        for mr in [m for m in self._evicted if not any(m is h for h in held)]:
            self._evicted.remove(mr)
            mr.close()

    def engine_failed(self):
        failure = super().engine_failed()
        # a peer told where to write in lent memory (a rendezvous's CTS, an all-to-all's ASK) may
        # still write there once the failed call has returned it to its caller: deregistered first,
        # such a late write fails at its writer (REM_ACCESS_ERR) instead of landing
        while self._user_mrs:
            self._let_go(self._user_mrs.popitem()[1][0])
        return failure

    def _link_error(self, peer, status, _):
        rd = self.rd
        # a remote access error: the peer is there, but the memory it named (the address and key of
        # its slots, a rendezvous answer, a scatter's offer or an all-to-all's ask) does not allow
        # the access (or no longer: its call failed, and it let its caller's memory go)
        why = f"an address or key rank {peer} sent is outside what it registered" if status == rd.WC_REM_ACCESS_ERR \
            else f"rank {peer} died or left"
        return PeerError(f"the link from rank {self.rank} to rank {peer} failed: {rd.wc_status_name(status)} "
                         f"({rd.wc_status_str(status)}); {why}", peer=peer)

    def close(self):
        if self._closed:
            return
        self._closed = True
        # Error state first: it flushes the sends still outstanding to a dead or unreachable peer, so
        # the provider stops resending before the QP is destroyed.
        for link in self.links.values():
            try:
                link.qp.to_error()
            except RDMAError:
                pass
        self.ctx.close()   # closes QPs, MRs, CQ, channel and PD, children first


class _Link:
    """What the transport keeps of one peer (its flow control lives in the engine's C record)."""
    __slots__ = ("qp", "remote")

    def __init__(self, qp):
        self.qp = qp
        self.remote = (0, 0)                 # (address, rkey) of our receive slots there, once connected
