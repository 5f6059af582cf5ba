"""Point-to-point channels the collective algorithms are written against (gloo's "pair"/"buffer").

A transport executes schedules (schedule.py); it never knows the algorithm.

    t.rank, t.size, t.max_message        who we are; the largest message in bytes
    t.buffer(nbytes) -> uint8 array      the work buffer (registered once, reused; grows on demand)
    t.work_area(nbytes, lend=None, start=0) -> the work area of the next collective: the
                                         transport's own buffer, or lend[start:start+nbytes] in
                                         place (zero copy; registered once over RDMA)
    t.buffer(nbytes), t.use_buffer(whole, start, stop)   the current work area; lend until
                                         use_buffer(None)
    t.set_tag(desc)                      the description of the collective now running (describe();
                                         every message carries it, the receiver compares it exactly)
    t.run(schedule, dtype, op, consume)  execute a schedule on the work area (RDMA: the C engine, one
                                         call without the GIL; TCP: schedule.execute in Python)
    t.abort(culprit, reason)             best effort: tell every peer this group is failing
    t.interrupt(), t.close()

The point-to-point calls schedule.execute runs on (TcpTransport, and the tests' model transports):

    t.send(peer, offset, nbytes)         post work[offset:offset+nbytes] as the next message to peer
    t.can_send(peer) -> bool             whether send(peer, ...) would post without waiting
    t.send_window                        how many messages a step may send to a peer ahead of the
                                         one it is consuming (when they post without waiting)
    t.recv(peer, nbytes) -> uint8 view   wait for the next message from peer (messages arrive in
                                         the order they were sent); valid until release(peer)
    t.release(peer)                      that view has been consumed (its slot may be reused)
    t.wait_sends(peer=None)              every posted send has left local memory (work may change)

RdmaTransport: one RC QP per peer. Each rank registers, once, ``slots`` receive slots of
``max_message`` bytes per peer. A message is one RDMA WRITE_WITH_IMM from the sender's registered
work buffer straight into the receiver's next slot (slot = message number mod slots: RC delivers in
order, so the slot index need not travel), just after a small header written by an unsignaled WRITE
posted before it (RC places it first): the collective's full description and the length, which the
receiver compares exactly with its own. The 32-bit immediate carries the kind and the length.
Flow control is by credits: a sender starts with ``slots`` credits, spends one per message and
waits when it has none; the receiver returns consumed slots as credits (a zero-byte WRITE_WITH_IMM,
batched by half the slots), so a slot is never overwritten before it was consumed.

TcpTransport: the same contract over one TCP connection per pair of ranks, for machines without
RDMA and for host tests; a reader thread per peer drains its socket so senders never block on a
peer that is itself busy sending. Every length and value read from a peer is bounded (a data frame
by max_message): a malformed frame drops the connection and fails the group with PeerError.

Closing. ``interrupt()`` (Communicator.close from another thread) makes every wait raise
UsageError within CLOSE_POLL seconds; waits sleep in slices that short, so Ctrl-C
(KeyboardInterrupt) gets through as quickly.

Failures. Every wait gives up after ``timeout`` seconds with a PeerError. A peer that disconnects,
fails a work completion or reports an abort raises PeerError at once. Whom to blame on a timeout
is found out, not guessed: shortly before the deadline the waiting rank asks the peer it waits for
what *it* is waiting for (a QUERY, answered from that peer's own wait loop with a REPORT), and
follows the chain; the rank at its end, one that does not answer, is the one that stalled or
died. So in a ring where rank 2 hangs, ranks 3 and 0 both name rank 2, not their neighbour.
"""
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
from pyrdma.errors import PeerError, RDMAError, UsageError, WireFormatError

# Each message costs a post, a completion and a Python step, so large chunks matter once messages
# are big. Measured in the Soft-RoCE VM (2 ranks, one boot), 1 MiB against 256 KiB messages: a
# 1 MiB allreduce 67/61 ms (ring/tree) against 76/66, an 8 MiB one 452/433 against 548/476.
# Credits go back every slots/2 messages, so fewer slots would add credit messages to every stream
# of small chunks.
DEFAULT_RDMA_MESSAGE = 1024 * 1024
DEFAULT_TCP_MESSAGE = 1024 * 1024
DEFAULT_SLOTS = 8
# RC's local ACK timeout, 4.096 us * 2^n, before the sender resends everything not yet acknowledged.
# perftest's 14 (67 ms) is short where the responder's work is software: on Soft-RoCE in the
# emulated VM the ACKs of a busy stream came late and every 8 MiB allreduce resent data (about 10
# retries per call). 2 ranks, 14 against 20 interleaved in one boot, 3 runs each: ring 440 against
# 406 ms, tree 465 against 388 ms, no retries with 20. NCCL_IB_TIMEOUT defaults to 20 too; a dead
# peer is found by the collective's own timeout anyway.
DEFAULT_QP_TIMEOUT = 20
MAX_RDMA_MESSAGE = 4 * 1024 * 1024   # the immediate carries a 23-bit length
MAX_RANKS = 0xFFFE                   # a REPORT carries a 16-bit rank
USER_MR_CACHE = 8                    # registrations of callers' buffers kept for reuse
CLOSE_POLL = 0.2                     # the longest a wait sleeps before it looks at interrupt() and signals

# Abort reasons (carried by ABORT messages)
PEER_FAILED, MISMATCH, LEFT = 0, 1, 2
_REASONS = {PEER_FAILED: "failed", MISMATCH: "called a collective that does not match", LEFT: "left"}
NO_CULPRIT = 0xFFFFFF


def abort_error(reporter, culprit, reason):
    """The exception a rank raises when ``reporter`` says the group failed because of ``culprit``."""
    who = "an unknown rank" if culprit == NO_CULPRIT else f"rank {culprit}"
    if reason == MISMATCH:
        err = UsageError(f"rank {reporter} found that {who} called a different collective (size, dtype, op, "
                         f"root or algorithm differ across ranks); the communicator is unusable now")
        err.peer = culprit if culprit != NO_CULPRIT else reporter
        return err
    return PeerError(f"rank {reporter} reports that {who} {_REASONS.get(reason, 'failed')}; "
                     f"the communicator is unusable now", peer=reporter if culprit == NO_CULPRIT else culprit)


def mismatch_error(peer, what):
    err = UsageError(f"rank {peer} sent {what}: the ranks disagree on the collective (buffer size, "
                     f"dtype, op, root or algorithm differ across ranks)")
    err.peer = peer
    return err


def closed_error():
    err = UsageError("the communicator was closed while this collective was running")
    err.closed = True          # Communicator._fail tells the peers this rank left, not that they mismatched
    return err


# ------------------------------------------------------------------------------------------------
# The description of a collective. Every message carries it (with its length) in front of its
# payload and the receiver compares it, byte for byte, with the one of the collective it runs
# itself: any difference in kind, count, dtype, op, root, algorithm, piece or call number is a
# mismatch, whatever the sizes. A fixed 48-byte header: negligible next to a message.

DESC = struct.Struct("<QQQQIHBBB3x")    # seq, count, lo, hi, root, dtype, kind, op, algorithm
HEADER = struct.Struct("<44sI")          # description, payload length
assert DESC.size == 44 and HEADER.size == 48
KINDS = ("", "allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "barrier",
         "allreduce-direct", "broadcast-direct", "test")
DESC_OPS = ("", "sum", "prod", "min", "max", "avg")
DESC_ALGORITHMS = ("", "ring", "halving_doubling", "recursive_doubling", "chain", "binomial", "dissemination")
NO_ROOT = 0xFFFFFFFF
BYTE_DTYPE = 0x8000                     # dtype field of byte-copying collectives: numpy's type number


def describe(seq, kind, count=0, dtype=0, op="", root=None, algorithm="", lo=0, hi=0):
    """The packed description of a collective (what set_tag takes). ``dtype``: pyrdma._reduce's code
    of a reduction's dtype, or a numpy dtype for collectives that copy bytes."""
    if not isinstance(dtype, int):
        dt = np.dtype(dtype)
        dtype = BYTE_DTYPE | ((dt.num & 0x7F) << 8) | min(dt.itemsize, 0xFF)
    return DESC.pack(seq & 0xFFFFFFFFFFFFFFFF, count, lo, hi, NO_ROOT if root is None else root, dtype,
                     KINDS.index(kind), DESC_OPS.index(op), DESC_ALGORITHMS.index(algorithm))


def explain(desc):
    """A description as text, for error messages."""
    try:
        seq, count, lo, hi, root, dtype, kind, op, algo = DESC.unpack(desc)
    except struct.error:
        return f"an unreadable description {bytes(desc)[:16].hex()}"

    def name(table, i):
        return table[i] if i < len(table) else f"#{i}"
    if dtype & BYTE_DTYPE:
        num, itemsize = (dtype >> 8) & 0x7F, dtype & 0xFF
        names = {np.dtype(t).num: np.dtype(t).name for t in set(np.sctypeDict.values())}
        dname = names.get(num, f"numpy type {num}") if num != np.dtype("V").num else f"V{itemsize}"
    else:
        from pyrdma import _reduce
        dname = name(_reduce.DTYPE_NAMES, dtype)
    parts = [f"call #{seq} {name(KINDS, kind) or 'collective'}", f"count={count}", f"dtype={dname}"]
    if op:
        parts.append(f"op={name(DESC_OPS, op)}")
    if root != NO_ROOT:
        parts.append(f"root={root}")
    if algo:
        parts.append(f"algorithm={name(DESC_ALGORITHMS, algo)}")
    if hi and (lo, hi) != (0, count):
        parts.append(f"piece [{lo}, {hi})")
    return ", ".join(parts)


def check_header(peer, rank, got_desc, got_len, want_desc, want_len):
    """UsageError (a mismatch) unless a received message is the one this rank expects."""
    if got_desc != want_desc:
        raise mismatch_error(peer, f"a message of a different collective ({explain(got_desc)}) where rank {rank} "
                                   f"runs {explain(want_desc)}")
    if got_len != want_len:
        raise mismatch_error(peer, f"a {got_len}-byte message where rank {rank} expected {want_len} bytes")


def _as_desc(desc):
    """set_tag's argument: a description from describe(), or an int (a bare call number)."""
    if isinstance(desc, (bytes, bytearray)) and len(desc) == DESC.size:
        return bytes(desc)
    if isinstance(desc, (int, np.integer)):
        return describe(int(desc), "test")
    raise UsageError(f"set_tag takes a description from describe(), got {desc!r}")


def _grow(nbytes, minimum=64 * 1024):
    return max(minimum, 1 << max(0, int(nbytes) - 1).bit_length())


class _Waits:
    """Timeouts and the wait-for diagnosis shared by both transports.

    Subclasses provide ``_step(seconds)`` (make progress or sleep at most that long),
    ``_send_query(peer, epoch)`` and keep ``self.reports`` ({peer: rank it waits for}, for the
    current epoch) up to date from incoming REPORTs."""

    def _init_waits(self, timeout):
        if self.size > MAX_RANKS:
            raise UsageError(f"at most {MAX_RANKS} ranks are supported, got {self.size}")
        self.timeout = float(timeout)
        self.probe_lead = min(1.0, self.timeout / 4)   # ask around this long before the deadline
        self.failure = None
        self.waiting_on = None
        self.epoch = 0
        self.reports = {}
        self._closing = False

    def interrupt(self):
        """Make every wait, now and later, raise UsageError ("closed") within CLOSE_POLL seconds
        (any thread may call this; close() still has to follow, once the collective has left)."""
        self._closing = True

    def _wait(self, ready, peer, what):
        """Make progress until ``ready()``; on timeout raise PeerError naming the rank to blame."""
        if ready():
            return
        self.epoch = (self.epoch + 1) & 0xFFF
        self.reports = {}
        self.waiting_on = peer
        queried = set()
        start = time.monotonic()
        deadline = start + self.timeout
        probe_at = deadline - self.probe_lead
        try:
            while True:
                if self.failure is not None:
                    raise self.failure
                if self._closing:
                    raise closed_error()
                self._check_peer(peer)
                now = time.monotonic()
                if now >= deadline:
                    raise self._stall_error(peer, what)
                if now >= probe_at:
                    suspect = self._chain_end(peer)[0]
                    if suspect not in queried and suspect != self.rank:
                        queried.add(suspect)
                        self._send_query(suspect, self.epoch)
                    self._step(min(deadline - now, 0.05))
                else:
                    self._step(min(min(probe_at, deadline) - now, CLOSE_POLL))
                if ready():
                    return
        finally:
            self.waiting_on = None

    def _check_peer(self, peer):
        pass

    def _chain_end(self, peer):
        """Follow "X waits for Y" reports from ``peer``: (last rank, the chain)."""
        chain = [peer]
        while chain[-1] in self.reports:
            nxt = self.reports[chain[-1]]
            if nxt in chain or nxt == self.rank or not 0 <= nxt < self.size:
                break
            chain.append(nxt)
        return chain[-1], chain

    def _stall_error(self, peer, what):
        suspect, chain = self._chain_end(peer)
        t = f"{self.timeout:g} s"
        if self.reports.get(suspect) == self.rank:
            return PeerError(f"rank {self.rank} and rank {suspect} wait for each other (for {what}) since {t}: "
                             f"the ranks called different collectives?", peer=suspect)
        if suspect == peer:
            return PeerError(f"rank {peer} did not answer within {t} while rank {self.rank} waited for {what} "
                             f"(dead or stalled?)", peer=peer)
        path = " -> ".join(f"rank {r}" for r in chain)
        return PeerError(f"rank {suspect} is dead or stalled: rank {self.rank} waited {t} for {what} from rank "
                         f"{peer}, and the wait-for chain {path} ends at rank {suspect}, which does not answer",
                         peer=suspect)


# ------------------------------------------------------------------------------------------------
# RDMA

_KIND_DATA, _KIND_CREDIT, _KIND_ABORT, _KIND_CONTROL = 0, 1, 2, 3
_CTRL_QUERY, _CTRL_REPORT = 0, 1
_LEN_MASK = (1 << 23) - 1
HEADER_ROOM = 64           # a slot: the header, then the payload (64-byte aligned)


def _current_stream():
    """The CuPy stream current now (the one a GPU collective runs its copies and kernels on)."""
    import cupy
    return cupy.cuda.get_current_stream()


def _imm_data(nbytes):
    return (_KIND_DATA << 30) | nbytes


def _imm_credit(count):
    return (_KIND_CREDIT << 30) | count


def _imm_abort(culprit, reason):
    return (_KIND_ABORT << 30) | ((reason & 0x3F) << 24) | (culprit & 0xFFFFFF)


def _imm_control(sub, epoch, value=0):
    return (_KIND_CONTROL << 30) | (sub << 28) | ((epoch & 0xFFF) << 16) | (value & 0xFFFF)


class RdmaTransport(_Waits):
    """RC QPs to every peer, connected through ``exchange`` (anything with ``allgather(bytes)``).

    ``max_message`` (<= 4 MiB) is the slot size, ``slots`` the slots per peer; ``spin`` seconds of
    busy polling precede sleeping on the completion channel (cheap on an idle core, polite on a
    busy one); ``qp_timeout`` is the QPs' local ACK timeout exponent (1..31, as NCCL_IB_TIMEOUT)."""

    name = "rdma"

    def __init__(self, rank, size, exchange, timeout=60.0, device=None, max_message=DEFAULT_RDMA_MESSAGE,
                 slots=DEFAULT_SLOTS, spin=50e-6, port=1, gid_index=None, qp_timeout=DEFAULT_QP_TIMEOUT):
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
        self.slot_stride = (HEADER_ROOM + self.max_message + 63) & ~63
        self.peers = [p for p in range(size) if p != rank]
        self._closed = False
        self._desc = describe(0, "")
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
        # data <= slots in flight (two WRs each: header and payload), credits <= slots / batch, plus
        # control and abort messages
        self.sq_depth = 3 * self.slots + 8
        self.rq_depth = 2 * self.slots + 8
        max_cqe = self.ctx.query_device().max_cqe
        cqe = max(16, min(max_cqe, npeers * (self.sq_depth + self.rq_depth) + 16))
        self.cq = rd.CompletionQueue(self.ctx, cqe, channel=self.channel)
        self.credit_batch = max(1, self.slots // 2)
        # credits bound what is in flight; every free slot may take a message ahead
        self.send_window = self.slots
        # Receive slots of every peer in one registration; peer p owns [slot_base[p], + per_peer).
        per_peer = self.slots * self.slot_stride
        self.slot_mr = rd.MemoryRegion.allocate(self.pd, max(1, npeers) * per_peer,
                                                rd.ACCESS_LOCAL_WRITE | rd.ACCESS_REMOTE_WRITE)
        self.slot_array = self.slot_mr.array()
        # The headers of the messages in flight: one per credit and peer, reused slot by slot (a
        # credit comes back only after its message, and so its header, has arrived).
        self.header_mr = rd.MemoryRegion.allocate(self.pd, max(1, npeers) * self.slots * HEADER_ROOM,
                                                  rd.ACCESS_LOCAL_WRITE)
        self.qp, self.remote = {}, {}
        for p in self.peers:
            qp = rd.QueuePair(self.pd, rd.QPT_RC, self.cq, max_send_wr=self.sq_depth, max_recv_wr=self.rq_depth,
                              port=port, gid_index=gid_index)
            qp.to_init()     # the port is the QP's already; to_init(port=) would re-pick the GID
            recv = rd.RecvWR([], wr_id=p << 2)    # WRITE_WITH_IMM consumes a receive but no buffer
            for _ in range(self.rq_depth):
                qp.post_recv(recv)
            self.qp[p] = qp
        self._own_mr = self._own = None
        self._work_mr = self._work = None
        self._work_offset = 0          # where the work area starts in _work_mr
        self._lent = False
        self._gpu_sync = None          # set while the work area is GPU memory
        # Callers' buffers registered by use_buffer, most recent last. Each MR keeps its buffer
        # alive, so its address range cannot be freed and handed to other memory while cached.
        self._user_mrs = collections.OrderedDict()
        self.buffer(0)
        placeholder = Endpoint(qpn=0, psn=0)
        record = b"".join((placeholder if p == self.rank else self.qp[p].endpoint(mr=self.slot_mr)).to_bytes()
                          for p in range(self.size))
        records = exchange.allgather(record)
        for p in self.peers:
            rec = records[p]
            if len(rec) != self.size * WIRE_SIZE:
                raise WireFormatError(f"rank {p} sent a {len(rec)}-byte connection record, expected "
                                      f"{self.size * WIRE_SIZE} (different world size or pyrdma version?)")
            ep = Endpoint.from_bytes(rec[self.rank * WIRE_SIZE:(self.rank + 1) * WIRE_SIZE])
            if ep.length != self.slot_mr.length:
                raise UsageError(f"rank {p} registered {ep.length} bytes of receive slots, rank {self.rank} "
                                 f"{self.slot_mr.length}: the ranks were given different max_message or slots")
            self.qp[p].to_rtr(ep)
            self.qp[p].to_rts(timeout=self.qp_timeout)
            # our slots in the peer's region: it orders its peers by rank, skipping itself
            their_index = self.rank if self.rank < p else self.rank - 1
            self.remote[p] = (ep.addr + their_index * self.slots * self.slot_stride, ep.rkey)
        from pyrdma._engine import Engine
        self.engine = Engine(self.cq, [self.qp.get(p) for p in range(self.size)], self.slot_mr, self.header_mr,
                             [self.remote.get(p, (0, 0)) for p in range(self.size)], self.rank, self.size,
                             self.slots, self.slot_stride, self.max_message, self.sq_depth, self.timeout, self.spin)
        exchange.allgather(b"rdma-connected")   # nobody writes before every QP is ready to receive

    # ---- the interface ------------------------------------------------------------------------

    def work_area(self, nbytes, lend=None, start=0):
        """The work area of the next collective: ``lend[start:start + nbytes]`` in place (a
        C-contiguous uint8 array, numpy or CuPy: sends go straight from it), else this transport's
        own registered buffer of at least ``nbytes``. A lent array is registered on first use (GPU
        memory through GPUDirect RDMA) and stays registered (and alive) among the USER_MR_CACHE
        most recent, so calls on the same memory pay nothing."""
        if lend is None:
            if self._own is None or self._own.nbytes < nbytes:
                if self._own_mr is not None:
                    self._own_mr.close()         # every schedule ends with its sends completed
                self._own_mr = self.rd.MemoryRegion.allocate(self.pd, _grow(nbytes), self.rd.ACCESS_LOCAL_WRITE)
                self._own = self._own_mr.array()
            self._work, self._work_mr, self._work_offset = self._own, self._own_mr, 0
            self._lent, self._gpu_sync = False, None
            return self._work
        on_gpu = not isinstance(lend, np.ndarray)
        addr = lend.data.ptr if on_gpu else lend.__array_interface__["data"][0]
        size = lend.nbytes
        for (key_addr, key_len), (mr, key_offset) in self._user_mrs.items():
            if key_addr <= addr and addr + size <= key_addr + key_len:
                self._user_mrs.move_to_end((key_addr, key_len))
                base = key_offset + addr - key_addr
                break
        else:
            if on_gpu:
                # a dma-buf registration covers whole pages: the array starts part way in
                from pyrdma.cuda import gpu_array_offset, register_gpu_array
                mr = register_gpu_array(self.pd, lend, 0)
                base = gpu_array_offset(mr, lend)
            else:
                mr, base = self.rd.MemoryRegion(self.pd, lend, 0), 0   # local read: only sent from
            self._user_mrs[(addr, size)] = (mr, base)
            while len(self._user_mrs) > USER_MR_CACHE:
                self._user_mrs.popitem(last=False)[1][0].close()
        self._work = lend[start:start + nbytes]
        self._work_mr, self._work_offset, self._lent = mr, base + start, True
        # the NIC reads GPU memory behind CUDA's back: what the stream wrote there must be done first
        self._gpu_sync = _current_stream().synchronize if on_gpu else None
        return self._work

    def buffer(self, nbytes):
        """The current work area (the own buffer, grown to ``nbytes``, unless memory is lent)."""
        if self._lent:
            if self._work.nbytes < nbytes:
                raise UsageError(f"the lent work area has {self._work.nbytes} bytes, {nbytes} needed")
            return self._work
        return self.work_area(nbytes)

    def use_buffer(self, whole, start=0, stop=None):
        """Work in place on ``whole[start:stop]`` until use_buffer(None) (see work_area)."""
        if whole is None:
            self.work_area(0)
        else:
            self.work_area((whole.nbytes if stop is None else stop) - start, whole, start)

    def set_tag(self, desc):
        self._desc = _as_desc(desc)

    def run(self, schedule, dtype=0, op=0, consume=None):
        """Execute ``schedule`` (schedule.Schedule) on the work area in the C engine: one call,
        without the GIL. ``dtype``/``op``: pyrdma._reduce codes; ``consume(kind, chunk, data)``:
        the consumer of received chunks for a GPU work area (None: host memory, reduced in C)."""
        if self._gpu_sync is not None:
            self._gpu_sync()
        callback = None
        if consume is not None:
            slots = self.slot_array

            def callback(kind, off, nbytes, aux, at):
                consume(kind, (off, nbytes, aux), slots[at:at + nbytes])
        if self.failure is None:
            failed = self.engine.run(schedule.steps, schedule.chunks, self._work_mr.addr + self._work_offset,
                                     self._work.nbytes, self._work_mr.lkey, self._desc, dtype, op, callback)
            if failed:
                self.failure = self._engine_error()
        if self.failure is not None:
            raise self.failure

    def _engine_error(self):
        """The exception of the engine's failure, in the one hierarchy."""
        from pyrdma import _engine
        kind, peer, what, a, b, desc = self.engine.failure()
        name = _engine.FAILURES.get(kind)
        if name == "python":
            return self.engine.python_error()
        if name == "closed":
            return closed_error()
        if name == "abort":
            return abort_error(peer, a, b)
        if name == "mismatch":
            try:
                check_header(peer, self.rank, desc, a, self._desc, b)
            except UsageError as exc:
                return exc
        if name == "link":
            rd = self.rd
            return PeerError(f"the link from rank {self.rank} to rank {peer} failed: {rd.wc_status_name(a)} "
                             f"({rd.wc_status_str(a)}); rank {peer} died or left", peer=peer)
        if name == "timeout":
            self.reports = self.engine.reports()
            waits = {"credit": "a free receive slot (a credit)", "arrival": f"a {a}-byte message",
                     "send queue": "send queue space", "sends": "the completion of its sends"}
            return self._stall_error(peer, waits.get(_engine.WAITS.get(what), "progress"))
        if name == "malformed":
            return _malformed(peer, f"a message its credits did not allow, or longer than max_message "
                                    f"(immediate {a:#x})")
        if name == "post":
            return PeerError(f"posting to rank {peer} failed (errno {a}): its queue pair is in error; rank {peer} "
                             f"died or left", peer=peer)
        return RDMAError(f"the completion queue failed (errno {a})", call="ibv_poll_cq")

    def interrupt(self):
        super().interrupt()
        self.engine.interrupt()

    def abort(self, culprit, reason):
        """Tell every peer (best effort, no waiting) that this group failed because of ``culprit``."""
        if self._closed:
            return
        for p in self.peers:
            if p == culprit and reason == PEER_FAILED:
                continue
            self._post_control(p, _imm_abort(culprit, reason))

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.ctx.close()   # closes QPs, MRs, CQ, channel and PD, children first

    # ---- internals ----------------------------------------------------------------------------

    def _post_control(self, peer, imm):
        """A zero-byte message outside flow control; dropped when the send queue is full."""
        self.engine.post_control(peer, imm)

    def _send_query(self, peer, epoch):
        self._post_control(peer, _imm_control(_CTRL_QUERY, epoch))


# ------------------------------------------------------------------------------------------------
# TCP

_HELLO = struct.Struct("!8sBxxxii16s")       # magic, version, rank, world size, the listener's token
_HELLO_MAGIC = b"PYRDMATC"
_HELLO_VERSION = 3                           # 2: data frames carry the collective's description; 3: token
_TOKEN_SIZE = 16
_FRAME = struct.Struct("!BxxxIQ")             # kind, 0 (abort: reason; control: epoch), length or value
_TCP_QUERY, _TCP_REPORT = 3, 4
MAX_TCP_MESSAGE = 1 << 30                     # the bound on max_message, so on any frame a peer may send
HELLO_TIMEOUT = 10.0                          # the longest an accepted connection may take to say hello


def _malformed(peer, what):
    err = PeerError(f"rank {peer} sent a malformed frame ({what}); its connection is dropped", peer=peer)
    err.malformed = True
    return err


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


class TcpTransport(_Waits):
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
        self._desc = describe(0, "")
        self._closed = False
        self._cond = threading.Condition()
        self.inbox = {p: collections.deque() for p in self.peers}
        self.gone = {}                       # peer -> why its connection ended
        self.queries = {}                    # peer -> epoch of its unanswered QUERY
        self.socks = {}
        self._own = self._work = None
        self._lent = False
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

    def work_area(self, nbytes, lend=None, start=0):
        """``lend[start:start + nbytes]`` in place, else this transport's own buffer (>= nbytes)."""
        if lend is None:
            if self._own is None or self._own.nbytes < nbytes:
                self._own = np.empty(_grow(nbytes), np.uint8)
            self._work, self._lent = self._own, False
        else:
            self._work, self._lent = lend[start:start + nbytes], True
        return self._work

    def buffer(self, nbytes):
        if self._lent:
            if self._work.nbytes < nbytes:
                raise UsageError(f"the lent work area has {self._work.nbytes} bytes, {nbytes} needed")
            return self._work
        return self.work_area(nbytes)

    def use_buffer(self, whole, start=0, stop=None):
        """Work in place on ``whole[start:stop]`` until use_buffer(None)."""
        if whole is None:
            self.work_area(0)
        else:
            self.work_area((whole.nbytes if stop is None else stop) - start, whole, start)

    def set_tag(self, desc):
        self._desc = _as_desc(desc)

    def run(self, schedule, dtype=0, op=0, consume=None):
        """Execute ``schedule`` on the work area, in Python (schedule.execute)."""
        if consume is None:
            consume = consumer(self._work, functools.partial(_reduce.reduce_bytes, dtype=dtype, op=op))
        execute(self, schedule, consume)

    def can_send(self, peer):
        return True   # the peer's reader thread drains its socket, so a send never waits on it

    def send(self, peer, offset, nbytes):
        if nbytes > self.max_message:
            raise UsageError(f"message of {nbytes} bytes exceeds max_message={self.max_message}")
        if self.failure is not None:
            raise self.failure
        header = _FRAME.pack(_KIND_DATA, 0, nbytes) + self._desc
        chunk = self._work[offset:offset + nbytes]
        if not isinstance(chunk, np.ndarray):
            chunk = chunk.get()          # a GPU work area (CuPy): copied out in stream order
        if nbytes <= 65536:
            self._send_bytes(peer, header + chunk.tobytes())
        else:
            self._send_bytes(peer, header)
            self._send_bytes(peer, memoryview(chunk))

    def recv(self, peer, nbytes):
        inbox = self.inbox[peer]
        if not inbox:
            self._wait(lambda: len(inbox) > 0, peer, f"a {nbytes}-byte message")
        with self._cond:
            desc, data = inbox.popleft()
        if desc != self._desc or len(data) != nbytes:
            check_header(peer, self.rank, desc, len(data), self._desc, nbytes)
        return np.frombuffer(data, np.uint8)

    def release(self, peer):
        pass

    def wait_sends(self, peer=None):
        pass   # sendall() returned: the kernel has the bytes

    def abort(self, culprit, reason):
        frame = _FRAME.pack(_KIND_ABORT, reason, culprit)
        for p, s in self.socks.items():
            if p in self.gone or (p == culprit and reason == PEER_FAILED):
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
        sock = self.socks[peer]
        try:
            sock.sendall(data)
        except socket.timeout:
            raise PeerError(f"rank {peer} took no data from rank {self.rank} for {self.timeout:g} s "
                            f"(dead or stalled?)", peer=peer) from None
        except OSError as exc:
            raise PeerError(f"rank {peer} is gone: sending to it failed ({exc})", peer=peer) from None

    def _check_peer(self, peer):
        if peer in self.gone and not self.inbox[peer]:
            raise PeerError(f"rank {peer} is gone: {self.gone[peer]} (it died, or closed its communicator)",
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
                        self.inbox[peer].append((desc, data))
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
            self.gone[peer] = why
            self._cond.notify_all()

    def interrupt(self):
        super().interrupt()
        with self._cond:
            self._cond.notify_all()


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
